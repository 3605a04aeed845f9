//! Incoming connections. Each one is authenticated and its first control message read (a rendezvous hello
//! on rank 0, a ring neighbour's peer hello on any rank) in its own task, before setup sees it; once setup
//! is over, a late hello is refused.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::sync::mpsc;

use super::auth;
use super::framing::{control_frame, read_control};
use super::messages::Control;

/// An authenticated incoming connection, after its first control message.
pub(super) struct Joined {
    pub(super) conn: Connection,
    pub(super) send: SendStream,
    pub(super) recv: RecvStream,
    pub(super) msg: Control,
}

/// The connections that have said their first message, in order of arrival.
pub(super) struct Listener {
    arrivals: mpsc::UnboundedReceiver<Joined>,
    /// Peer hellos that arrived during the rendezvous (from fast neighbours), kept for the ring stage.
    pub(super) early_peers: Vec<Joined>,
    /// Peers that failed authentication (see [`Refusals`]).
    pub(super) refusals: Refusals,
}

/// Addresses whose connection failed authentication: each is logged once, and the rendezvous names them
/// when it times out (a rank started with another secret is the usual reason a rank "did not join").
/// Bounded, so garbage from many addresses costs a fixed amount of memory and log.
#[derive(Clone, Default)]
pub(super) struct Refusals(Arc<Mutex<Vec<SocketAddr>>>);

/// Most refused addresses remembered (and logged).
const MAX_REFUSALS: usize = 16;

impl Refusals {
    /// Records a refused peer; logs it the first time its address is seen.
    fn record(&self, addr: SocketAddr, reason: &str) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() < MAX_REFUSALS && !seen.contains(&addr) {
            seen.push(addr);
            tracing::warn!("refused a connection from {addr}: {reason} (a rank started with another secret?)");
        }
    }

    /// The refused addresses so far, in order of first refusal.
    pub(super) fn addresses(&self) -> Vec<SocketAddr> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Listener {
    /// Accepts every connection to `endpoint` from now on.
    pub(super) fn start(endpoint: &Endpoint, key: [u8; 32]) -> Self {
        let (tx, arrivals) = mpsc::unbounded_channel::<Joined>();
        let ep = endpoint.clone();
        let refusals = Refusals::default();
        let record = refusals.clone();
        tokio::spawn(async move {
            while let Some(inc) = ep.accept().await {
                tokio::spawn(serve_incoming(inc, key, tx.clone(), record.clone()));
            }
        });
        Listener {
            arrivals,
            early_peers: Vec::new(),
            refusals,
        }
    }

    /// The next connection to arrive; `None` once the accept loop has stopped.
    pub(super) async fn next(&mut self) -> Option<Joined> {
        self.arrivals.recv().await
    }

    /// After setup: late connections (a refused impostor, a retry) keep being answered. Early peers that
    /// were never taken are closed.
    pub(super) fn refuse_late(self) {
        let Listener {
            mut arrivals,
            early_peers,
            refusals: _,
        } = self;
        drop(early_peers);
        tokio::spawn(async move {
            while let Some(mut j) = arrivals.recv().await {
                if matches!(j.msg, Control::Hello(_)) {
                    let bytes = control_frame(
                        0,
                        &Control::Refused {
                            reason: "the rendezvous is closed".into(),
                        },
                    );
                    let _ = j.send.write_all(&bytes).await;
                    let _ = j.send.finish();
                }
            }
        });
    }
}

/// Authenticates one incoming connection and reads its first control message; gives up after 30 s.
async fn serve_incoming(
    incoming: quinn::Incoming,
    key: [u8; 32],
    tx: mpsc::UnboundedSender<Joined>,
    refusals: Refusals,
) {
    let addr = incoming.remote_address();
    let work = async {
        let (conn, send, mut recv) = auth::accept(incoming, &key).await.inspect_err(|e| {
            if e.contains("authentication") {
                refusals.record(addr, e);
            }
        })?;
        let msg = match read_control(&mut recv, None).await {
            Ok(m) => m,
            Err(e) => {
                // E.g. another protocol version: say why in the close reason, the one thing any version reads.
                let reason = format!("refused: {e}");
                conn.close(4u32.into(), &reason.as_bytes()[..reason.len().min(512)]);
                return Err(e);
            }
        };
        Ok::<_, String>(Joined { conn, send, recv, msg })
    };
    if let Ok(Ok(j)) = tokio::time::timeout(Duration::from_secs(30), work).await {
        let _ = tx.send(j);
    }
}
