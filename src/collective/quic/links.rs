//! The ring's data links. Each rank opens a link to its right neighbour (saying [`Control::PeerHello`]
//! first) and accepts one from its left; a reader task moves the left link's frames to the collective loop
//! through a bounded queue. Both ends pin the link to the neighbour's certificate as rank 0 saw it at
//! rendezvous ([`Ring::certs`]): a peer that knows the secret but is not that rank is refused, and the
//! real neighbour can still connect.

use std::net::SocketAddr;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::auth::{check_pinned, dial, Fingerprint};
use super::framing::{control_frame, read_data_frame, LinkEvent, ReadFail};
use super::listener::{Cause, Listener, Refusals};
use super::messages::Control;
use super::messages::LocalEndpoint;
use super::shm_links::{self, ShmListener, ShmReceiver, ShmSender};
use super::{local, QuicConfig, Shared, MAX_GATHER_BLOB};
use crate::collective::shm::LinkTransport;
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
/// endpoint, in rank order.
pub(super) struct Ring {
    pub(super) addrs: Vec<SocketAddr>,
    pub(super) certs: Vec<Fingerprint>,
    pub(super) locals: Vec<Option<LocalEndpoint>>,
}

/// Both links of a rank in the ring (none in a world of one).
#[derive(Default)]
pub(super) struct RingLinks {
    pub(super) right: Option<RightLink>,
    pub(super) left: Option<LeftLink>,
    /// The left link's send side, unused but kept open for the link's lifetime.
    pub(super) keep: Vec<SendStream>,
}

/// Opens the right link and accepts the left one, concurrently, each through shared memory when its two
/// ranks share a host and `shm` (this rank's segment listener) is there. Gives up when rank 0 reports a
/// rank dead meanwhile, or at `deadline`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn connect(
    cfg: &QuicConfig,
    endpoint: &Endpoint,
    key: &[u8; 32],
    ring: &Ring,
    listener: &mut Listener,
    shm: Option<&ShmListener>,
    shared: &Shared,
    deadline: Instant,
) -> Result<RingLinks> {
    let n = cfg.world;
    if n == 1 {
        return Ok(RingLinks::default());
    }
    let rank = cfg.rank;
    let left_rank = (rank + n - 1) % n;
    let right_rank = (rank + 1) % n;
    let right_addr = if right_rank == 0 {
        cfg.master
    } else {
        ring.addrs[right_rank]
    };
    let right = Neighbour {
        rank: right_rank,
        addr: right_addr,
        cert: ring.certs[right_rank],
    };
    let local_to = |r: usize| shm.is_some() && same_host(&ring.locals[rank], &ring.locals[r]);
    let (right_local, left_local) = (local_to(right_rank), local_to(left_rank));
    if cfg.transport == LinkTransport::Shm && shm.is_some() && !right_local && !left_local {
        return Err(local(format!(
            "--transport shm: neither ring neighbour of rank {rank} (ranks {left_rank} and {right_rank}) shares its \
             host"
        )));
    }
    let refusals = listener.refusals.clone();
    let open_right = async {
        let sender = match &ring.locals[right_rank] {
            Some(e) if right_local => shm_links::offer_right(cfg, right_rank, e, deadline).await?,
            _ => None,
        };
        open_right(cfg, endpoint, key, right, &refusals, sender, deadline).await
    };
    let accept_left = accept_left_any(
        cfg,
        left_rank,
        &ring.certs[left_rank],
        listener,
        shm,
        ring,
        left_local,
        deadline,
    );
    // A rank that dies or aborts while the ring forms is reported by rank 0: stop waiting then. The verdict
    // is checked first, so that a link that failed because of it never hides it.
    let mut prx = shared.poison.subscribe();
    let (r, l) = tokio::select! {
        biased;
        p = prx.wait_for(|p| p.is_some()) => {
            return Err(p.ok().and_then(|p| p.clone()).unwrap_or_else(|| local("control plane failed")));
        }
        rl = async { tokio::join!(open_right, accept_left) } => rl,
    };
    let links = r.and_then(|right| l.map(|left| (right, left)));
    let (right, (conn, send, left_data)) = match links {
        Ok(links) => links,
        // A neighbour that closed its endpoint has usually left because of a failure elsewhere (it heard of
        // an abort before this rank did): report that failure, not the closed link.
        Err(e) => {
            let grace = (Instant::now() + Shared::verdict_grace(cfg.idle_timeout)).min(deadline);
            return Err(shared.verdict_or(e, grace).await);
        }
    };
    let max_payload = (cfg.sub_chunk * 4).max(MAX_GATHER_BLOB);
    let left = match left_data {
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
    tracing::info!(
        "rank {rank}: ring links: from rank {left_rank} over {}, to rank {right_rank} over {}",
        if left.shm_reader.is_some() { "shm" } else { "quic" },
        right.data.kind()
    );
    Ok(RingLinks {
        right: Some(right),
        left: Some(left),
        keep: vec![send],
    })
}

/// Where the left link's frames arrive.
enum LeftData {
    Quic(RecvStream),
    Shm(ShmReceiver, RecvStream),
}

/// Accepts the left neighbour's QUIC link and, when its peer hello says the link's data goes through shared
/// memory, the segment it handed this rank's listener. The segment is accepted while the QUIC link is
/// awaited, since the neighbour attaches it first.
#[allow(clippy::too_many_arguments)]
async fn accept_left_any(
    cfg: &QuicConfig,
    left_rank: usize,
    pinned: &Fingerprint,
    listener: &mut Listener,
    shm: Option<&ShmListener>,
    ring: &Ring,
    left_local: bool,
    deadline: Instant,
) -> Result<(Connection, SendStream, LeftData)> {
    let segment = async {
        match (shm, &ring.locals[left_rank]) {
            (Some(l), Some(e)) if left_local => shm_links::accept_left(cfg, l, left_rank, e, deadline).await,
            _ => std::future::pending().await,
        }
    };
    let mut segment = std::pin::pin!(segment);
    let mut attached = None;
    let quic = accept_left(cfg.job_id, left_rank, pinned, listener, deadline);
    let mut quic = std::pin::pin!(quic);
    let (conn, send, recv, says_shm) = loop {
        tokio::select! {
            q = &mut quic => break q?,
            s = &mut segment, if attached.is_none() => attached = Some(s),
        }
    };
    match (says_shm, left_local) {
        (true, true) => {
            let receiver = match attached {
                Some(s) => s?,
                None => segment.await?,
            };
            Ok((conn, send, LeftData::Shm(receiver, recv)))
        }
        (true, false) => Err(CollectiveError::Protocol {
            rank: left_rank,
            msg: "says its link goes through shared memory, but it does not share this rank's host".into(),
        }),
        (false, local) => {
            if local {
                not_attached(cfg, left_rank, "the left neighbour did not hand over a segment")?;
            }
            Ok((conn, send, LeftData::Quic(recv)))
        }
    }
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

/// Waits for the left neighbour's peer hello from the certificate that rank presented at rendezvous
/// (`pinned`), and returns its link and whether it says the link's data goes through shared memory. Anyone
/// else is refused with the reason (a rank they are not, a certificate other than the pinned one, a
/// rendezvous already closed), and the wait goes on.
async fn accept_left(
    job: u64,
    left_rank: usize,
    pinned: &Fingerprint,
    listener: &mut Listener,
    deadline: Instant,
) -> Result<(Connection, SendStream, RecvStream, bool)> {
    loop {
        let j = match listener.early_peers.pop() {
            Some(j) => j,
            None => tokio::select! {
                j = listener.next() => j.ok_or_else(|| local("listener stopped"))?,
                _ = tokio::time::sleep_until(deadline) =>
                    return Err(local(format!("left neighbour rank {left_rank} did not connect in time"))),
            },
        };
        let refusal = match &j.msg {
            Control::PeerHello { job_id, rank, shm } if *job_id == job && *rank == left_rank => {
                match check_pinned(&j.conn, left_rank, pinned) {
                    Ok(()) => return Ok((j.conn, j.send, j.recv, *shm)),
                    Err(e) => (Cause::Certificate, format!("ring link refused: {e}")),
                }
            }
            Control::PeerHello { job_id, rank, .. } if *job_id != job => (
                Cause::Refused,
                format!("ring link refused: rank {rank} says job {job_id:#x}, this job is {job:#x}"),
            ),
            Control::PeerHello { rank, .. } => (
                Cause::Refused,
                format!("ring link refused: rank {rank} is not this rank's left neighbour (rank {left_rank})"),
            ),
            Control::Hello(h) => (
                Cause::Refused,
                format!(
                    "the rendezvous is closed (all ranks have joined): rank {} has already joined",
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
