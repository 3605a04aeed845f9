//! The ring's data links. Each rank opens a link to its right neighbour (saying [`Control::PeerHello`]
//! first) and accepts one from its left; a reader task moves the left link's frames to the collective loop
//! through a bounded queue. Both ends pin the link to the neighbour's certificate as rank 0 saw it at
//! rendezvous ([`Ring::certs`]): a peer that knows the secret but is not that rank is refused, and the
//! real neighbour can still connect.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::auth::{check_pinned, dial, Fingerprint};
use super::framing::{control_frame, read_data_frame, LinkEvent, ReadFail};
use super::listener::{Cause, Listener, Refusals};
use super::messages::Control;
use super::messages::LocalEndpoint;
use super::rendezvous::RENDEZVOUS_CLOSED;
use super::shm_links::{self, ShmListener, ShmReceiver, ShmSender};
use super::{local, QuicConfig, Shared, MAX_GATHER_BLOB};
use crate::collective::shm::LinkTransport;
use crate::collective::two_level::{SubRing, TwoLevel};
use crate::collective::{CollectiveError, Result};

/// Data frames the left link's reader holds for the engine. Past that it stops reading, and QUIC flow
/// control holds the sender back, so a rank buffers at most this many sub-chunks (retained at most 4x, see
/// `framing::MIN_ZERO_COPY_PIECE`) whatever its neighbour sends. The ring cannot deadlock on it: the
/// collective loop keeps taking frames while its own writes wait (`driver`).
const MAX_QUEUED_FRAMES: usize = 32;

/// The link to the right neighbour: its connection and where this rank writes the link's frames.
pub(super) struct RightLink {
    /// Kept open for the link's lifetime.
    pub(super) _conn: Connection,
    pub(super) data: RightData,
}

/// Where a right link's frames go.
pub(super) enum RightData {
    /// The QUIC stream the link opened with.
    Quic(SendStream),
    /// The shared segment (the QUIC stream stays open beside it, unused).
    Shm { sender: ShmSender, _stream: SendStream },
}

impl RightData {
    /// Writes one frame's pieces in order.
    pub(super) async fn write_all_chunks(&mut self, chunks: &mut [bytes::Bytes]) -> std::result::Result<(), String> {
        match self {
            RightData::Quic(send) => send.write_all_chunks(chunks).await.map_err(|e| e.to_string()),
            RightData::Shm { sender, .. } => sender.write_all_chunks(chunks).await,
        }
    }

    /// Writes one frame's pieces at once if this is a shared-memory link with room for them now; returns
    /// whether it did. A QUIC link never does (its writes go through [`RightData::write_all_chunks`]).
    pub(super) fn try_write_now(&mut self, pieces: &[&[u8]]) -> std::result::Result<bool, String> {
        match self {
            RightData::Quic(_) => Ok(false),
            RightData::Shm { sender, .. } => sender.try_write_whole(pieces),
        }
    }

    /// "quic" or "shm".
    pub(super) fn kind(&self) -> &'static str {
        match self {
            RightData::Quic(_) => "quic",
            RightData::Shm { .. } => "shm",
        }
    }
}

/// The link from the left neighbour: its connection, the reader task's queue, and, when its frames come
/// through shared memory, that reader task (stopped when this rank crashes on purpose, so that its
/// neighbour sees the link's socket close as it would for a dead process).
pub(super) struct LeftLink {
    /// Kept open for the link's lifetime.
    pub(super) _conn: Connection,
    pub(super) rx: mpsc::Receiver<LinkEvent>,
    pub(super) shm_reader: Option<tokio::task::JoinHandle<()>>,
}

/// The ring as rank 0 handed it out: every rank's listen address, certificate fingerprint and shared-memory
/// endpoint, in rank order, and the two-level layout rank 0 resolved (each rank's host label), if any.
pub(super) struct Ring {
    pub(super) addrs: Vec<SocketAddr>,
    pub(super) certs: Vec<Fingerprint>,
    pub(super) locals: Vec<Option<LocalEndpoint>>,
    pub(super) two_level: Option<Vec<usize>>,
}

/// A rank's data links, keyed by the neighbour's rank: one to each rank it sends to and one from each rank
/// it receives from, on any of its rings (the flat ring, and the host and cross rings of a two-level
/// layout). A pair of ranks that are neighbours on several rings shares one link.
#[derive(Default)]
pub(super) struct DataLinks {
    pub(super) rights: BTreeMap<usize, RightLink>,
    pub(super) lefts: BTreeMap<usize, LeftLink>,
    /// The left links' send sides, unused but kept open for the links' lifetime.
    pub(super) keep: Vec<SendStream>,
}

/// The distinct ranks `rank` sends to and receives from on the flat ring and on the rings of `two_level`.
pub(super) fn neighbours(rank: usize, world: usize, two_level: Option<&TwoLevel>) -> (Vec<usize>, Vec<usize>) {
    let mut rights = BTreeSet::from([(rank + 1) % world]);
    let mut lefts = BTreeSet::from([(rank + world - 1) % world]);
    if let Some(t) = two_level {
        for ring in [SubRing::Host, SubRing::Cross] {
            if let Some((members, pos)) = t.ring(ring) {
                let m = members.len();
                rights.insert(members[(pos + 1) % m]);
                lefts.insert(members[(pos + m - 1) % m]);
            }
        }
    }
    (rights.into_iter().collect(), lefts.into_iter().collect())
}

/// Opens the links to every right neighbour and accepts those from every left one, concurrently, each
/// through shared memory when its two ranks share a host and `shm` (this rank's segment listener) is
/// there. Gives up when rank 0 reports a rank dead meanwhile, or at `deadline`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn connect(
    cfg: &QuicConfig,
    endpoint: &Endpoint,
    key: &[u8; 32],
    ring: &Ring,
    two_level: Option<&TwoLevel>,
    listener: &mut Listener,
    shm: Option<&ShmListener>,
    shared: &Shared,
    deadline: Instant,
) -> Result<DataLinks> {
    let n = cfg.world;
    if n == 1 {
        return Ok(DataLinks::default());
    }
    let rank = cfg.rank;
    let (rights, lefts) = neighbours(rank, n, two_level);
    let local_to = |r: usize| shm.is_some() && same_host(&ring.locals[rank], &ring.locals[r]);
    let (flat_left, flat_right) = ((rank + n - 1) % n, (rank + 1) % n);
    if cfg.transport == LinkTransport::Shm && shm.is_some() && !local_to(flat_right) && !local_to(flat_left) {
        return Err(local(format!(
            "--transport shm: neither ring neighbour of rank {rank} (ranks {flat_left} and {flat_right}) shares its \
             host"
        )));
    }
    let refusals = listener.refusals.clone();
    let open_rights = futures_util::future::try_join_all(rights.iter().map(|&right_rank| {
        let refusals = &refusals;
        async move {
            let right = Neighbour {
                rank: right_rank,
                addr: if right_rank == 0 {
                    cfg.master
                } else {
                    ring.addrs[right_rank]
                },
                cert: ring.certs[right_rank],
            };
            let sender = match &ring.locals[right_rank] {
                Some(e) if local_to(right_rank) => shm_links::offer_right(cfg, right_rank, e, deadline).await?,
                _ => None,
            };
            let link = open_right(cfg, endpoint, key, right, refusals, sender, deadline).await?;
            Ok::<_, CollectiveError>((right_rank, link))
        }
    }));
    let accept_lefts = accept_lefts(cfg, &lefts, ring, listener, shm, &local_to, deadline);
    // A rank that dies or aborts while the ring forms is reported by rank 0: stop waiting then. The verdict
    // is checked first, so that a link that failed because of it never hides it.
    let mut prx = shared.poison.subscribe();
    let (r, l) = tokio::select! {
        biased;
        p = prx.wait_for(|p| p.is_some()) => {
            return Err(p.ok().and_then(|p| p.clone()).unwrap_or_else(|| local("control plane failed")));
        }
        rl = async { tokio::join!(open_rights, accept_lefts) } => rl,
    };
    let (rights, accepted) = match r.and_then(|right| l.map(|left| (right, left))) {
        Ok(links) => links,
        // A neighbour that closed its endpoint has usually left because of a failure elsewhere (it heard of
        // an abort before this rank did): report that failure, not the closed link.
        Err(e) => {
            let grace = (Instant::now() + Shared::verdict_grace(cfg.idle_timeout)).min(deadline);
            return Err(shared.verdict_or(e, grace).await);
        }
    };
    let max_payload = (cfg.sub_chunk * 4).max(MAX_GATHER_BLOB);
    let mut links = DataLinks {
        rights: rights.into_iter().collect(),
        ..DataLinks::default()
    };
    for (left_rank, (conn, send, data)) in accepted {
        let left = match data {
            LeftData::Quic(recv) => LeftLink {
                _conn: conn,
                rx: spawn_reader(recv, max_payload),
                shm_reader: None,
            },
            LeftData::Shm(receiver, _recv) => {
                let (rx, task) = shm_links::spawn_reader(receiver, max_payload, MAX_QUEUED_FRAMES);
                LeftLink {
                    _conn: conn,
                    rx,
                    shm_reader: Some(task),
                }
            }
        };
        links.lefts.insert(left_rank, left);
        links.keep.push(send);
    }
    let over = |shm: bool| if shm { "shm" } else { "quic" };
    let from: Vec<String> = links
        .lefts
        .iter()
        .map(|(r, l)| format!("rank {r} over {}", over(l.shm_reader.is_some())))
        .collect();
    let to: Vec<String> = links
        .rights
        .iter()
        .map(|(r, l)| format!("rank {r} over {}", l.data.kind()))
        .collect();
    tracing::info!(
        "rank {rank}: ring links: from {}, to {}",
        from.join(", "),
        to.join(", ")
    );
    Ok(links)
}

/// Where a left link's frames arrive.
enum LeftData {
    Quic(RecvStream),
    Shm(ShmReceiver, RecvStream),
}

/// An accepted left link.
type Accepted = (Connection, SendStream, LeftData);

/// Accepts every left neighbour's QUIC link (`lefts`) and, when its peer hello says the link's data goes
/// through shared memory, the segment it handed this rank's listener. Segments are accepted while the
/// QUIC links are awaited, since each neighbour attaches its segment first.
async fn accept_lefts(
    cfg: &QuicConfig,
    lefts: &[usize],
    ring: &Ring,
    listener: &mut Listener,
    shm: Option<&ShmListener>,
    local_to: &dyn Fn(usize) -> bool,
    deadline: Instant,
) -> Result<BTreeMap<usize, Accepted>> {
    let local_lefts: Vec<(usize, &LocalEndpoint)> = lefts
        .iter()
        .filter(|&&r| local_to(r))
        .filter_map(|&r| ring.locals[r].as_ref().map(|e| (r, e)))
        .collect();
    // Segments arrive through a queue from one loop that runs beside the QUIC accepts: an offer is answered
    // in several steps, so it must not be cut off midway by a QUIC link arriving.
    let (seg_tx, mut seg_rx) = mpsc::unbounded_channel();
    let segments = async {
        let mut waiting = local_lefts.clone();
        while let (Some(l), false) = (shm, waiting.is_empty()) {
            let got = shm_links::accept_left(cfg, l, &waiting).await;
            if let Ok((r, _)) = &got {
                waiting.retain(|(w, _)| w != r);
            }
            let fatal = got.is_err();
            let _ = seg_tx.send(got);
            if fatal {
                break;
            }
        }
        std::future::pending::<()>().await
    };
    let mut segments = std::pin::pin!(segments);
    let mut quic: BTreeMap<usize, (Connection, SendStream, RecvStream, bool)> = BTreeMap::new();
    let mut attached: BTreeMap<usize, ShmReceiver> = BTreeMap::new();
    loop {
        let segments_missing = quic.iter().any(|(r, q)| q.3 && !attached.contains_key(r));
        if quic.len() == lefts.len() && !segments_missing {
            break;
        }
        let waiting: Vec<(usize, Fingerprint)> = lefts
            .iter()
            .filter(|r| !quic.contains_key(r))
            .map(|&r| (r, ring.certs[r]))
            .collect();
        tokio::select! {
            q = accept_left(cfg.job_id, &waiting, listener), if !waiting.is_empty() => {
                let (r, conn, send, recv, says_shm) = q?;
                quic.insert(r, (conn, send, recv, says_shm));
            }
            s = seg_rx.recv() => {
                let (r, rx) = s.expect("the segment loop keeps its sender")?;
                attached.insert(r, rx);
            }
            _ = &mut segments => unreachable!("the segment loop never ends"),
            _ = tokio::time::sleep_until(deadline) => {
                let missing: Vec<usize> = lefts.iter().copied().filter(|r| !quic.contains_key(r)).collect();
                return Err(local(match missing.as_slice() {
                    [] => "a left neighbour did not hand over its shared segment in time".to_string(),
                    [one] => format!("left neighbour rank {one} did not connect in time"),
                    many => format!("left neighbours {many:?} did not connect in time"),
                }));
            }
        }
    }
    let mut out = BTreeMap::new();
    for (r, (conn, send, recv, says_shm)) in quic {
        let data = match (says_shm, local_to(r)) {
            (true, true) => LeftData::Shm(attached.remove(&r).expect("waited for above"), recv),
            (true, false) => {
                return Err(CollectiveError::Protocol {
                    rank: r,
                    msg: "says its link goes through shared memory, but it does not share this rank's host".into(),
                })
            }
            (false, local) => {
                if local {
                    not_attached(cfg, r, "the left neighbour did not hand over a segment")?;
                }
                LeftData::Quic(recv)
            }
        };
        out.insert(r, (conn, send, data));
    }
    Ok(out)
}

/// The right neighbour as the ring describes it.
struct Neighbour {
    rank: usize,
    addr: SocketAddr,
    cert: Fingerprint,
}

/// Dials the right neighbour, checks that it is the endpoint that rank joined from, and says who is
/// calling. Whoever else answers at its address is refused (and logged once): the ring cannot form then.
async fn open_right(
    cfg: &QuicConfig,
    endpoint: &Endpoint,
    key: &[u8; 32],
    right: Neighbour,
    refusals: &Refusals,
    shm: Option<ShmSender>,
    deadline: Instant,
) -> Result<RightLink> {
    let right_rank = right.rank;
    let (conn, mut send, recv) = tokio::time::timeout_at(deadline, dial(endpoint, right.addr, key))
        .await
        .map_err(|_| local(format!("connecting to right neighbour rank {right_rank} timed out")))?
        .map_err(|e| local(format!("connecting to right neighbour rank {right_rank}: {e}")))?;
    if let Err(e) = check_pinned(&conn, right_rank, &right.cert) {
        refusals.record(right.addr, Cause::Certificate, &e);
        conn.close(5u32.into(), b"not the certificate pinned at rendezvous");
        return Err(local(format!("connecting to right neighbour rank {right_rank}: {e}")));
    }
    send.write_all(&control_frame(
        cfg.job_id,
        &Control::PeerHello {
            job_id: cfg.job_id,
            rank: cfg.rank,
            shm: shm.is_some(),
        },
    ))
    .await
    .map_err(|e| CollectiveError::PeerDead {
        rank: right_rank,
        reason: e.to_string(),
    })?;
    drop(recv);
    let data = match shm {
        Some(sender) => RightData::Shm { sender, _stream: send },
        None => RightData::Quic(send),
    };
    Ok(RightLink { _conn: conn, data })
}

/// Waits for a peer hello from one of the left neighbours `waiting` (each with the certificate it
/// presented at rendezvous), and returns which, its link, and whether it says the link's data goes through
/// shared memory. Anyone else is refused with the reason (a rank they are not, a certificate other than the
/// pinned one, a rendezvous already closed), and the wait goes on. Cancel-safe: nothing is awaited once a
/// connection is taken.
async fn accept_left(
    job: u64,
    waiting: &[(usize, Fingerprint)],
    listener: &mut Listener,
) -> Result<(usize, Connection, SendStream, RecvStream, bool)> {
    loop {
        let j = match listener.early_peers.pop() {
            Some(j) => j,
            None => listener.next().await.ok_or_else(|| local("listener stopped"))?,
        };
        let refusal = match &j.msg {
            Control::PeerHello { job_id, rank, shm } if *job_id == job => {
                match waiting.iter().find(|(r, _)| r == rank) {
                    Some((left, pinned)) => match check_pinned(&j.conn, *left, pinned) {
                        Ok(()) => return Ok((*left, j.conn, j.send, j.recv, *shm)),
                        Err(e) => (Cause::Certificate, format!("ring link refused: {e}")),
                    },
                    None => {
                        let ranks: Vec<usize> = waiting.iter().map(|(r, _)| *r).collect();
                        (
                            Cause::Refused,
                            format!("ring link refused: rank {rank} is not a left neighbour this rank waits for ({ranks:?})"),
                        )
                    }
                }
            }
            Control::PeerHello { job_id, rank, .. } => (
                Cause::Refused,
                format!("ring link refused: rank {rank} says job {job_id:#x}, this job is {job:#x}"),
            ),
            Control::Hello(h) => (
                Cause::Refused,
                format!(
                    "{RENDEZVOUS_CLOSED} (all ranks have joined): rank {} has already joined",
                    h.rank
                ),
            ),
            other => (Cause::Refused, format!("unexpected {other:?} on a ring link")),
        };
        let (cause, reason) = refusal;
        j.refuse(job, &listener.refusals, cause, reason);
    }
}

/// Reads the left link's data frames (payloads of at most `max_payload` bytes) into a bounded queue, until
/// the link fails or the queue's receiver is gone.
fn spawn_reader(mut recv: RecvStream, max_payload: usize) -> mpsc::Receiver<LinkEvent> {
    let (tx, rx) = mpsc::channel(MAX_QUEUED_FRAMES);
    tokio::spawn(async move {
        loop {
            match read_data_frame(&mut recv, max_payload).await {
                Ok(ev) => {
                    if tx.send(ev).await.is_err() {
                        break;
                    }
                }
                Err(ReadFail::Closed(s)) => {
                    let _ = tx.send(LinkEvent::Closed(s)).await;
                    break;
                }
                Err(ReadFail::Bad(e)) => {
                    let _ = tx.send(LinkEvent::Bad(e)).await;
                    break;
                }
            }
        }
    });
    rx
}

/// Whether ranks with these endpoints share a host (and a user, without which the peer check fails).
pub(super) fn same_host(a: &Option<LocalEndpoint>, b: &Option<LocalEndpoint>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a.host == b.host && a.uid == b.uid)
}

/// A local link that did not attach: the start's error under `--transport shm`, one line under `auto`.
pub(super) fn not_attached(cfg: &QuicConfig, peer: usize, why: &str) -> Result<()> {
    let msg = format!(
        "rank {}: the link with rank {peer} (same host) stays on QUIC: shared memory did not attach: {why}",
        cfg.rank
    );
    if cfg.transport == LinkTransport::Shm {
        return Err(local(format!("--transport shm: {msg}")));
    }
    tracing::warn!("{msg}");
    Ok(())
}
