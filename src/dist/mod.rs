//! Joining a job: who am I and where is the master (flags, torchrun or Slurm variables), which cluster
//! secret and job id, and [`join`], the one function that turns them into a [`Collective`] for the binary,
//! the sim and the tests. The rendezvous itself and its messages live in [`crate::collective::quic`].

pub mod env;
pub mod threads;

pub use env::{detect_launch, generate_secret, load_secret, resolve_master, LaunchEnv, LaunchFlags, LaunchSource};
pub use threads::{thread_budget, ThreadBudget};

use std::time::Duration;

use anyhow::Context;

use crate::collective::mem::single_rank;
use crate::collective::quic::{QuicCollective, QuicConfig};
use crate::collective::Collective;

/// The environment variable holding the job id (a decimal number), which every rank of a job must share.
/// `ringtrain launch` sets it to a fresh random id.
pub const JOB_ID_VAR: &str = "RINGTRAIN_JOB_ID";

/// What [`join`] needs besides the launch environment.
#[derive(Clone, Debug)]
pub struct JoinOptions {
    /// Digest of what every rank must agree on (for training, `TrainOptions::job_hash`); ranks with
    /// different hashes are refused at rendezvous. It is also the job id when [`JOB_ID_VAR`] is not set.
    pub config_hash: u64,
    /// Cluster secret ([`load_secret`]); required unless the master is a loopback address.
    pub secret: Option<Vec<u8>>,
    /// Per-collective deadline.
    pub timeout: Duration,
}

/// The job id: the value of [`JOB_ID_VAR`] when it is set (`value`), else `config_hash`. A value that is not
/// a number is an error naming the variable.
pub fn job_id(value: Option<&str>, config_hash: u64) -> anyhow::Result<u64> {
    match value {
        Some(id) => id
            .trim()
            .parse()
            .with_context(|| format!("{JOB_ID_VAR}={id:?} is not a number")),
        None => Ok(config_hash),
    }
}

/// Joins the job described by `launch`: a one-rank group, which never communicates, when the world size is
/// 1, else the QUIC ring (rendezvous at the master) with the job id of [`job_id`] read from the process
/// environment. Blocks until every rank has joined.
pub fn join(launch: &LaunchEnv, opts: &JoinOptions) -> anyhow::Result<Box<dyn Collective>> {
    if launch.world_size == 1 {
        return Ok(single_rank());
    }
    let master = resolve_master(&launch.master_addr, launch.master_port).map_err(anyhow::Error::msg)?;
    let mut cfg = QuicConfig::new(launch.rank, launch.world_size, master);
    cfg.secret = opts.secret.clone();
    cfg.timeout = opts.timeout;
    cfg.config_hash = opts.config_hash;
    cfg.job_id = job_id(std::env::var(JOB_ID_VAR).ok().as_deref(), opts.config_hash)?;
    let comm = QuicCollective::connect(cfg).with_context(|| {
        format!(
            "rank {} of {}: joining the ring at {master}",
            launch.rank, launch.world_size
        )
    })?;
    Ok(Box::new(comm))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_id_is_the_variable_or_the_config_hash() {
        assert_eq!(job_id(None, 77).unwrap(), 77);
        assert_eq!(job_id(Some(" 12345\n"), 77).unwrap(), 12345);
        let err = format!("{:#}", job_id(Some("my-job"), 77).unwrap_err());
        assert!(err.contains("RINGTRAIN_JOB_ID") && err.contains("my-job"), "{err}");
    }
}
