//! Ring links through shared memory for neighbours on this rank's host ([`crate::collective::shm`]).
//!
//! Before the rendezvous a rank that may use shared memory binds its segment listener and puts its
//! [`LocalEndpoint`] in its hello; the welcome carries every rank's. A link is local when both ends sent
//! one with the same host identity and user. The sending rank then offers its right neighbour a segment
//! before opening the QUIC link, and says in its peer hello whether the segment attached; the receiving
//! rank reads the link's frames from the segment when it did, from the QUIC stream when not. Under
//! `--transport auto` a local link that does not attach stays QUIC, with one line saying why; under `shm`
//! that fails the start, naming the cause.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::framing::LinkEvent;
use super::links::not_attached;
use super::messages::LocalEndpoint;
use super::{local, QuicConfig};
use crate::collective::frame::{Header, Kind, HEADER_LEN};
pub(super) use crate::collective::shm::handoff::ShmListener;
use crate::collective::shm::handoff::{offer, Expected};
pub(super) use crate::collective::shm::link::{ShmReceiver, ShmSender};
use crate::collective::shm::{host_identity, LinkTransport};
use crate::collective::Result;

/// How long an offer to the right neighbour may take: both processes are on this host and already past
/// the rendezvous, so anything slower means the attachment is not going to work.
const OFFER_TIMEOUT: Duration = Duration::from_secs(10);

/// This rank's side of shared memory: its listener and what its hello says, or nothing.
pub(super) struct LocalSide {
    pub(super) listener: Option<ShmListener>,
    pub(super) endpoint: Option<LocalEndpoint>,
}

impl LocalSide {
    /// Binds the segment listener unless `--transport quic` or a world of one. Under `auto` a failure
    /// leaves this rank on QUIC with a line saying why; under `shm` it is the start's error.
    pub(super) fn prepare(cfg: &QuicConfig) -> Result<LocalSide> {
        let none = LocalSide {
            listener: None,
            endpoint: None,
        };
        if cfg.transport == LinkTransport::Quic || cfg.world == 1 {
            return Ok(none);
        }
        let attempt = (|| {
            let host = host_identity(cfg.host_id.as_deref())?;
            let listener =
                ShmListener::bind(cfg.job_id, cfg.rank).map_err(|e| format!("binding the segment listener: {e}"))?;
            let endpoint = LocalEndpoint {
                host,
                pid: std::process::id(),
                uid: rustix::process::getuid().as_raw(),
                socket: listener.name.clone(),
                nonce: listener.nonce,
            };
            Ok::<_, String>(LocalSide {
                listener: Some(listener),
                endpoint: Some(endpoint),
            })
        })();
        match attempt {
            Ok(side) => Ok(side),
            Err(e) if cfg.transport == LinkTransport::Shm => {
                Err(local(format!("--transport shm: rank {}: {e}", cfg.rank)))
            }
            Err(e) => {
                tracing::warn!(
                    "rank {}: shared memory unavailable, every link uses QUIC: {e}",
                    cfg.rank
                );
                Ok(none)
            }
        }
    }
}

/// What the rendezvous says of `rank`'s process, for the peer check.
fn expected(cfg: &QuicConfig, rank: usize, e: &LocalEndpoint) -> Expected {
    Expected {
        job_id: cfg.job_id,
        rank,
        pid: e.pid,
        uid: e.uid,
    }
}

/// Offers the right neighbour (`right`, at `endpoint`) a segment. `Ok(None)`: it did not attach under
/// `auto`, after a line saying why.
pub(super) async fn offer_right(
    cfg: &QuicConfig,
    right: usize,
    endpoint: &LocalEndpoint,
    deadline: Instant,
) -> Result<Option<ShmSender>> {
    let to = expected(cfg, right, endpoint);
    let wait = deadline.min(Instant::now() + OFFER_TIMEOUT);
    let attempt = match tokio::time::timeout_at(
        wait,
        offer(&endpoint.socket, &to, cfg.rank, endpoint.nonce, cfg.shm_capacity),
    )
    .await
    {
        Ok(Ok(attached)) => ShmSender::new(attached).map_err(|e| e.to_string()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("no answer in time".to_string()),
    };
    match attempt {
        Ok(sender) => Ok(Some(sender)),
        Err(e) => not_attached(cfg, right, &e).map(|()| None),
    }
}

/// Waits for one of the left neighbours `from` (each a rank and its endpoint) to attach, and returns which
/// did with its receiving end. Callers that are none of them are refused (and logged), and the wait goes on.
pub(super) async fn accept_left(
    cfg: &QuicConfig,
    listener: &ShmListener,
    from: &[(usize, &LocalEndpoint)],
) -> Result<(usize, ShmReceiver)> {
    let expected: Vec<Expected> = from.iter().map(|(r, e)| expected(cfg, *r, e)).collect();
    let rank = cfg.rank;
    let refused = |reason: String| tracing::warn!("rank {rank}: refused a shared-memory offer: {reason}");
    let (left, attached) = listener
        .accept(&expected, refused)
        .await
        .map_err(|e| local(format!("accepting a shared segment: {e}")))?;
    let rx = ShmReceiver::new(attached).map_err(|e| local(format!("rank {left}'s shared segment: {e}")))?;
    Ok((left, rx))
}

/// Reads the left link's frames (payloads of at most `max_payload` bytes) out of the segment into a bounded
/// queue, as the QUIC reader does from its stream. Each frame's header is copied out of the shared ring
/// before it is decoded; an f32 payload is lent in place, other payloads are copied.
pub(super) fn spawn_reader(
    mut rx: ShmReceiver,
    max_payload: usize,
    queue: usize,
) -> (mpsc::Receiver<LinkEvent>, JoinHandle<()>) {
    let (tx, events) = mpsc::channel(queue);
    let task = tokio::spawn(async move {
        loop {
            let ev = read_frame(&mut rx, max_payload).await;
            let last = matches!(ev, LinkEvent::Closed(_) | LinkEvent::Bad(_));
            if tx.send(ev).await.is_err() || last {
                break;
            }
        }
    });
    (events, task)
}

async fn read_frame(rx: &mut ShmReceiver, max_payload: usize) -> LinkEvent {
    let mut hb = [0u8; HEADER_LEN];
    if let Err(e) = rx.read_exact(&mut hb).await {
        return LinkEvent::Closed(e);
    }
    let h = match Header::decode(&hb, max_payload) {
        Ok(h) => h,
        Err(e) => return LinkEvent::Bad(e),
    };
    // `h.len` is bounded by `max_payload` here.
    let len = h.len as usize;
    if h.kind == Kind::F32 && len % 4 == 0 {
        // The values stay in the segment: the engine sums or stores straight from it, and their space
        // returns to the sender once it is done with them.
        return match rx.read_lent(len).await {
            Ok(pieces) => LinkEvent::F32Le(h, pieces, true),
            Err(e) => LinkEvent::Closed(e),
        };
    }
    let mut payload = vec![0u8; len];
    match rx.read_exact(&mut payload).await {
        Ok(()) => LinkEvent::Frame(h, payload),
        Err(e) => LinkEvent::Closed(e),
    }
}
