//! Elastic re-forms over QUIC: after a loss, every survivor works out the next membership from the same
//! facts (the last membership and the member the control plane named dead), and the survivors meet at a new
//! rendezvous hosted by the lowest of them, at the address where it listened in the last ring.
//!
//! The QUIC control plane names a lost rank consistently on every survivor: rank 0 tells everyone which
//! rank died, and losing rank 0 names rank 0 everywhere. So each survivor computes the same membership
//! ([`next_membership`], with its quorum rule) without a round of messages, and the rendezvous checks the
//! outcome: a survivor that counted another world is refused by the new rank 0, and the job stops rather
//! than continue split. Each epoch runs under its own job id ([`epoch_job_id`]), so no frame or hello of an
//! older ring is taken for one of the new ring.

use super::{join_on, join_with, JoinOptions, LaunchEnv, NetworkEnv};
use crate::collective::mem::single_rank;
use crate::collective::Collective;
use crate::elastic::{next_membership, Cause, ElasticRules, MemberId, Membership};
use crate::trainer::{Regroup, Regrouped};
use anyhow::{bail, Context, Result};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

/// How long the new rank 0 tries to bind the port its last ring knew it by (the old endpoint closes as it
/// is dropped).
const REBIND_FOR: Duration = Duration::from_secs(5);

/// The job id of membership epoch `epoch`: the job's own for the first, a digest of it and the epoch after.
pub fn epoch_job_id(job_id: u64, epoch: u64) -> u64 {
    if epoch == 0 {
        return job_id;
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"ringtrain elastic epoch");
    hasher.update(&job_id.to_le_bytes());
    hasher.update(&epoch.to_le_bytes());
    u64::from_le_bytes(hasher.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

/// One rank's [`Regroup`] over QUIC: what it joined the job with, and where every rank of its current ring
/// listens.
pub struct QuicRegroup {
    member: MemberId,
    launch: LaunchEnv,
    opts: JoinOptions,
    network: NetworkEnv,
    rules: ElasticRules,
    /// `[world]`: where each rank of the current ring listens.
    addrs: Vec<SocketAddr>,
}

impl QuicRegroup {
    /// The regroup of a rank that joined with `launch`, `opts` and `network` and got `comm`.
    pub fn new(
        launch: &LaunchEnv,
        opts: &JoinOptions,
        network: &NetworkEnv,
        rules: ElasticRules,
        comm: &dyn Collective,
    ) -> Result<Self> {
        let addrs = comm
            .ring_addrs()
            .context("an elastic job needs a transport that can re-form its ring (QUIC)")?;
        Ok(QuicRegroup {
            member: launch.rank as MemberId,
            launch: launch.clone(),
            opts: opts.clone(),
            network: network.clone(),
            rules,
            addrs,
        })
    }
}

impl Regroup for QuicRegroup {
    fn regroup(&mut self, last: &Membership, blamed: Option<(MemberId, Cause)>, committed: u64) -> Result<Regrouped> {
        let Some((lost, cause)) = blamed else {
            bail!("the collective failed without naming a lost rank, so the survivors cannot agree on one")
        };
        let survivors: Vec<MemberId> = last.members.iter().copied().filter(|&m| m != lost).collect();
        let next = next_membership(last, &survivors, &self.rules).map_err(|stop| {
            anyhow::anyhow!("the job stops after losing member {lost} ({cause}) at committed step {committed}: {stop}")
        })?;
        let rank = next
            .rank_of(self.member)
            .context("this member is not among the survivors")?;
        let master = self.addrs[last
            .rank_of(next.members[0])
            .expect("a survivor of the last membership")];
        tracing::warn!(
            "member {}: member {lost} lost ({cause}); re-forming as rank {rank} of {} (epoch {}) with rank 0 at \
             {master}",
            self.member,
            next.world(),
            next.epoch
        );
        let comm = if next.world() == 1 {
            single_rank()
        } else {
            let launch = LaunchEnv {
                rank,
                world_size: next.world(),
                local_world_size: self.launch.local_world_size.min(next.world()),
                master_addr: master.ip().to_string(),
                master_port: master.port(),
                ..self.launch.clone()
            };
            let opts = JoinOptions {
                epoch: next.epoch,
                // The plan's ranks name first members: each group takes its members' faults.
                faults: self.opts.faults.for_members(&next.members),
                ..self.opts.clone()
            };
            let comm = if rank == 0 {
                let ip = self.network.bind_ip.unwrap_or(master.ip());
                let socket = rebind(SocketAddr::new(ip, master.port()))?;
                join_on(&launch, &opts, &self.network, socket)?
            } else {
                join_with(&launch, &opts, &self.network)?
            };
            self.addrs = comm.ring_addrs().context("the re-formed ring has no addresses")?;
            comm
        };
        Ok(Regrouped {
            comm,
            membership: next,
            lost: vec![(lost, cause)],
            joined: Vec::new(),
        })
    }
}

/// Binds `addr`, retrying while the last ring's endpoint still holds it.
fn rebind(addr: SocketAddr) -> Result<UdpSocket> {
    let until = Instant::now() + REBIND_FOR;
    loop {
        match UdpSocket::bind(addr) {
            Ok(socket) => return Ok(socket),
            Err(e) if Instant::now() < until && e.kind() == std::io::ErrorKind::AddrInUse => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e).with_context(|| format!("binding {addr} to host the re-formed ring")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_epoch_has_its_own_job_id_and_the_first_keeps_the_job_s() {
        assert_eq!(epoch_job_id(42, 0), 42);
        let ids: std::collections::BTreeSet<u64> = (0..100).map(|e| epoch_job_id(42, e)).collect();
        assert_eq!(ids.len(), 100);
        assert_ne!(epoch_job_id(42, 1), epoch_job_id(43, 1));
    }
}
