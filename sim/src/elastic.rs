//! `--elastic` in the sim: the survivors of a lost worker agree on the next membership on an in-process
//! board and continue over a fresh in-memory ring.
//!
//! The board stands in for the agreement real processes would run among themselves; what it decides
//! comes from the library's rule ([`next_membership`]) and what the trainer does with it
//! ([`Trainer::reform`](ringtrain::trainer::Trainer::reform): the catch-up, the re-split) is the same code
//! a real process runs. Each survivor reports the member its collective blamed and the last step it
//! committed. The board decides once every member of the last membership has reported or been seen dead
//! by someone, or when the detection time has passed since the first report (a member neither dead nor
//! heard from is then lost as frozen). A member that reports after the group moved on (a frozen worker
//! waking up) is refused: it is no longer part of the job.

use anyhow::{anyhow, bail, Result};
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::collective::Collective;
use ringtrain::elastic::{next_membership, Cause, ElasticRules, MemberId, Membership};
use ringtrain::trainer::{MembershipEvent, Regroup, Regrouped};
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The in-process agreement every worker of an elastic sim run shares.
pub struct Board {
    rules: ElasticRules,
    /// The options of every group's ring; its fault plan names the first members ([`FaultPlan::for_members`]
    /// renames it for each group).
    ///
    /// [`FaultPlan::for_members`]: ringtrain::fault_plan::FaultPlan::for_members
    ring: MemOptions,
    /// How long the board waits for members it has not heard from.
    detection: Duration,
    /// The size of the first membership (a joiner's id is the next one).
    first_world: usize,
    state: Mutex<BoardState>,
    changed: Condvar,
}

struct BoardState {
    membership: Membership,
    /// The round being agreed: who reported, and who was blamed for what.
    reported: BTreeMap<MemberId, u64>,
    blamed: BTreeMap<MemberId, Cause>,
    first_report: Option<Instant>,
    /// The last decision: the new group's collectives, each taken by its member, and what was lost.
    handout: BTreeMap<MemberId, Box<dyn Collective>>,
    lost: Vec<(MemberId, Cause)>,
    /// Set when the survivors may not continue; every later report gets it.
    stopped: Option<String>,
    /// Members that finished the run, with their last step: they no longer answer, but they count for
    /// the quorum (they were not cut off; they are done).
    finished: BTreeMap<MemberId, u64>,
    /// `join=STEP`: the step the new member joins before, whether that has happened, the member waiting
    /// to be admitted, and whether this round is the planned one (every member asked for it).
    join_before: Option<u64>,
    join_done: bool,
    joiner: Option<MemberId>,
    growing: bool,
    /// The members the last decision added.
    joined: Vec<MemberId>,
}

impl Board {
    pub fn new(world: usize, rules: ElasticRules, ring: MemOptions, detection: Duration) -> Board {
        let join_before = ring.faults.join_before();
        Board {
            rules,
            ring,
            detection,
            first_world: world,
            state: Mutex::new(BoardState {
                membership: Membership::initial(world),
                reported: BTreeMap::new(),
                blamed: BTreeMap::new(),
                first_report: None,
                handout: BTreeMap::new(),
                lost: Vec::new(),
                stopped: None,
                finished: BTreeMap::new(),
                join_before,
                join_done: false,
                joiner: None,
                growing: false,
                joined: Vec::new(),
            }),
            changed: Condvar::new(),
        }
    }

    /// The first group's collectives, in rank order.
    pub fn first_group(&self) -> Vec<Box<dyn Collective>> {
        let first = self.state.lock().unwrap_or_else(|e| e.into_inner()).membership.clone();
        let ring = MemOptions {
            faults: self.ring.faults.for_members(&first.members),
            ..self.ring.clone()
        };
        mem_cluster(first.world(), ring)
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Collective>)
            .collect()
    }

    /// A worker's handle on the board.
    pub fn member(&self, member: MemberId) -> BoardMember<'_> {
        BoardMember { board: self, member }
    }

    /// Member `member` finished the run after `step` steps. A worker whose last collective failed while
    /// this one's completed is then not left waiting for it.
    pub fn finished(&self, member: MemberId, step: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.finished.insert(member, step);
        self.changed.notify_all();
    }

    /// The member the plan adds after step `completed` (the same answer for every member): the first id
    /// after the first membership's.
    fn joiner_due(&self, completed: u64) -> Option<MemberId> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let due = !state.join_done && state.join_before == Some(completed + 1);
        due.then_some(self.first_world as MemberId)
    }

    /// A new worker, `member`, waits to be admitted at the planned step boundary; returns its place in the
    /// group that takes it in.
    pub fn admit(&self, member: MemberId) -> Result<Regrouped> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.joiner = Some(member);
        self.changed.notify_all();
        loop {
            if let Some(why) = &state.stopped {
                bail!("{why}");
            }
            if let Some(comm) = state.handout.remove(&member) {
                return Ok(Regrouped {
                    comm,
                    membership: state.membership.clone(),
                    lost: state.lost.clone(),
                    joined: state.joined.clone(),
                });
            }
            if state.join_done {
                bail!("member {member} was not admitted: the members did not wait for it");
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn regroup(
        &self,
        member: MemberId,
        last: &Membership,
        event: MembershipEvent,
        committed: u64,
    ) -> Result<Regrouped> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &state.stopped {
            bail!("{why}");
        }
        if last.epoch != state.membership.epoch {
            bail!(
                "member {member} reports a loss in the group of epoch {}, but the job has moved on to epoch {} \
                 without it (it was lost as {}): it is no longer part of the job",
                last.epoch,
                state.membership.epoch,
                state
                    .lost
                    .iter()
                    .find(|(m, _)| *m == member)
                    .map_or("unknown".to_string(), |(_, c)| c.to_string())
            );
        }
        let epoch = last.epoch;
        state.reported.insert(member, committed);
        match event {
            // A member that reports is alive, whatever a peer's timeout said.
            MembershipEvent::Lost(peer, cause) => {
                state.blamed.entry(peer).or_insert(cause);
            }
            MembershipEvent::Joins(_) => state.growing = true,
        }
        state.first_report.get_or_insert_with(Instant::now);
        self.changed.notify_all();
        loop {
            if state.membership.epoch != epoch || state.stopped.is_some() {
                break;
            }
            let first = state.first_report.expect("set above");
            // A member seen dead cannot report; one a peer only timed out on may be waiting on a stalled
            // neighbour itself (a stall travels round the ring), so it gets the detection time to report.
            let accounted = state.membership.members.iter().all(|m| {
                state.reported.contains_key(m)
                    || state.finished.contains_key(m)
                    || state.blamed.get(m) == Some(&Cause::Dead)
            }) && (!state.growing || state.joiner.is_some());
            if accounted || first.elapsed() >= self.detection {
                self.decide(&mut state);
                self.changed.notify_all();
                break;
            }
            let wait = self.detection.saturating_sub(first.elapsed());
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if let Some(why) = &state.stopped {
            bail!("{why}");
        }
        let comm = state.handout.remove(&member).ok_or_else(|| {
            anyhow!(
                "member {member} is not part of the group of epoch {}",
                state.membership.epoch
            )
        })?;
        Ok(Regrouped {
            comm,
            membership: state.membership.clone(),
            lost: state.lost.clone(),
            joined: state.joined.clone(),
        })
    }

    /// Applies the rule to the reports of this round and builds the survivors' ring.
    fn decide(&self, state: &mut BoardState) {
        let last = state.membership.clone();
        // Finished members count for the quorum but join no group.
        let finished = |m: &MemberId| state.finished.contains_key(m);
        let alive: Vec<MemberId> = last
            .members
            .iter()
            .copied()
            .filter(|m| state.reported.contains_key(m) || finished(m))
            .collect();
        let lost: Vec<(MemberId, Cause)> = last
            .members
            .iter()
            .filter(|m| !state.reported.contains_key(m) && !finished(m))
            .map(|&m| (m, state.blamed.get(&m).copied().unwrap_or(Cause::Frozen)))
            .collect();
        let newest = state.reported.values().copied().max().unwrap_or(0);
        match next_membership(&last, &alive, &self.rules) {
            Ok(mut next) => {
                next.members.retain(|m| !state.finished.contains_key(m));
                state.joined = Vec::new();
                if state.growing {
                    // The planned round: the joiner, if it came, takes the next rank.
                    state.join_done = true;
                    if let Some(joiner) = state.joiner.take() {
                        next.members.push(joiner);
                        state.joined = vec![joiner];
                    }
                }
                let ring = MemOptions {
                    faults: self.ring.faults.for_members(&next.members),
                    ..self.ring.clone()
                };
                let group = mem_cluster(next.world(), ring);
                state.handout = next
                    .members
                    .iter()
                    .copied()
                    .zip(group)
                    .map(|(m, c)| (m, Box::new(c) as Box<dyn Collective>))
                    .collect();
                state.membership = next;
                state.lost = lost;
            }
            Err(stop) => {
                state.stopped = Some(format!(
                    "the job stops after losing member(s) {lost:?} (the survivors had committed up to step \
                     {newest}): {stop}"
                ));
            }
        }
        state.reported.clear();
        state.blamed.clear();
        state.first_report = None;
        state.growing = false;
    }
}

/// One worker's side of the [`Board`]: the trainer's [`Regroup`].
pub struct BoardMember<'a> {
    board: &'a Board,
    member: MemberId,
}

impl Regroup for BoardMember<'_> {
    fn regroup(&mut self, last: &Membership, event: MembershipEvent, committed: u64) -> Result<Regrouped> {
        self.board.regroup(self.member, last, event, committed)
    }

    fn joiner_due(&mut self, completed: u64) -> Option<MemberId> {
        self.board.joiner_due(completed)
    }
}
