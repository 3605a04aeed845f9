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

use super::{join_with, quic_config, JoinOptions, LaunchEnv, NetworkEnv, JOIN_ADDRS_VAR};
use crate::collective::mem::single_rank;
use crate::collective::quic::ask_to_join;
use crate::collective::{Collective, CollectiveError};
use crate::elastic::{
    next_membership, retry_membership, Cause, ElasticRules, ElasticStop, MemberId, Membership, MAX_MEMBER_ID,
};
use crate::trainer::{MembershipEvent, Regroup, Regrouped};
use anyhow::{ensure, Context, Result};
use std::net::SocketAddr;

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

impl QuicRegroup {
    /// Joins membership `next` as `rank`, with rank 0 at `master`: the new rank 0 rebinds that address
    /// (where the last ring knew it) and hosts the epoch's rendezvous.
    fn join_epoch(&mut self, next: &Membership, rank: usize, master: SocketAddr) -> Result<Box<dyn Collective>> {
        ensure!(
            !self.opts.faults.dies_entering_epoch(self.member as usize, next.epoch),
            "member {}: injected fault: dying as it sets out for the rendezvous of epoch {}",
            self.member,
            next.epoch
        );
        if next.world() == 1 {
            return Ok(single_rank());
        }
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
        // The new rank 0 binds the address the last ring knew it by (and a rank with a listen port that
        // port), retrying while the last ring's endpoint lets go of it.
        let comm = join_with(&launch, &opts, &self.network)?;
        self.addrs = comm.ring_addrs().context("the re-formed ring has no addresses")?;
        Ok(comm)
    }
}

impl Regroup for QuicRegroup {
    fn regroup(&mut self, last: &Membership, event: MembershipEvent, committed: u64) -> Result<Regrouped> {
        let stopped = |lost: &[(MemberId, Cause)], stop: ElasticStop| {
            let lost: Vec<String> = lost.iter().map(|(m, cause)| format!("member {m} ({cause})")).collect();
            anyhow::anyhow!(
                "the job stops after losing {} at committed step {committed}: {stop}",
                lost.join(", ")
            )
        };
        let (mut next, mut lost, joined) = match event {
            MembershipEvent::Lost(member, cause) => {
                let survivors: Vec<MemberId> = last.members.iter().copied().filter(|&m| m != member).collect();
                let lost = vec![(member, cause)];
                let next = next_membership(last, &survivors, &self.rules).map_err(|stop| stopped(&lost, stop))?;
                (next, lost, Vec::new())
            }
            MembershipEvent::Joins(member) => {
                let mut members = last.members.clone();
                members.push(member);
                let next = Membership {
                    epoch: last.epoch + 1,
                    members,
                };
                (next, Vec::new(), vec![member])
            }
        };
        // Each attempt that does not form names the members it missed, the same on every survivor that took
        // part; the next attempt goes without them, judged against `last`, the membership that ran.
        loop {
            let rank = next
                .rank_of(self.member)
                .context("this member is not part of the next membership")?;
            let master = self.addrs[last
                .rank_of(next.members[0])
                .expect("rank 0 comes from the last membership")];
            tracing::warn!(
                "member {}: {event:?}; re-forming as rank {rank} of {} (epoch {}) with rank 0 at {master}",
                self.member,
                next.world(),
                next.epoch
            );
            let error = match self.join_epoch(&next, rank, master) {
                Ok(comm) => {
                    let joined = joined.into_iter().filter(|m| next.rank_of(*m).is_some()).collect();
                    return Ok(Regrouped {
                        comm,
                        membership: next,
                        lost,
                        joined,
                    });
                }
                Err(e) => e,
            };
            let Some(absent) = absent_from_attempt(&error, &next) else {
                return Err(error);
            };
            tracing::warn!(
                "member {}: the ring of epoch {} did not form ({error:#}); trying again without {absent:?}",
                self.member,
                next.epoch
            );
            lost.extend(absent.iter().filter(|(m, _)| last.rank_of(*m).is_some()));
            let gone: Vec<MemberId> = absent.iter().map(|&(m, _)| m).collect();
            next = retry_membership(last, &next, &gone, &self.rules).map_err(|stop| stopped(&lost, stop))?;
        }
    }
}

/// The members of the attempted membership `attempt` that a failed join (`error`) leaves out of the next
/// attempt, and why: those its rendezvous missed (absent), or a peer the new ring's control plane named
/// lost while the links were set up. `None`: the failure is not about who is there, and the job stops.
fn absent_from_attempt(error: &anyhow::Error, attempt: &Membership) -> Option<Vec<(MemberId, Cause)>> {
    let ranks: Vec<(usize, Cause)> = error.chain().find_map(|e| match e.downcast_ref::<CollectiveError>()? {
        CollectiveError::Unformed { missing } => Some(missing.iter().map(|&r| (r, Cause::Absent)).collect()),
        CollectiveError::PeerDead { rank, .. } => Some(vec![(*rank, Cause::Dead)]),
        CollectiveError::Timeout { waiting_on, .. } => Some(vec![(*waiting_on, Cause::Frozen)]),
        _ => None,
    })?;
    ranks
        .into_iter()
        .map(|(rank, cause)| Some((*attempt.members.get(rank)?, cause)))
        .collect()
}

/// A member (a restarted rank, `launch` under `--max-restarts`) asking to join the running elastic job
/// whose rank 0 listens at the launch's master address: it says hello as in the first epoch, waits there
/// until the running ranks admit it at a step boundary, then joins the new epoch's rendezvous. Returns its
/// collective, the membership it joined, and the regroup for its later changes.
pub fn rejoin(
    member: MemberId,
    launch: &LaunchEnv,
    opts: &JoinOptions,
    network: &NetworkEnv,
    rules: ElasticRules,
) -> Result<(Box<dyn Collective>, Membership, QuicRegroup)> {
    ensure!(
        member < MAX_MEMBER_ID,
        "member id {member} is too large: a member id is below {MAX_MEMBER_ID}"
    );
    // A hello of the first epoch: the member's first rank in the first world.
    let first = JoinOptions {
        epoch: 0,
        ..opts.clone()
    };
    let cfg = quic_config(launch, &first, network)?;
    let ((epoch, rank, members), master) = ask_to_join(cfg, member, &network.join_addrs).with_context(|| {
        format!(
            "member {member} asking to join the running job at {}:{} (and {} more address(es) of {JOIN_ADDRS_VAR})",
            launch.master_addr,
            launch.master_port,
            network.join_addrs.len()
        )
    })?;
    let membership = Membership { epoch, members };
    ensure!(
        membership.rank_of(member) == Some(rank),
        "rank 0 admitted member {member} as rank {rank} of {:?}",
        membership.members
    );
    let mut regroup = QuicRegroup {
        member,
        launch: launch.clone(),
        opts: opts.clone(),
        network: network.clone(),
        rules,
        addrs: Vec::new(),
    };
    let comm = regroup.join_epoch(&membership, rank, master)?;
    Ok((comm, membership, regroup))
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
