//! The ring's data links. Each rank opens a link to its right neighbour (saying [`Control::PeerHello`]
//! first) and accepts one from its left; a reader task moves the left link's frames to the collective loop
//! through a bounded queue.

use std::net::SocketAddr;
use std::time::Duration;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::auth::dial;
use super::framing::{control_frame, read_data_frame, LinkEvent, ReadFail};
use super::listener::Listener;
use super::messages::Control;
use super::{local, QuicConfig, Shared, MAX_GATHER_BLOB};
use crate::collective::{CollectiveError, Result};

/// Data frames the left link's reader holds for the engine. Past that it stops reading, and QUIC flow
/// control holds the sender back, so a rank buffers at most this many sub-chunks (retained at most 4x, see
/// `framing::MIN_ZERO_COPY_PIECE`) whatever its neighbour sends. The ring cannot deadlock on it: the
/// collective loop keeps taking frames while its own writes wait (`driver`).
const MAX_QUEUED_FRAMES: usize = 32;

/// The link to the right neighbour: its connection and the data stream this rank writes.
pub(super) type RightLink = (Connection, SendStream);
/// The link from the left neighbour: its connection and the reader task's queue.
pub(super) type LeftLink = (Connection, mpsc::Receiver<LinkEvent>);

/// Both links of a rank in the ring (none in a world of one).
#[derive(Default)]
pub(super) struct RingLinks {
    pub(super) right: Option<RightLink>,
    pub(super) left: Option<LeftLink>,
    /// The left link's send side, unused but kept open for the link's lifetime.
    pub(super) keep: Vec<SendStream>,
}

/// Opens the right link and accepts the left one, concurrently. Gives up when rank 0 reports a rank dead
/// meanwhile, or at `deadline`.
pub(super) async fn connect(
    cfg: &QuicConfig,
    endpoint: &Endpoint,
    key: &[u8; 32],
    addrs: &[SocketAddr],
    listener: &mut Listener,
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
    let right_addr = if right_rank == 0 { cfg.master } else { addrs[right_rank] };
    let open_right = open_right(cfg, endpoint, key, right_rank, right_addr, deadline);
    let accept_left = accept_left(cfg.job_id, left_rank, listener, deadline);
    // A rank that dies while the ring forms is reported by rank 0: stop waiting then.
    let mut prx = shared.poison.subscribe();
    let (r, l) = tokio::select! {
        rl = async { tokio::join!(open_right, accept_left) } => rl,
        p = prx.wait_for(|p| p.is_some()) => {
            return Err(p.ok().and_then(|p| p.clone()).unwrap_or_else(|| local("control plane failed")));
        }
    };
    let right = r?;
    let (conn, send, recv) = l?;
    let rx = spawn_reader(recv, (cfg.sub_chunk * 4).max(MAX_GATHER_BLOB));
    Ok(RingLinks {
        right: Some(right),
        left: Some((conn, rx)),
        keep: vec![send],
    })
}

/// Dials the right neighbour and says who is calling.
async fn open_right(
    cfg: &QuicConfig,
    endpoint: &Endpoint,
    key: &[u8; 32],
    right_rank: usize,
    right_addr: SocketAddr,
    deadline: Instant,
) -> Result<RightLink> {
    let (conn, mut send, recv) = tokio::time::timeout_at(deadline, dial(endpoint, right_addr, key))
        .await
        .map_err(|_| local(format!("connecting to right neighbour rank {right_rank} timed out")))?
        .map_err(|e| local(format!("connecting to right neighbour rank {right_rank}: {e}")))?;
    send.write_all(&control_frame(
        cfg.job_id,
        &Control::PeerHello {
            job_id: cfg.job_id,
            rank: cfg.rank,
        },
    ))
    .await
    .map_err(|e| CollectiveError::PeerDead {
        rank: right_rank,
        reason: e.to_string(),
    })?;
    drop(recv);
    Ok((conn, send))
}

/// Waits for the left neighbour's peer hello. A rendezvous hello arriving now is refused; any other
/// connection is closed.
async fn accept_left(
    job: u64,
    left_rank: usize,
    listener: &mut Listener,
    deadline: Instant,
) -> Result<(Connection, SendStream, RecvStream)> {
    loop {
        let j = match listener.early_peers.pop() {
            Some(j) => j,
            None => tokio::select! {
                j = listener.next() => j.ok_or_else(|| local("listener stopped"))?,
                _ = tokio::time::sleep_until(deadline) =>
                    return Err(local(format!("left neighbour rank {left_rank} did not connect in time"))),
            },
        };
        match j.msg {
            Control::PeerHello { job_id, rank: r } if job_id == job && r == left_rank => {
                return Ok((j.conn, j.send, j.recv))
            }
            Control::Hello(_) => {
                let mut j = j;
                let bytes = control_frame(
                    job,
                    &Control::Refused {
                        reason: "the rendezvous is closed (all ranks have joined)".into(),
                    },
                );
                tokio::spawn(async move {
                    let _ = j.send.write_all(&bytes).await;
                    let _ = j.send.finish();
                    tokio::time::sleep(Duration::from_millis(500)).await;
                });
            }
            _ => j.conn.close(3u32.into(), b"unexpected peer"),
        }
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
