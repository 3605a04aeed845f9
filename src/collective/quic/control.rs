//! The control plane: the rendezvous connections to rank 0, kept open after setup. A rank reports its own
//! abort, or a neighbour it found dead, to rank 0; rank 0 relays either to every other rank, reports a rank
//! dead when its connection drops without a goodbye ([`Control::Bye`]), and stays up until every other rank
//! has left. Whatever a rank hears here poisons its collectives ([`Shared::poison`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quinn::{RecvStream, SendStream};
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::framing::{abort_frame, control_frame, parse_abort, read_frame, MAX_CONTROL};
use super::listener::Joined;
use super::messages::Control;
use super::rendezvous::HostLink;
use super::Shared;
use crate::collective::frame::{Header, Kind};
use crate::collective::CollectiveError;

/// One control stream from rank 0 to a joined rank.
pub(super) struct ClientSlot {
    send: Mutex<SendStream>,
    said_bye: AtomicBool,
}

/// Rank 0's control streams, indexed by rank (entry 0, rank 0 itself, is `None`).
type Clients = Arc<Vec<Option<Arc<ClientSlot>>>>;

/// This rank's side of the control plane.
pub(super) enum ControlPlane {
    /// Rank 0: a stream to every other rank, and how many of them are still connected.
    Host { clients: Clients, live: Arc<AtomicUsize> },
    /// Any other rank: its stream to rank 0.
    Client { send: Arc<Mutex<SendStream>> },
    /// A world of one.
    Alone,
}

impl ControlPlane {
    /// Rank 0: keeps the joined ranks' connections (`joined[r - 1]` is rank `r`'s) and reads each in its own
    /// task.
    pub(super) fn start_host(job: u64, world: usize, joined: Vec<Joined>, shared: &Arc<Shared>) -> Self {
        let live = Arc::new(AtomicUsize::new(world - 1));
        let mut client_slots: Vec<Option<Arc<ClientSlot>>> = vec![None];
        let mut readers = Vec::new();
        for j in joined {
            let slot = Arc::new(ClientSlot {
                send: Mutex::new(j.send),
                said_bye: AtomicBool::new(false),
            });
            client_slots.push(Some(slot.clone()));
            readers.push((j.recv, j.conn, slot));
        }
        let clients = Arc::new(client_slots);
        for (r, (mut recv, conn, slot)) in readers.into_iter().enumerate() {
            let relay = Relay {
                rank: r + 1,
                world,
                job,
                clients: clients.clone(),
                shared: shared.clone(),
            };
            let live = live.clone();
            tokio::spawn(async move {
                let _conn = conn;
                relay.run(&mut recv, &slot).await;
                live.fetch_sub(1, Ordering::SeqCst);
            });
        }
        ControlPlane::Host { clients, live }
    }

    /// Any other rank: reads rank 0's notices in a task; losing rank 0 poisons every later collective.
    pub(super) fn start_client(host: HostLink, shared: &Arc<Shared>) -> Self {
        let HostLink { conn, send, mut recv } = host;
        let shared = shared.clone();
        tokio::spawn(async move {
            let _conn = conn;
            loop {
                match read_frame(&mut recv, MAX_CONTROL).await {
                    Ok((h, p)) if h.kind == Kind::Abort => shared.poison(parse_abort(&h, &p)),
                    Ok(_) => {}
                    Err(e) => {
                        shared.poison(CollectiveError::PeerDead {
                            rank: 0,
                            reason: format!("lost the connection to rank 0 (rendezvous host): {e}"),
                        });
                        break;
                    }
                }
            }
        });
        ControlPlane::Client {
            send: Arc::new(Mutex::new(send)),
        }
    }

    /// Reports that `rank` aborted (or, with `dead`, that it died): to rank 0, or from rank 0 to everyone.
    pub(super) async fn send_abort(&self, job: u64, rank: usize, dead: bool, reason: &str) {
        let bytes = abort_frame(job, rank, dead, reason);
        match self {
            ControlPlane::Client { send } => {
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    send.lock().await.write_all(&bytes).await
                })
                .await;
            }
            ControlPlane::Host { clients, .. } => broadcast_control(clients, &bytes, None).await,
            ControlPlane::Alone => {}
        }
    }

    /// Leaves the control plane: a joined rank says goodbye and waits up to `flush_wait` for rank 0 to have
    /// read it; rank 0 waits up to `wait` for every other rank to leave.
    pub(super) async fn leave(&self, job: u64, wait: Duration, flush_wait: Duration) {
        match self {
            ControlPlane::Client { send } => {
                let bytes = control_frame(job, &Control::Bye);
                let mut s = send.lock().await;
                if s.write_all(&bytes).await.is_ok() {
                    let _ = s.finish();
                    let _ = tokio::time::timeout(flush_wait, s.stopped()).await;
                }
            }
            ControlPlane::Host { live, .. } => {
                // Rank 0 keeps the control plane up until everyone else has left (after a failure too: the
                // others may not have heard of it yet).
                let until = Instant::now() + wait;
                while live.load(Ordering::SeqCst) > 0 && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            ControlPlane::Alone => {}
        }
    }
}

/// Rank 0's reader of one joined rank's control stream.
struct Relay {
    /// The rank on the other end.
    rank: usize,
    world: usize,
    job: u64,
    clients: Clients,
    shared: Arc<Shared>,
}

impl Relay {
    /// Relays the rank's abort notices until its stream ends; an end without a goodbye reports it dead.
    async fn run(&self, recv: &mut RecvStream, slot: &ClientSlot) {
        loop {
            match read_frame(recv, MAX_CONTROL).await {
                Ok((h, p)) if h.kind == Kind::Abort => self.relay_abort(&h, &p).await,
                Ok((h, p)) if h.kind == Kind::Control => {
                    if let Ok(Control::Bye) = serde_json::from_slice::<Control>(&p) {
                        slot.said_bye.store(true, Ordering::SeqCst);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    // A host that crashed (fault injection) closed this connection itself: that says
                    // nothing about the rank on the other end, so it must not be reported dead.
                    if !slot.said_bye.load(Ordering::SeqCst) && !self.shared.crashed.load(Ordering::SeqCst) {
                        let reason = format!("lost its connection to rank 0: {e}");
                        self.shared.poison(CollectiveError::PeerDead {
                            rank: self.rank,
                            reason: reason.clone(),
                        });
                        let frame = abort_frame(self.job, self.rank, true, &reason);
                        broadcast_control(&self.clients, &frame, Some(self.rank)).await;
                    }
                    break;
                }
            }
        }
    }

    /// The rank aborts, or reports another rank dead (`chunk` names it): poison here, tell everyone else.
    async fn relay_abort(&self, h: &Header, payload: &[u8]) {
        let reason = String::from_utf8_lossy(payload).into_owned();
        let (blamed, dead) = if (h.chunk as usize) < self.world {
            (h.chunk as usize, h.sub == 1)
        } else {
            (self.rank, false)
        };
        let e = if dead {
            CollectiveError::PeerDead {
                rank: blamed,
                reason: reason.clone(),
            }
        } else {
            CollectiveError::Aborted {
                rank: blamed,
                reason: reason.clone(),
            }
        };
        self.shared.poison(e);
        let frame = abort_frame(self.job, blamed, dead, &reason);
        broadcast_control(&self.clients, &frame, Some(self.rank)).await;
    }
}

/// Sends `bytes` on every client's control stream but `except`'s, giving each at most a second.
async fn broadcast_control(clients: &[Option<Arc<ClientSlot>>], bytes: &[u8], except: Option<usize>) {
    for (r, c) in clients.iter().enumerate() {
        if Some(r) == except {
            continue;
        }
        if let Some(c) = c {
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                c.send.lock().await.write_all(bytes).await
            })
            .await;
        }
    }
}
