//! Test support for the hostile-peer tests (`hostile_tests.rs`): a rogue member that holds the
//! cluster secret but none of the ranks' certificates, and says whatever a test tells it to. Nothing in
//! the transport uses it.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use quinn::Endpoint;
use tokio::time::Instant;

use super::auth::{auth_key, dial};
use super::framing::{control_frame, read_control};
use super::listener::Listener;
use super::messages::Control;
use super::rendezvous::{self, HostLink};
use super::{endpoint, QuicConfig};
use crate::collective::ComputeBusy;

/// A member with the secret and its own fresh certificate, on its own runtime. It accepts (and
/// authenticates) connections, as any member's endpoint does, and holds them without answering.
pub struct Rogue {
    endpoint: Endpoint,
    key: [u8; 32],
    idle: Duration,
    _listener: Listener,
    /// Its rendezvous connection to rank 0, once it has joined.
    host: Option<HostLink>,
    rt: tokio::runtime::Runtime,
}

impl Rogue {
    /// Starts the rogue's endpoint on `socket`.
    pub fn new(socket: UdpSocket, secret: &[u8]) -> Result<Rogue, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let idle = Duration::from_secs(3);
        let key = auth_key(Some(secret));
        let (endpoint, listener) = rt.block_on(async {
            let (ep, _) = endpoint::start(socket, idle, &ComputeBusy::default())?;
            let listener = Listener::start(&ep, key);
            Ok::<_, String>((ep, listener))
        })?;
        Ok(Rogue {
            endpoint,
            key,
            idle,
            _listener: listener,
            host: None,
            rt,
        })
    }

    /// Where the rogue's endpoint listens (and dials from).
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr().expect("bound endpoint")
    }

    /// Dials `addr`, authenticates with the secret, says `msg` (a frame of job `job`) and returns the
    /// answer, or why there was none within `wait` (the connection closed, or nothing came).
    pub fn say(&self, addr: SocketAddr, job: u64, msg: &Control, wait: Duration) -> Result<Control, String> {
        self.rt.block_on(async {
            let (conn, mut send, mut recv) = dial(&self.endpoint, addr, &self.key).await?;
            send.write_all(&control_frame(job, msg))
                .await
                .map_err(|e| e.to_string())?;
            let answer = tokio::time::timeout(wait, read_control(&mut recv, None))
                .await
                .map_err(|_| format!("no answer from {addr} within {wait:?}"))?;
            conn.close(0u32.into(), b"done");
            answer
        })
    }

    /// Joins the rendezvous as `cfg.rank` (as the real rank would) and keeps the connection to rank 0
    /// open. Returns the ring's addresses.
    pub fn join(&mut self, cfg: &QuicConfig) -> Result<Vec<SocketAddr>, String> {
        let deadline = Instant::now() + cfg.rendezvous_timeout;
        let (ring, host) = self
            .rt
            .block_on(rendezvous::join(cfg, &self.endpoint, &self.key, None, deadline))
            .map_err(|e| e.to_string())?;
        self.host = Some(host);
        Ok(ring.addrs)
    }

    /// From now on the rogue's endpoint presents another certificate to the connections it accepts: it
    /// stands for an endpoint that took over the address a rank joined from.
    pub fn present_another_certificate(&self) -> Result<(), String> {
        let _rt = self.rt.enter();
        endpoint::present_another_certificate(&self.endpoint, self.idle).map(|_| ())
    }
}

impl Drop for Rogue {
    fn drop(&mut self) {
        self.endpoint.close(0u32.into(), b"bye");
    }
}
