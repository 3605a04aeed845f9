//! Distributed launch: environment detection, the cluster secret, and the rendezvous protocol's messages.
//!
//! The network side of the rendezvous lives in [`crate::collective::quic`] (quinn is imported in one place);
//! this module holds what can be decided without sockets: who am I, where is the master, which secret, and
//! whether a hello matches this job.

pub mod env;

pub use env::{detect_launch, generate_secret, load_secret, resolve_master, LaunchEnv, LaunchFlags, LaunchSource};

use std::time::Duration;

use crate::collective::mem::{mem_cluster, MemOptions};
use crate::collective::quic::{QuicCollective, QuicConfig};
use crate::collective::Collective;

/// What [`join`] needs besides the launch environment.
#[derive(Clone, Debug)]
pub struct JoinOptions {
    /// Job id; `None` = [`default_job_id`].
    pub job_id: Option<u64>,
    /// Hash of the training config; ranks with different hashes are refused at rendezvous.
    pub config_hash: u64,
    /// Cluster secret ([`load_secret`]); required unless the master is a loopback address.
    pub secret: Option<Vec<u8>>,
    /// Per-collective deadline (`--timeout`).
    pub timeout: Duration,
}

/// Job id shared by all ranks: `RINGTRAIN_JOB_ID` (a number, or any string, hashed) when set, else a hash of
/// the master address and port, which every rank of a job already agrees on.
pub fn default_job_id(master_addr: &str, master_port: u16) -> u64 {
    let h = |s: &str| u64::from_le_bytes(blake3::hash(s.as_bytes()).as_bytes()[..8].try_into().expect("8 bytes"));
    match std::env::var("RINGTRAIN_JOB_ID") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| h(&format!("ringtrain job id {v}"))),
        Err(_) => h(&format!("ringtrain job at {master_addr}:{master_port}")),
    }
}

/// Joins the job described by `launch`: a trivial one-rank group when the world size is 1, else the QUIC
/// ring (rendezvous at the master). Blocks until every rank has joined.
pub fn join(launch: &LaunchEnv, opts: &JoinOptions) -> anyhow::Result<Box<dyn Collective>> {
    if launch.world_size == 1 {
        let mut one = mem_cluster(
            1,
            MemOptions {
                deadline: opts.timeout,
                ..MemOptions::default()
            },
        );
        return Ok(Box::new(one.pop().expect("one rank")));
    }
    let master = resolve_master(&launch.master_addr, launch.master_port).map_err(anyhow::Error::msg)?;
    let mut cfg = QuicConfig::new(launch.rank, launch.world_size, master);
    cfg.job_id = opts
        .job_id
        .unwrap_or_else(|| default_job_id(&launch.master_addr, launch.master_port));
    cfg.config_hash = opts.config_hash;
    cfg.secret = opts.secret.clone();
    cfg.timeout = opts.timeout;
    let q = QuicCollective::connect(cfg).map_err(|e| anyhow::anyhow!("rank {}: {e}", launch.rank))?;
    Ok(Box::new(q))
}
