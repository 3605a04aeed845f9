//! The run loop: steps until `--steps`, evaluating and saving at the options' cadence, and telling an
//! observer after each step. The command line, the sim and the tests all run through it.

use super::Trainer;
use crate::backend::Backend;
use crate::collective::{Collective, CollectiveError};
use crate::elastic::{Cause, MemberId, Membership, MembershipChange};
use crate::fault_plan::Fault;
use crate::metrics::StepMetrics;
use crate::model::checkpoint::check_save_target;
use anyhow::{Context, Result};
use std::path::Path;
use std::time::Instant;

/// What a caller of [`Trainer::run`] sees of the run: progress, metrics files, per-step checks.
pub trait RunObserver<B: Backend> {
    /// Before the first step.
    fn started(&mut self, _trainer: &Trainer<B>) -> Result<()> {
        Ok(())
    }

    /// After each step and, when one was due, its evaluation (`m.val_loss`). An error stops the run.
    fn step(&mut self, trainer: &mut Trainer<B>, m: &StepMetrics) -> Result<()>;

    /// After a checkpoint of step `step` was written to `dir` (by rank 0; every rank is told).
    fn saved(&mut self, _step: u64, _dir: &Path) {}

    /// After an injected fault changed this rank's state (a `flip`, after the step's [`RunObserver::step`]).
    fn state_corrupted(&mut self, _trainer: &mut Trainer<B>, _fault: &Fault) -> Result<()> {
        Ok(())
    }
}

/// An observer that does nothing: [`Trainer::run`] for its own sake (tests, the sim's reference run).
pub struct Quiet;

impl<B: Backend> RunObserver<B> for Quiet {
    fn step(&mut self, _trainer: &mut Trainer<B>, _m: &StepMetrics) -> Result<()> {
        Ok(())
    }
}

/// The run's checkpoints so far. A save that fails stops the run (after every rank hears why): the save is
/// atomic, so the checkpoint before it stays whole, and the error says which step that is.
#[derive(Default)]
struct Saves {
    /// The step of the last checkpoint this run saved.
    last: Option<u64>,
}

impl Saves {
    fn save<B: Backend>(&mut self, trainer: &mut Trainer<B>, dir: &Path) -> Result<()> {
        let step = trainer.step;
        if let Err(e) = trainer.save(dir) {
            let kept = match self.last {
                Some(last) => format!("the checkpoint of step {last} there is whole"),
                None => "whatever checkpoint was there before the run is left as it was".to_string(),
            };
            return Err(e.context(format!(
                "step {step}: saving the checkpoint to {} failed, so the run stops; {kept} \
                 (continue with --resume {0})",
                dir.display()
            )));
        }
        self.last = Some(step);
        Ok(())
    }
}

/// What re-forms an elastic group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MembershipEvent {
    /// A collective failed blaming this member (dead, or silent until the deadline).
    Lost(MemberId, Cause),
    /// The ranks agreed, after a step, to take this member in.
    Joins(MemberId),
}

/// How an elastic run ([`Trainer::run_elastic`]) gets its next group: whatever agrees on the members (the
/// sim's in-process board; the QUIC ranks' own rule and a new rendezvous) and connects them.
pub trait Regroup {
    /// The group must change (`event`), after `committed` steps on this rank. Returns the agreed next
    /// membership, which holds this rank, with the collective that joins it and who left and joined; or why
    /// the job stops.
    fn regroup(&mut self, last: &Membership, event: MembershipEvent, committed: u64) -> Result<Regrouped>;

    /// A member this rank knows is due to join after step `completed` (the sim's plan). The ranks agree on
    /// it, together with any join request their collectives hold ([`Collective::pending_join`]), by an
    /// all-reduce after every step of an elastic run.
    fn joiner_due(&mut self, _completed: u64) -> Option<MemberId> {
        None
    }
}

/// A re-formed group, as [`Regroup::regroup`] returns it.
pub struct Regrouped {
    pub comm: Box<dyn Collective>,
    pub membership: Membership,
    /// The members of the last membership not in the new one, and why each was lost.
    pub lost: Vec<(MemberId, Cause)>,
    /// The members of the new membership not in the last one.
    pub joined: Vec<MemberId>,
}

/// The member a failed collective blames, if the failure is a lost peer (dead, or silent until the
/// deadline) rather than a peer's abort, a protocol violation or a local error, which an elastic run does
/// not survive.
pub fn blamed_peer(error: &anyhow::Error, membership: &Membership) -> Option<(MemberId, Cause)> {
    let (rank, cause) = error.chain().find_map(|e| match e.downcast_ref::<CollectiveError>()? {
        CollectiveError::PeerDead { rank, .. } => Some((*rank, Cause::Dead)),
        CollectiveError::Timeout { waiting_on, .. } => Some((*waiting_on, Cause::Frozen)),
        _ => None,
    })?;
    Some((*membership.members.get(rank)?, cause))
}

/// Why the group is re-formed, and the words for the log.
struct Change {
    event: MembershipEvent,
    why: String,
}

/// A change of membership not yet recorded: it goes into the metrics of the next completed step.
#[derive(Clone)]
struct Recovery {
    change: MembershipChange,
    since: Instant,
}

impl<B: Backend> Trainer<B> {
    /// Trains until `--steps`: evaluates every `eval_every` steps and at the end (when `eval_batches` is not
    /// 0), saves every `save_every` steps and at the end (when `save` is set), and tells `observer` after
    /// each step. Before the first step, rank 0 checks that it can write the checkpoints. On any error the
    /// other ranks are told why ([`Trainer::abort`]) before it is returned. Returns the last step's metrics
    /// (none when the run was already at its last step).
    pub fn run(&mut self, observer: &mut dyn RunObserver<B>) -> Result<Option<StepMetrics>> {
        let result = self.run_steps(observer, None);
        if let Err(e) = &result {
            self.abort(&format!("{e:#}"));
        }
        result
    }

    /// [`Trainer::run`] for an elastic job (`TrainOptions::elastic`): when a collective fails because a peer
    /// was lost, `regroup` agrees on the survivors and joins them, the trainer re-forms
    /// ([`Trainer::reform`]) and the run goes on from the step the survivors agreed on. Any other error
    /// ends the run as in [`Trainer::run`].
    pub fn run_elastic(
        &mut self,
        observer: &mut dyn RunObserver<B>,
        regroup: &mut dyn Regroup,
    ) -> Result<Option<StepMetrics>> {
        anyhow::ensure!(
            self.opts.elastic.is_some(),
            "run_elastic needs elastic options (TrainOptions::elastic)"
        );
        let result = self.run_steps(observer, Some(regroup));
        if let Err(e) = &result {
            self.abort(&format!("{e:#}"));
        }
        result
    }

    fn run_steps(
        &mut self,
        observer: &mut dyn RunObserver<B>,
        mut regroup: Option<&mut dyn Regroup>,
    ) -> Result<Option<StepMetrics>> {
        let save = self.opts.save.clone();
        // Rank 0 writes the checkpoints: find out now, not after the run, when the path cannot take one.
        if let (Some(dir), 0) = (&save, self.rank) {
            check_save_target(dir).with_context(|| {
                format!(
                    "--save {}: the run's checkpoints could not be written there, so it was not started",
                    dir.display()
                )
            })?;
        }
        observer.started(self)?;
        let mut saves = Saves::default();
        let mut last = None;
        // A joiner's admission (`Trainer::join_running`) is recorded like any change.
        let mut recovery: Option<Recovery> = self
            .pending_change
            .take()
            .map(|(change, since)| Recovery { change, since });
        while self.step < self.opts.steps {
            match self.step_and_after(observer, &mut saves, save.as_deref(), &mut recovery) {
                Ok(m) => {
                    last = Some(m);
                    // A member joining at this step boundary, agreed by every rank.
                    let Some(regroup) = regroup.as_deref_mut() else {
                        continue;
                    };
                    if self.step >= self.opts.steps {
                        continue;
                    }
                    let joiner = match self.agree_on_joiner(regroup.joiner_due(self.step)) {
                        Ok(joiner) => joiner,
                        // Lost while agreeing: the next step's collectives fail the same way, and re-form.
                        Err(e) if blamed_peer(&e, &self.membership).is_some() => None,
                        Err(e) => return Err(e),
                    };
                    if let Some(member) = joiner {
                        let change = Change {
                            event: MembershipEvent::Joins(member),
                            why: format!("member {member} joins"),
                        };
                        self.regroup_now(regroup, change, &mut recovery, &mut saves, save.as_deref(), observer)?;
                    }
                }
                Err(e) => {
                    let Some(regroup) = regroup.as_deref_mut() else {
                        return Err(e);
                    };
                    let Some(blamed) = blamed_peer(&e, &self.membership) else {
                        return Err(e);
                    };
                    let change = Change {
                        event: MembershipEvent::Lost(blamed.0, blamed.1),
                        why: format!("{e:#}"),
                    };
                    self.regroup_now(regroup, change, &mut recovery, &mut saves, save.as_deref(), observer)?;
                }
            }
        }
        if let Some(dir) = &save {
            saves.save(self, dir)?;
            observer.saved(self.step, dir);
        }
        Ok(last)
    }

    /// Drops the group, agrees on the next one through `regroup`, re-forms and notes the change for the
    /// next step's metrics; saves when a save was due at the step the group continues from.
    fn regroup_now(
        &mut self,
        regroup: &mut dyn Regroup,
        mut change: Change,
        recovery: &mut Option<Recovery>,
        saves: &mut Saves,
        save: Option<&Path>,
        observer: &mut dyn RunObserver<B>,
    ) -> Result<()> {
        loop {
            let before = recovery.clone();
            match self.regroup_once(regroup, change, recovery, saves, save, observer) {
                Ok(()) => return Ok(()),
                // A member lost while the group re-forms (during the catch-up, say): it re-forms again
                // without that member.
                Err(e) => {
                    let Some((member, cause)) = blamed_peer(&e, &self.membership) else {
                        return Err(e);
                    };
                    *recovery = before;
                    change = Change {
                        event: MembershipEvent::Lost(member, cause),
                        why: format!("{e:#}"),
                    };
                }
            }
        }
    }

    /// One attempt of [`Trainer::regroup_now`].
    fn regroup_once(
        &mut self,
        regroup: &mut dyn Regroup,
        change: Change,
        recovery: &mut Option<Recovery>,
        saves: &mut Saves,
        save: Option<&Path>,
        observer: &mut dyn RunObserver<B>,
    ) -> Result<()> {
        // A change during the recovery from another counts from the first.
        let since = recovery.as_ref().map_or_else(Instant::now, |r| r.since);
        let before = recovery.take().map(|r| r.change);
        if let MembershipEvent::Joins(member) = change.event {
            // Rank 0 tells the waiting member where it will stand, before the old ring (and its connection)
            // is dropped.
            let epoch = self.membership.epoch + 1;
            let mut members = self.membership.members.clone();
            members.push(member);
            self.comm.run(move |c| c.admit_join(member, epoch, &members))?;
        }
        self.release_collective()?;
        let regrouped = regroup
            .regroup(&self.membership, change.event, self.step)
            .with_context(|| format!("after {}", change.why))?;
        let (epoch, members) = (regrouped.membership.epoch, regrouped.membership.members.clone());
        tracing::warn!(
            "rank {}: lost {:?}, joined {:?} ({}); continuing as rank {} of {} (epoch {epoch})",
            self.rank,
            &regrouped.lost,
            &regrouped.joined,
            change.why,
            regrouped.comm.rank(),
            members.len()
        );
        let resumed = self.reform(regrouped.comm, regrouped.membership)?;
        let (mut lost, mut joined) = before.map(|c| (c.lost, c.joined)).unwrap_or_default();
        lost.extend(regrouped.lost);
        joined.extend(regrouped.joined);
        let change = MembershipChange {
            epoch,
            lost,
            joined,
            members,
            resumed_from_step: resumed,
            recovery_ms: 0.0,
        };
        // A save due at the step the group continues from, which a loss interrupted.
        let every = self.opts.save_every;
        if let Some(dir) = save {
            let due = every > 0 && resumed > 0 && resumed % every == 0 && resumed < self.opts.steps;
            if due && saves.last != Some(resumed) {
                saves.save(self, dir)?;
                observer.saved(self.step, dir);
            }
        }
        *recovery = Some(Recovery { change, since });
        Ok(())
    }

    /// The member the ranks take in after this step, if any: the largest of each rank's planned joiner and
    /// the join request its collective holds (only rank 0's can), by an all-reduce of one scalar. A member
    /// that is already part of the group is not taken in.
    fn agree_on_joiner(&mut self, planned: Option<MemberId>) -> Result<Option<MemberId>> {
        let mine = planned.map_or(0.0, |m| f64::from(m) + 1.0);
        let agreed = self.comm.run(move |c| {
            let waiting = c.pending_join().map_or(0.0, |m| f64::from(m) + 1.0);
            let mut v = [mine.max(waiting)];
            c.all_reduce_scalars_max(&mut v)?;
            Ok(v[0])
        })?;
        let joiner = (agreed > 0.0).then(|| agreed as MemberId - 1);
        match joiner {
            Some(m) if self.membership.rank_of(m).is_some() => {
                // Someone claiming a place that is taken: turned away, and the job goes on as it was.
                let reason = format!(
                    "member {m} is already part of the running job (epoch {}, members {:?})",
                    self.membership.epoch, self.membership.members
                );
                self.comm.run(move |c| c.refuse_join(m, &reason))?;
                Ok(None)
            }
            other => Ok(other),
        }
    }

    /// One step and what follows it: the record of a re-formed group's first step, the evaluation when
    /// due, the observer, an injected `flip`, and the save when due.
    fn step_and_after(
        &mut self,
        observer: &mut dyn RunObserver<B>,
        saves: &mut Saves,
        save: Option<&Path>,
        recovery: &mut Option<Recovery>,
    ) -> Result<StepMetrics> {
        let mut m = self.train_step()?;
        if let Some(r) = recovery.take() {
            let change = MembershipChange {
                recovery_ms: r.since.elapsed().as_secs_f64() * 1e3,
                ..r.change
            };
            tracing::info!(
                "rank {}: step {}: the group of epoch {} ({} ranks) completed its first step, {:.0} ms after the loss",
                self.rank,
                m.step,
                change.epoch,
                change.members.len(),
                change.recovery_ms
            );
            m.membership = Some(change);
        }
        let at_end = self.step == self.opts.steps;
        if self.eval_due(at_end) {
            m.val_loss = self.evaluate()?;
        }
        observer.step(self, &m)?;
        if let Some((target, element)) = self.faults.flip_after(self.rank, m.step) {
            self.apply_flip(target, element).context("fault flip")?;
            let fault = Fault::Flip {
                rank: self.rank,
                step: m.step,
                target,
                element,
            };
            observer.state_corrupted(self, &fault)?;
        }
        let every = self.opts.save_every;
        if let (Some(dir), false) = (save, at_end) {
            if every > 0 && self.step % every == 0 {
                saves.save(self, dir)?;
                observer.saved(self.step, dir);
            }
        }
        Ok(m)
    }

    /// Whether the step just finished is evaluated: every `eval_every` steps and the last one, unless the
    /// run evaluates nothing (`eval_batches` 0).
    fn eval_due(&self, at_end: bool) -> bool {
        let every = self.opts.eval_every;
        self.opts.eval_batches > 0 && ((every > 0 && self.step % every == 0) || at_end)
    }
}
