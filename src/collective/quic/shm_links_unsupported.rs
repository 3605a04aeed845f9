//! Shared-memory ring links need Linux (memfd, eventfd, abstract Unix sockets, `SO_PEERCRED`). Elsewhere every
//! ring link is QUIC: `--transport auto` says so once, `--transport shm` is refused at start. The types stand
//! in for the Linux ones and have no values, so the links' code is the same on every system.

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::framing::LinkEvent;
use super::messages::LocalEndpoint;
use super::{local, QuicConfig};
use crate::collective::shm::LinkTransport;
use crate::collective::Result;

/// No segment listener exists here.
pub(super) enum ShmListener {}
/// No link's sending end exists here.
pub(super) enum ShmSender {}
/// No link's receiving end exists here.
pub(super) enum ShmReceiver {}

impl ShmSender {
    pub(super) async fn write_all_chunks(&mut self, _chunks: &[bytes::Bytes]) -> std::result::Result<(), String> {
        match *self {}
    }

    pub(super) fn try_write_whole(&mut self, _pieces: &[&[u8]]) -> std::result::Result<bool, String> {
        match *self {}
    }
}

/// This rank's side of shared memory: always none here.
pub(super) struct LocalSide {
    pub(super) listener: Option<ShmListener>,
    pub(super) endpoint: Option<LocalEndpoint>,
}

impl LocalSide {
    pub(super) fn prepare(cfg: &QuicConfig) -> Result<LocalSide> {
        if cfg.world > 1 {
            match cfg.transport {
                LinkTransport::Shm => return Err(local("--transport shm: shared-memory links need Linux")),
                LinkTransport::Auto => {
                    tracing::warn!(
                        "rank {}: shared-memory links need Linux; every link uses QUIC",
                        cfg.rank
                    )
                }
                LinkTransport::Quic => {}
            }
        }
        Ok(LocalSide {
            listener: None,
            endpoint: None,
        })
    }
}

/// Never called: no endpoint is ever announced here, so no link is local.
pub(super) async fn offer_right(
    _cfg: &QuicConfig,
    _right: usize,
    _endpoint: &LocalEndpoint,
    _deadline: Instant,
) -> Result<Option<ShmSender>> {
    Ok(None)
}

pub(super) async fn accept_left(
    _cfg: &QuicConfig,
    listener: &ShmListener,
    _from: &[(usize, &LocalEndpoint)],
) -> Result<(usize, ShmReceiver)> {
    match *listener {}
}

pub(super) fn spawn_reader(
    rx: ShmReceiver,
    _max_payload: usize,
    _queue: usize,
) -> (mpsc::Receiver<LinkEvent>, JoinHandle<()>) {
    match rx {}
}
