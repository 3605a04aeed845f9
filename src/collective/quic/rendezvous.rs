//! The rendezvous: rank 0 waits for every other rank's [`Hello`], refuses one that does not match its own
//! or claims a rank already taken, and once all have joined sends each the ring of listen addresses and
//! the fingerprint of the certificate each rank presented ([`Control::Welcome`]). The other ranks dial
//! rank 0 until it is up, say hello and wait for the welcome. Either way the connections to rank 0 stay
//! open afterwards as the control plane.

use std::net::SocketAddr;
use std::time::Duration;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::time::Instant;

use super::auth::{check_pinned, dial, peer_fingerprint, Fingerprint};
use super::framing::{control_frame, read_control};
use super::links::Ring;
use super::listener::{Cause, Joined, Listener, Refusals};
use super::messages::{Control, Hello, LocalEndpoint};
use super::{local, QuicConfig};
use crate::collective::frame::PROTOCOL_VERSION;
use crate::collective::shm::host_identity;
use crate::collective::two_level;
use crate::collective::{CollectiveError, Result};

/// How a rank whose setup is over answers a rendezvous hello.
pub(super) const RENDEZVOUS_CLOSED: &str = "the rendezvous is closed";

/// Rank 0's answer to a member asking to join while the running ranks re-form their ring.
pub(super) const RE_FORMING: &str = "rank 0 is re-forming the ring; ask again when it runs";

/// This rank's hello, with its shared-memory endpoint `local`.
pub(super) fn hello(cfg: &QuicConfig, local: Option<LocalEndpoint>) -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        job_id: cfg.job_id,
        rank: cfg.rank,
        world: cfg.world,
        config_hash: cfg.config_hash,
        advertise: cfg.advertise_addr,
        local,
        host: host_identity(cfg.host_id.as_deref()).ok(),
        collective: cfg.collective.as_str().to_string(),
    }
}

/// Rank 0 (whose endpoint presents the certificate `own_cert`, and whose shared-memory endpoint is
/// `own_local`): waits until every other rank has joined, then welcomes them all. Returns the ring and the
/// joined ranks' connections (entry `r - 1` is rank `r`'s).
pub(super) async fn host(
    cfg: &QuicConfig,
    listener: &mut Listener,
    own_cert: Fingerprint,
    own_local: Option<LocalEndpoint>,
    deadline: Instant,
) -> Result<(Ring, Vec<Joined>)> {
    let slots = collect_hellos(cfg, listener, deadline).await?;
    let mut joined: Vec<Joined> = slots.into_iter().skip(1).map(|s| s.expect("all joined")).collect();
    let mut ring = Ring {
        addrs: vec![cfg.master],
        certs: vec![own_cert],
        locals: vec![own_local],
        two_level: None,
    };
    let mut hosts = vec![host_identity(cfg.host_id.as_deref()).ok()];
    for j in &joined {
        // The address the others dial (advertised, else observed), and the certificate the rank presented
        // (checked present when the hello was taken).
        ring.addrs.push(listen_addr(j));
        ring.certs
            .push(peer_fingerprint(&j.conn).expect("checked in collect_hellos"));
        ring.locals.push(match &j.msg {
            Control::Hello(h) => h.local.clone(),
            _ => None,
        });
        hosts.push(match &j.msg {
            Control::Hello(h) => h.host.clone(),
            _ => None,
        });
    }
    // Rank 0 alone decides the layout, from the hosts the ranks reported, so that every rank runs the same.
    ring.two_level = match two_level::resolve(cfg.collective, &two_level::host_labels(&hosts)) {
        Ok(layout) => layout,
        Err(reason) => {
            for j in joined {
                j.refuse(cfg.job_id, &listener.refusals, Cause::Refused, reason.clone());
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            return Err(local(reason));
        }
    };
    let welcome = control_frame(
        cfg.job_id,
        &Control::Welcome {
            addrs: ring.addrs.clone(),
            certs: ring.certs.clone(),
            locals: ring.locals.clone(),
            two_level: ring.two_level.clone(),
        },
    );
    for j in &mut joined {
        j.send
            .write_all(&welcome)
            .await
            .map_err(|e| local(format!("rendezvous: {e}")))?;
    }
    Ok((ring, joined))
}

/// Where the others should dial a joined rank: the address it advertised, else the one its hello came from
/// (its own endpoint, unless something stands between it and rank 0).
fn listen_addr(j: &Joined) -> SocketAddr {
    match &j.msg {
        Control::Hello(Hello { advertise: Some(a), .. }) => *a,
        // A dual-stack rank 0 (bound to `::`) sees IPv4 peers as `::ffff:a.b.c.d`, which their IPv4
        // neighbours could not dial.
        _ => {
            let seen = j.conn.remote_address();
            SocketAddr::new(seen.ip().to_canonical(), seen.port())
        }
    }
}

/// Rank 0: takes hellos until ranks 1..world have each joined with a matching one (`slots[r]` is rank
/// `r`'s connection), refusing the others. Peer hellos that arrive meanwhile are kept for the ring stage.
async fn collect_hellos(cfg: &QuicConfig, listener: &mut Listener, deadline: Instant) -> Result<Vec<Option<Joined>>> {
    let n = cfg.world;
    let me = hello(cfg, None);
    let mut slots: Vec<Option<Joined>> = (0..n).map(|_| None).collect();
    let mut joined = 0;
    let mut progress = Progress::new();
    while joined < n - 1 {
        let j = tokio::select! {
            j = listener.next() => j.ok_or_else(|| local("rendezvous listener stopped"))?,
            _ = tokio::time::sleep_until(progress.next_report) => {
                progress.report(cfg, &mut slots, &listener.refusals).await;
                continue;
            }
            _ = tokio::time::sleep_until(deadline) => {
                let missing: Vec<usize> = (1..n).filter(|&r| slots[r].is_none()).collect();
                if cfg.re_forming() {
                    return Err(unformed(cfg, slots, missing).await);
                }
                let mut reason = format!("rendezvous timed out after {:?}: ranks {missing:?} did not join",
                    cfg.rendezvous_timeout);
                reason.push_str(&auth_failures(&listener.refusals.wrong_secret(), "meanwhile "));
                // The ranks that did join hear why from rank 0, instead of only that they waited too long.
                for j in slots.into_iter().flatten() {
                    j.refuse(cfg.job_id, &listener.refusals, Cause::Refused, reason.clone());
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                return Err(local(reason));
            }
        };
        let hello = match &j.msg {
            Control::Hello(h) => h.clone(),
            Control::PeerHello { .. } => {
                listener.early_peers.push(j);
                continue;
            }
            _ => continue,
        };
        // A member asking to join while the running ranks re-form: it asks again once they run.
        let rejoining = cfg
            .elastic_first
            .is_some_and(|first| first == hello.job_id && first != cfg.job_id);
        if rejoining {
            j.refuse(cfg.job_id, &listener.refusals, Cause::Refused, RE_FORMING.to_string());
            continue;
        }
        let verdict = hello.check_against(&me).and_then(|_| {
            if slots[hello.rank].is_some() {
                Err(format!("rank {} has already joined", hello.rank))
            } else if peer_fingerprint(&j.conn).is_none() {
                Err(format!("rank {} presented no certificate", hello.rank))
            } else {
                Ok(())
            }
        });
        match verdict {
            Ok(()) => {
                slots[hello.rank] = Some(j);
                joined += 1;
            }
            Err(reason) => j.refuse(cfg.job_id, &listener.refusals, Cause::Refused, reason),
        }
    }
    Ok(slots)
}

/// Rank 0 of an elastic re-form whose rendezvous passed its deadline without `missing`: tells the ranks that
/// did join (`slots`) whom the next attempt leaves out, so that all of them, and rank 0, agree on it.
async fn unformed(cfg: &QuicConfig, slots: Vec<Option<Joined>>, missing: Vec<usize>) -> CollectiveError {
    tracing::warn!(
        "rank 0: the re-form's rendezvous timed out after {:?} without ranks {missing:?}",
        cfg.rendezvous_timeout
    );
    let verdict = control_frame(
        cfg.job_id,
        &Control::Unformed {
            missing: missing.clone(),
        },
    );
    let mut joined: Vec<Joined> = slots.into_iter().flatten().collect();
    for j in &mut joined {
        // A rank that cannot be told sees its link to rank 0 fail, and leaves rank 0 out instead: the next
        // attempt then lacks it, and the quorum rule decides whether that one can go on.
        let _ = j.send.write_all(&verdict).await;
        let _ = j.send.finish();
    }
    // Long enough for the verdict to leave before the endpoint closes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    CollectiveError::Unformed { missing }
}

/// How long the rendezvous waits quietly before saying what it is waiting for, and then how often it looks
/// again (it speaks again only when the answer changed).
const PROGRESS_EVERY: Duration = Duration::from_secs(3);

/// Rank 0's reports of a rendezvous that is taking long: who is missing, and which peers failed
/// authentication meanwhile (the usual reason a rank "did not join"). Logged on rank 0 and sent to every
/// rank that has joined, each time the answer changes.
struct Progress {
    next_report: Instant,
    last_note: String,
}

impl Progress {
    fn new() -> Self {
        Progress {
            next_report: Instant::now() + PROGRESS_EVERY,
            last_note: String::new(),
        }
    }

    async fn report(&mut self, cfg: &QuicConfig, slots: &mut [Option<Joined>], refusals: &Refusals) {
        self.next_report = Instant::now() + PROGRESS_EVERY;
        let note = waiting_note(slots, &refusals.wrong_secret());
        if note == self.last_note {
            return;
        }
        tracing::warn!("rank 0: rendezvous: {note}");
        let frame = control_frame(cfg.job_id, &Control::Waiting { note: note.clone() });
        for j in slots.iter_mut().flatten() {
            // No timeout: cancelling a write midway would leave half a frame on the stream. A note goes out
            // only when it changed, so all of them together stay far below the stream's flow-control
            // credit, and the write returns at once even if the rank reads nothing. A rank that cannot be
            // told hears the outcome with the welcome or the refusal.
            let _ = j.send.write_all(&frame).await;
        }
        self.last_note = note;
    }
}

/// What the rendezvous is waiting for: the missing ranks, and the peers refused for another secret.
fn waiting_note(slots: &[Option<Joined>], wrong_secret: &[SocketAddr]) -> String {
    let missing: Vec<usize> = (1..slots.len()).filter(|&r| slots[r].is_none()).collect();
    let mut note = format!(
        "still waiting for ranks {missing:?} ({} of {} have joined)",
        slots.len() - missing.len(),
        slots.len()
    );
    note.push_str(&auth_failures(wrong_secret, ""));
    note
}

/// `; <lead>a peer at ADDR, ... failed authentication (...)`, or nothing when no peer did.
fn auth_failures(wrong_secret: &[SocketAddr], lead: &str) -> String {
    if wrong_secret.is_empty() {
        return String::new();
    }
    let list: Vec<String> = wrong_secret.iter().map(|a| a.to_string()).collect();
    format!(
        "; {lead}a peer at {} failed authentication (started with another cluster secret?)",
        list.join(", ")
    )
}

/// The connection to rank 0 that a joining rank keeps as its control plane.
pub(super) struct HostLink {
    pub(super) conn: Connection,
    pub(super) send: SendStream,
    pub(super) recv: RecvStream,
}

/// Ranks 1..world: dials rank 0, says hello and waits for the welcome. Returns the ring and the connection
/// to rank 0.
pub(super) async fn join(
    cfg: &QuicConfig,
    endpoint: &Endpoint,
    key: &[u8; 32],
    own_local: Option<LocalEndpoint>,
    deadline: Instant,
) -> Result<(Ring, HostLink)> {
    let (conn, send, recv, reply) = loop {
        let (conn, mut send, mut recv) = dial_host(cfg, endpoint, key, deadline).await?;
        send.write_all(&control_frame(
            cfg.job_id,
            &Control::Hello(hello(cfg, own_local.clone())),
        ))
        .await
        .map_err(|e| local(format!("rendezvous: {e}")))?;
        // Rank 0 of a re-form answers by its own deadline, which it set before this rank reached it: wait
        // that long from now, with a margin for the answer's way, so that its verdict arrives.
        let verdict_by = match cfg.re_forming() {
            true => deadline.max(Instant::now() + cfg.rendezvous_timeout + VERDICT_MARGIN),
            false => deadline,
        };
        let reply = loop {
            let reply = match tokio::time::timeout_at(verdict_by, read_control(&mut recv, None)).await {
                Ok(reply) => reply,
                Err(_) if cfg.re_forming() => return Err(host_absent(cfg, "did not answer")),
                Err(_) => return Err(local("rendezvous timed out waiting for the other ranks")),
            };
            match reply {
                Ok(Control::Waiting { note }) => tracing::warn!("rank {}: rendezvous: {note}", cfg.rank),
                other => break other,
            }
        };
        // An elastic re-form: rank 0's last ring may still answer at its address for a moment, refusing or
        // closing; the new epoch's rendezvous opens there right after.
        let old_ring = match &reply {
            Ok(Control::Refused { reason }) => reason.starts_with(RENDEZVOUS_CLOSED),
            Ok(_) => false,
            Err(e) => e.contains("closed"),
        };
        if let (Err(e), false, true) = (&reply, old_ring, cfg.re_forming()) {
            return Err(host_absent(cfg, e));
        }
        let reply = reply.map_err(|e| local(format!("rendezvous with rank 0: {e}")));
        if old_ring && cfg.elastic_first.is_some() && Instant::now() + Duration::from_millis(200) < deadline {
            conn.close(0u32.into(), b"again");
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        break (conn, send, recv, reply?);
    };
    let ring = welcomed_ring(reply, cfg.world)?;
    // Rank 0's entry must be the certificate it presented to this connection, the control plane.
    check_pinned(&conn, 0, &ring.certs[0]).map_err(|e| local(format!("rendezvous: {e}")))?;
    Ok((ring, HostLink { conn, send, recv }))
}

/// How long after rank 0's own deadline its verdict on a re-form may take to arrive.
const VERDICT_MARGIN: Duration = Duration::from_secs(2);

/// A re-form's rank 0 could not be reached or stopped answering (`why`): the next attempt leaves it out.
fn host_absent(cfg: &QuicConfig, why: impl std::fmt::Display) -> CollectiveError {
    tracing::warn!("rank {}: the re-form's rank 0 at {}: {why}", cfg.rank, cfg.master);
    CollectiveError::Unformed { missing: vec![0] }
}

/// Dials rank 0, retrying every 200 ms until it answers (it may not be up yet) or the deadline passes. A
/// failed authentication is final.
async fn dial_host(
    cfg: &QuicConfig,
    endpoint: &Endpoint,
    key: &[u8; 32],
    deadline: Instant,
) -> Result<(Connection, SendStream, RecvStream)> {
    // Said once, after a few seconds without an answer: rank 0 may just be starting, but a wrong address or
    // a rank 0 that refused to start would otherwise look like silence until the timeout. An attempt to an
    // address where nothing listens only ends at the idle timeout, so the notice does not wait for it.
    let quiet_until = Instant::now() + PROGRESS_EVERY;
    let mut told = false;
    let mut last_error = String::from("no answer yet");
    loop {
        let attempt = tokio::time::timeout_at(deadline, dial(endpoint, cfg.master, key));
        tokio::pin!(attempt);
        let attempt = loop {
            tokio::select! {
                a = &mut attempt => break a,
                _ = tokio::time::sleep_until(quiet_until), if !told => {
                    told = true;
                    tracing::warn!(
                        "rank {}: rendezvous: rank 0 at {} has not answered for {:?} ({last_error}); retrying \
                         until the rendezvous times out",
                        cfg.rank,
                        cfg.master,
                        PROGRESS_EVERY
                    );
                }
            }
        };
        match attempt {
            Err(_) if cfg.re_forming() => return Err(host_absent(cfg, format!("no answer ({last_error})"))),
            Err(_) => return Err(local(format!("rendezvous with rank 0 at {} timed out", cfg.master))),
            Ok(Ok(c)) => return Ok(c),
            Ok(Err(e)) if e.contains("authentication") || e.contains("authenticate") => {
                return Err(local(format!("rendezvous with rank 0: {e}")))
            }
            Ok(Err(e)) => {
                tracing::debug!("rendezvous attempt failed, retrying: {e}");
                if Instant::now() + Duration::from_millis(200) >= deadline {
                    if cfg.re_forming() {
                        return Err(host_absent(cfg, e));
                    }
                    return Err(local(format!("rendezvous with rank 0 at {} failed: {e}", cfg.master)));
                }
                last_error = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// The ring from rank 0's reply, or why there is none.
fn welcomed_ring(reply: Control, world: usize) -> Result<Ring> {
    match reply {
        Control::Welcome {
            addrs,
            certs,
            locals,
            two_level,
        } if addrs.len() == world && certs.len() == world && locals.len() == world => {
            if let Some(e) = locals.iter().flatten().find_map(|l| l.check().err()) {
                return Err(local(format!(
                    "rendezvous: rank 0 sent a bad shared-memory endpoint: {e}"
                )));
            }
            // Whether it can run is checked where this rank builds its place in it (`setup`).
            if let Some(labels) = two_level.as_ref().filter(|l| l.len() != world) {
                return Err(local(format!(
                    "rendezvous: rank 0 sent a two-level layout of {} ranks for world size {world}",
                    labels.len()
                )));
            }
            Ok(Ring {
                addrs,
                certs,
                locals,
                two_level,
            })
        }
        Control::Welcome {
            addrs, certs, locals, ..
        } => Err(local(format!(
            "rendezvous: rank 0 sent {} addresses, {} certificates and {} endpoints for world size {world}",
            addrs.len(),
            certs.len(),
            locals.len()
        ))),
        Control::Refused { reason } => Err(local(format!("rendezvous refused by rank 0: {reason}"))),
        Control::Unformed { missing } if !missing.is_empty() && missing.iter().all(|&r| r > 0 && r < world) => {
            Err(CollectiveError::Unformed { missing })
        }
        other => Err(local(format!("rendezvous: unexpected reply {other:?}"))),
    }
}
