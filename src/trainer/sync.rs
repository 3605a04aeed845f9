//! The synchronisation seam of a step: how a rank's local gradient becomes the gradient every rank updates
//! with, and what the ranks agree on besides (the loss and the gradient norm).
//!
//! The step ([`super::Trainer::train_step`]) calls a [`GradientSync`] at fixed points and knows nothing of
//! how it communicates: today's per-step bucketed sync ([`super::grad_sync::BucketedSync`]) is one
//! implementation; a sync that does not communicate on some steps or that sums uneven shares plugs in at
//! the same points. Between steps the seam carries the sync's own state into and out of checkpoints
//! ([`GradientSync::checkpoint_state`]) and a re-formed group ([`GradientSync::membership_changed`]). The
//! sync owns the step's communication clock ([`CommTime`]), so the step's metrics need no timers of their
//! own.

use super::buckets::BucketPlan;
use super::comm_ledger::CommTime;
use super::grad_sync::{Reduction, SyncTrace};
use crate::backend::{Backend, View};
use crate::collective::comm_thread::CommThread;
use crate::collective::Owner;
use anyhow::{bail, Result};
use std::collections::BTreeMap;

/// A sync's own state, as named f32 tensors (a checkpoint stores each as `sync.<name>`).
pub type SyncState = BTreeMap<String, Vec<f32>>;

/// What this rank computed in a step, besides its gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalStep {
    /// The mean loss over this rank's share of the global batch.
    pub loss: f64,
    /// Tokens in this rank's share.
    pub tokens: usize,
}

/// What the ranks agreed on in a step: the same bits on every rank, since every decision of the update (skip,
/// clip) is taken from them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AgreedStep {
    /// The mean loss over the global batch (this rank's own loss when the step did not communicate).
    pub loss: f64,
    /// The squared L2 norm of the gradient the update uses.
    pub grad_sq: f64,
}

/// A rank's synchronisation of one step, called by the step in this order: [`begin_step`], then for each
/// micro-batch forward (which calls [`await_params`] before reading parameters) and backward (the last one
/// bracketed by [`backward_starting`] and reporting finished gradients through [`gradients_final`] when
/// [`overlaps_backward`]), then [`synchronise`], the update, and [`after_update`].
///
/// [`begin_step`]: GradientSync::begin_step
/// [`await_params`]: GradientSync::await_params
/// [`backward_starting`]: GradientSync::backward_starting
/// [`gradients_final`]: GradientSync::gradients_final
/// [`overlaps_backward`]: GradientSync::overlaps_backward
/// [`synchronise`]: GradientSync::synchronise
/// [`after_update`]: GradientSync::after_update
pub trait GradientSync<B: Backend>: Send {
    /// The factor on each token's loss gradient that makes the gradient after [`GradientSync::synchronise`]
    /// the gradient of the loss the ranks agree on. A ring that averages equal shares scales by
    /// `1 / local_tokens`; one that sums uneven shares would scale by `1 / global tokens`.
    fn loss_scale(&self, local_tokens: usize) -> f32;

    /// A step begins (0-based `step`); whatever a failed earlier step left is dropped.
    fn begin_step(&mut self, be: &mut B, step: u64);

    /// Forward is about to read the parameters `..upto`: they must be current on the device.
    fn await_params(&mut self, be: &mut B, params: View, upto: usize) -> Result<()>;

    /// Whether the last micro-batch's backward should report finished gradients while it runs.
    fn overlaps_backward(&self) -> bool;

    /// The last micro-batch's backward is about to run (with [`GradientSync::overlaps_backward`]).
    fn backward_starting(&mut self, _comm: &CommThread) {}

    /// The last micro-batch's backward has finished the gradient elements `from..`.
    fn gradients_final(&mut self, be: &mut B, comm: &CommThread, grads: View, from: usize) -> Result<()>;

    /// After backward: makes `grads` the gradient the update uses (for the elements this rank updates) and
    /// agrees with the other ranks on the loss and the gradient norm.
    fn synchronise(&mut self, be: &mut B, comm: &CommThread, grads: View, local: LocalStep) -> Result<AgreedStep>;

    /// After the update of `params` (not called for a skipped step).
    fn after_update(&mut self, be: &mut B, comm: &CommThread, params: View) -> Result<()>;

    /// After the step's update, or after the step was skipped: every rank calls it after every step (a
    /// periodic sync's outer step runs here, which every rank must join whether or not its own inner update
    /// ran).
    fn end_of_step(&mut self, _be: &mut B, _comm: &CommThread, _params: View) -> Result<()> {
        Ok(())
    }

    /// The sync's own state that every replica must hold bit for bit (a periodic sync's parameters at its
    /// last outer step, and its momentum where every rank keeps all of it), for the replica check to
    /// compare and a resync to copy. The default keeps none.
    fn replicated_state(&mut self) -> Vec<&mut [f32]> {
        Vec::new()
    }

    /// The parameters every replica holds alike, when the device holds this rank's own instead (a periodic
    /// sync between its outer steps, say): evaluation, the replica check and the model files use them.
    /// `None` (the default) when the device's parameters are the shared ones.
    fn shared_params(&self) -> Option<&[f32]> {
        None
    }

    /// What a periodic sync's outer step of this step agreed on, for the step's metrics.
    fn take_round(&mut self) -> Option<super::outer_sync::OuterRound> {
        None
    }

    /// Puts every parameter still in flight on the device, before anything reads them.
    fn settle_params(&mut self, be: &mut B, params: View) -> Result<()>;

    /// The communication the current step waited for; resets the clock.
    fn take_comm_time(&mut self) -> CommTime;

    /// Forgets waits recorded outside a step (a save or an evaluation settling the parameters).
    fn clear_comm_time(&mut self);

    /// The state a checkpoint must carry for a resumed run to continue with the same bits (a periodic sync's
    /// parameters at its last outer step and its momentum, say), full on every rank: a sync that shards its
    /// state gathers it here. Collective: every rank calls it when the run saves; rank 0's is written. The
    /// default keeps none.
    fn checkpoint_state(&mut self, _be: &mut B, _comm: &CommThread) -> Result<SyncState> {
        Ok(SyncState::new())
    }

    /// Takes back, before the first step of a resumed run, what [`GradientSync::checkpoint_state`] gave. The
    /// default keeps no state and refuses a checkpoint that holds some: resuming it under this sync would
    /// drop it silently.
    fn restore_state(&mut self, _be: &mut B, state: SyncState) -> Result<()> {
        if let Some(name) = state.keys().next() {
            bail!(
                "the checkpoint holds the synchronisation state {name:?} (of {} tensors), which this run's \
                 synchronisation does not keep: resume it with the synchronisation that wrote it",
                state.len()
            );
        }
        Ok(())
    }

    /// The group was re-formed between steps: `owner` is the new collective's ownership map (this rank's
    /// number, the world, the layout), and with `plan` says who owns which part of every gradient bucket.
    /// The sync rebuilds whatever it derived from them; the trainer has already re-cut the optimizer state
    /// and replaced the collective.
    /// `reduction` is how the new group reduces (a change of size can turn equal shares into uneven
    /// ones). A step that failed half way (the loss that re-formed the group) is forgotten first.
    fn membership_changed(&mut self, be: &mut B, plan: &BucketPlan, owner: &Owner, reduction: Reduction) -> Result<()>;

    /// The 0-based index of the step whose reduced gradient (everything [`GradientSync::synchronise`] puts on
    /// the device before agreeing on the scalars) is complete, so that a rank whose agreement failed can still
    /// run the update once it learns the agreed scalars (an elastic re-form's roll-forward). Cleared when a
    /// step begins; `None` for syncs that do not say.
    fn reduced_step(&self) -> Option<u64> {
        None
    }

    /// When the last step's collectives started against the end of its backward, for syncs that trace it.
    fn trace(&self) -> Option<&SyncTrace> {
        None
    }
}
