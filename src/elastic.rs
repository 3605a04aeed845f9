//! Elastic membership: which members form the group after some are lost, decided by a rule every
//! survivor applies to the same facts, and the record a membership change leaves in the metrics.
//!
//! A member is named by the rank it had in the job's first membership ([`MemberId`]); ranks are
//! positions in the current membership and are renumbered at each change (survivors keep their order, so
//! the lowest surviving member becomes rank 0 and takes over rank 0's duties). The survivors agree on the
//! step to continue from in the trainer ([`crate::trainer::Trainer::reform`]): the highest step any of
//! them committed, the others catching up from the lowest-numbered survivor that holds it.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A member of the job: the rank it had in the first membership, or for a member that joined later the id
/// it was started with (past the first membership's ranks).
pub type MemberId = u32;

/// Member ids are below this: the ranks agree on a joiner with an all-reduce of `f64`s, exact far beyond it.
pub const MAX_MEMBER_ID: MemberId = 1 << 20;

/// The members of one epoch, in rank order (rank `r` is `members[r]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    /// Counted from 0 at the job's start; each change adds one.
    pub epoch: u64,
    pub members: Vec<MemberId>,
}

impl Membership {
    /// The first membership of a `world`-rank job: member `r` at rank `r`.
    pub fn initial(world: usize) -> Membership {
        Membership {
            epoch: 0,
            members: (0..world as MemberId).collect(),
        }
    }

    pub fn world(&self) -> usize {
        self.members.len()
    }

    /// The rank `member` has in this membership, if it is part of it.
    pub fn rank_of(&self, member: MemberId) -> Option<usize> {
        self.members.iter().position(|&m| m == member)
    }
}

/// Which survivors may continue after a loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Quorum {
    /// A strict majority of the last membership: two sides of a partition can never both continue (and a
    /// 2-rank job stops when it loses one).
    Majority,
    /// Any survivors at all. Both sides of a network partition may then train on as two diverging jobs
    /// (each writing its own checkpoints): for a user who knows the ranks cannot be partitioned, such as
    /// a 2-rank job whose ranks share a host.
    Any,
}

impl Quorum {
    pub fn parse(text: &str) -> Result<Quorum, String> {
        match text {
            "majority" => Ok(Quorum::Majority),
            "any" => Ok(Quorum::Any),
            other => Err(format!("--quorum {other:?}: expected majority or any")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Quorum::Majority => "majority",
            Quorum::Any => "any",
        }
    }
}

/// What an elastic job allows when members are lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElasticRules {
    pub quorum: Quorum,
    /// The job stops cleanly below this many ranks (`--min-ranks`, at least 1).
    pub min_ranks: usize,
}

impl ElasticRules {
    /// The smallest group a job that starts with `world` ranks can shrink to: `--min-ranks`, and under a
    /// majority quorum two (a group of two cannot lose one: one is not a strict majority of two).
    pub fn smallest_group(&self, world: usize) -> usize {
        let quorum_floor = match self.quorum {
            Quorum::Majority => 2,
            Quorum::Any => 1,
        };
        self.min_ranks.max(quorum_floor).min(world).max(1)
    }
}

impl Default for ElasticRules {
    fn default() -> Self {
        ElasticRules {
            quorum: Quorum::Majority,
            min_ranks: 1,
        }
    }
}

/// Why a member left the membership.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cause {
    /// Its process or connection is gone (a peer saw it die).
    Dead,
    /// Alive as far as anyone knows, but silent for the detection time.
    Frozen,
    /// Did not reach the rendezvous of a re-form in time (dead or cut off on the way), or could not host
    /// it: the others formed the group without it.
    Absent,
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Cause::Dead => "dead",
            Cause::Frozen => "frozen",
            Cause::Absent => "absent",
        })
    }
}

/// The survivors may not continue: the job stops at its last committed step.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ElasticStop {
    #[error(
        "{survivors} of the {last} members survive, not a strict majority of the last membership: the other side \
         of a network partition could be continuing, so this side stops (--quorum any lets any survivors go on, at \
         that risk)"
    )]
    NoQuorum { survivors: usize, last: usize },
    #[error("{survivors} ranks survive, fewer than --min-ranks {min_ranks}")]
    BelowMinimum { survivors: usize, min_ranks: usize },
    #[error("member {member} is not part of the membership of epoch {epoch}")]
    NotAMember { member: MemberId, epoch: u64 },
}

/// The next membership after the members of `last` not in `survivors` are lost: the survivors in their
/// old order, one epoch on. Refused when the survivors are no quorum or fewer than `--min-ranks`, or name
/// a member `last` does not have.
pub fn next_membership(
    last: &Membership,
    survivors: &[MemberId],
    rules: &ElasticRules,
) -> Result<Membership, ElasticStop> {
    if let Some(&member) = survivors.iter().find(|&&m| last.rank_of(m).is_none()) {
        return Err(ElasticStop::NotAMember {
            member,
            epoch: last.epoch,
        });
    }
    let members: Vec<MemberId> = last.members.iter().copied().filter(|m| survivors.contains(m)).collect();
    let (alive, before) = (members.len(), last.world());
    if rules.quorum == Quorum::Majority && 2 * alive <= before {
        return Err(ElasticStop::NoQuorum {
            survivors: alive,
            last: before,
        });
    }
    if alive < rules.min_ranks.max(1) {
        return Err(ElasticStop::BelowMinimum {
            survivors: alive,
            min_ranks: rules.min_ranks.max(1),
        });
    }
    Ok(Membership {
        epoch: last.epoch + 1,
        members,
    })
}

/// The membership to try after `attempted` did not form because `absent` (its members) did not reach its
/// rendezvous: the rest, in their order, one epoch after the attempt. The quorum and `--min-ranks` are
/// judged against `formed`, the last membership that did form (never against an attempt, so that a chain
/// of failed re-forms cannot shrink the group past a majority of what ran). Members of the attempt that
/// were joining (not in `formed`) stay in it unless absent, after the others.
pub fn retry_membership(
    formed: &Membership,
    attempted: &Membership,
    absent: &[MemberId],
    rules: &ElasticRules,
) -> Result<Membership, ElasticStop> {
    let present = |m: &MemberId| !absent.contains(m);
    let old: Vec<MemberId> = attempted
        .members
        .iter()
        .copied()
        .filter(|&m| present(&m) && formed.rank_of(m).is_some())
        .collect();
    let mut next = next_membership(formed, &old, rules)?;
    let joining = attempted
        .members
        .iter()
        .filter(|&&m| present(&m) && formed.rank_of(m).is_none());
    next.members.extend(joining);
    next.epoch = attempted.epoch + 1;
    Ok(next)
}

/// A membership change, as the metrics record it on the first step the new membership completes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MembershipChange {
    pub epoch: u64,
    /// The members lost, and why.
    pub lost: Vec<(MemberId, Cause)>,
    /// The members that joined.
    #[serde(default)]
    pub joined: Vec<MemberId>,
    /// The new membership, in rank order.
    pub members: Vec<MemberId>,
    /// The step every survivor continued from (the highest any of them had committed).
    pub resumed_from_step: u64,
    /// From the moment this rank saw the loss (its collective failed), or the change began, to the end of
    /// the first step the new membership completed, in milliseconds.
    pub recovery_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survivors_keep_their_order_and_the_lowest_becomes_rank_0() {
        let last = Membership::initial(4);
        let next = next_membership(&last, &[3, 1, 2], &ElasticRules::default()).unwrap();
        assert_eq!(next.members, vec![1, 2, 3]);
        assert_eq!((next.epoch, next.rank_of(1), next.rank_of(0)), (1, Some(0), None));
    }

    #[test]
    fn a_majority_quorum_lets_only_one_side_of_a_partition_continue() {
        let rules = ElasticRules::default();
        let last = Membership::initial(4);
        // 2 + 2: neither half is a strict majority.
        for side in [[0, 1], [2, 3]] {
            let err = next_membership(&last, &side, &rules).unwrap_err();
            assert_eq!(err, ElasticStop::NoQuorum { survivors: 2, last: 4 });
        }
        // 3 + 1: exactly one side goes on.
        assert!(next_membership(&last, &[0, 1, 2], &rules).is_ok());
        assert!(next_membership(&last, &[3], &rules).is_err());
        // Every split of 5 members: never both sides.
        let all: Vec<MemberId> = (0..5).collect();
        let last = Membership::initial(5);
        for mask in 0u32..32 {
            let (a, b): (Vec<MemberId>, Vec<MemberId>) = all.iter().partition(|&&m| mask & (1 << m) != 0);
            let both = next_membership(&last, &a, &rules).is_ok() && next_membership(&last, &b, &rules).is_ok();
            assert!(!both, "{a:?} and {b:?} would both continue");
        }
    }

    #[test]
    fn the_smallest_group_follows_the_quorum_and_min_ranks() {
        let majority = ElasticRules::default();
        assert_eq!([1, 2, 3, 8].map(|w| majority.smallest_group(w)), [1, 2, 2, 2]);
        let any = ElasticRules {
            quorum: Quorum::Any,
            min_ranks: 1,
        };
        assert_eq!([1, 2, 8].map(|w| any.smallest_group(w)), [1, 1, 1]);
        let four = ElasticRules { min_ranks: 4, ..any };
        assert_eq!([3, 4, 8].map(|w| four.smallest_group(w)), [3, 4, 4]);
    }

    #[test]
    fn a_lone_survivor_of_two_needs_quorum_any_and_min_ranks_stops_the_job() {
        let last = Membership::initial(2);
        let stop = next_membership(&last, &[1], &ElasticRules::default()).unwrap_err();
        assert!(stop.to_string().contains("--quorum any"), "{stop}");
        let any = ElasticRules {
            quorum: Quorum::Any,
            min_ranks: 1,
        };
        assert_eq!(next_membership(&last, &[1], &any).unwrap().members, vec![1]);
        let floor = ElasticRules {
            quorum: Quorum::Majority,
            min_ranks: 3,
        };
        let stop = next_membership(&Membership::initial(3), &[0, 2], &floor).unwrap_err();
        assert_eq!(
            stop,
            ElasticStop::BelowMinimum {
                survivors: 2,
                min_ranks: 3
            }
        );
    }

    #[test]
    fn a_failed_re_form_is_retried_without_the_absent_and_judged_against_what_formed() {
        let formed = Membership::initial(5);
        let rules = ElasticRules::default();
        let attempt = next_membership(&formed, &[0, 1, 2, 3], &rules).unwrap();
        let retry = retry_membership(&formed, &attempt, &[0], &rules).unwrap();
        assert_eq!((retry.epoch, retry.members.clone()), (2, vec![1, 2, 3]));
        // Another loss in that attempt: 2 of the 5 that formed is no majority, whatever the attempts were.
        let stop = retry_membership(&formed, &retry, &[3], &rules).unwrap_err();
        assert_eq!(stop, ElasticStop::NoQuorum { survivors: 2, last: 5 });
        // A joiner that does not arrive is dropped; one that does stays last.
        let joining = Membership {
            epoch: 1,
            members: vec![0, 1, 2, 3, 4, 7],
        };
        let retry = retry_membership(&formed, &joining, &[7], &rules).unwrap();
        assert_eq!((retry.epoch, retry.members), (2, vec![0, 1, 2, 3, 4]));
        let retry = retry_membership(&formed, &joining, &[2], &rules).unwrap();
        assert_eq!(retry.members, vec![0, 1, 3, 4, 7]);
    }

    #[test]
    fn a_member_outside_the_membership_is_refused() {
        let last = next_membership(
            &Membership::initial(3),
            &[0, 1],
            &ElasticRules {
                quorum: Quorum::Any,
                min_ranks: 1,
            },
        )
        .unwrap();
        let stop = next_membership(&last, &[0, 2], &ElasticRules::default()).unwrap_err();
        assert_eq!(stop, ElasticStop::NotAMember { member: 2, epoch: 1 });
    }
}
