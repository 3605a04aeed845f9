//! Today's synchronisation ([`GradientSync`]), bucket by bucket: each gradient bucket is read back as soon as backward has finished
//! it and handed to the communication thread, which all-reduces it (`replicated`) or reduce-scatters it
//! (`sharded`) while backward goes on; after backward the trainer waits only for what is still in flight.
//!
//! The buckets are handed over in plan order on every rank, whatever the timing, so the collectives line
//! up; each bucket's elements are summed in the ring's fixed order, so the result does not depend on
//! whether communication overlapped backward (`--overlap on|off` give the same bits).

use super::buckets::BucketPlan;
use super::comm_ledger::{CommLedger, CommTime};
use super::sync::{AgreedStep, GradientSync, LocalStep};
use super::UpdateMode;
use crate::backend::cpu::ops::sum_squares as host_sum_squares;
use crate::backend::{Backend, Download, View};
use crate::collective::comm_thread::{CommThread, Pending};
use crate::collective::Owner;
use crate::data::BatchPlan;
use anyhow::Result;
use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

/// When a step's gradient collectives started, against the end of its backward (for tests and tracing).
#[derive(Clone, Debug, Default)]
pub struct SyncTrace {
    /// When the last micro-batch's backward returned.
    pub backward_ended: Option<Instant>,
    /// When each bucket's collective started on the communication thread, in plan order.
    pub bucket_started: Vec<Instant>,
}

/// How the ranks' gradients combine into the one the update uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Equal shares: each rank's gradient is the mean over its own tokens, and the ring averages them (one
    /// division of the sum on the chunk's owner).
    MeanOfEqualShares,
    /// Uneven shares: each rank scales its tokens' gradient by 1 / (the global batch's tokens) and the ring
    /// sums, so the result is the mean over the global batch whatever the split; the loss is weighed by
    /// tokens.
    SumOfShares { global_tokens: usize },
}

impl Reduction {
    /// The reduction a batch plan needs at sequence length `seq_len`: the averaging ring for equal whole
    /// micro-batches (the bits of runs before uneven shares), else the sum.
    pub fn of(plan: &BatchPlan, seq_len: usize) -> Self {
        match plan.equal {
            Some(_) => Reduction::MeanOfEqualShares,
            None => Reduction::SumOfShares {
                global_tokens: plan.global * seq_len,
            },
        }
    }
}

/// The bucketed per-step gradient sync of one rank: today's synchronisation ([`GradientSync`]).
pub struct BucketedSync {
    plan: BucketPlan,
    reduction: Reduction,
    update: UpdateMode,
    overlap: bool,
    world: usize,
    rank: usize,
    /// The collective's ownership map: which part of each bucket a sharded rank keeps.
    owner: Owner,
    /// Sharded with buddy mirrors (an elastic run over several ranks): the left neighbour's ownership map,
    /// whose reduced chunk of each bucket this rank also receives, for the mirror of its optimizer chunk.
    left: Option<Owner>,
    /// Whether buddy mirrors are asked for; `left` follows the group's size.
    mirrors: bool,
    /// The 0-based index of the step under way ([`GradientSync::begin_step`]).
    step: u64,
    /// Set once this step's reduced gradient (the owned chunks, and the left neighbour's with mirrors) is on
    /// the device: an update can still run from it after the agreement on the scalars failed.
    reduced: bool,
    /// Index in `plan.buckets` of the next bucket to read back.
    next: usize,
    /// Read-backs begun and not yet handed to the communication thread, in plan order: (bucket, read).
    reading: VecDeque<(usize, Download)>,
    /// Collectives handed to the communication thread and not yet waited for: (bucket, handle).
    in_flight: Vec<(usize, Pending<Vec<f32>>)>,
    /// Sharded: parameter all-gathers started after the last update and not yet put on the device, in
    /// forward order (ascending flat ranges): (bucket range, handle).
    gathering: VecDeque<(Range<usize>, Pending<Vec<f32>>)>,
    /// The collectives waited for in this step, and the waits (see [`CommLedger`]).
    ledger: CommLedger,
    /// Host buffers for reuse, so a step does not allocate a gradient's worth of memory.
    spare: Vec<Vec<f32>>,
    trace: SyncTrace,
}

impl BucketedSync {
    /// The sync over `plan`'s buckets of the rank whose collective has the ownership map `owner` (see
    /// [`Collective::owner`](crate::collective::Collective::owner)); `overlap` starts each bucket's collective
    /// while backward goes on.
    pub fn new(plan: BucketPlan, update: UpdateMode, overlap: bool, owner: Owner) -> Self {
        BucketedSync {
            plan,
            reduction: Reduction::MeanOfEqualShares,
            update,
            overlap,
            world: owner.world(),
            rank: owner.rank(),
            owner,
            left: None,
            mirrors: false,
            step: 0,
            reduced: false,
            next: 0,
            reading: VecDeque::new(),
            in_flight: Vec::new(),
            gathering: VecDeque::new(),
            ledger: CommLedger::default(),
            spare: Vec::new(),
            trace: SyncTrace::default(),
        }
    }

    /// The sync with `reduction` instead of the averaging ring of equal shares.
    pub fn reducing(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// The sync with buddy mirrors when `on` (an elastic sharded run): each rank also receives its left
    /// neighbour's reduced chunk of every bucket, in the same collective as its reduce-scatter.
    pub fn with_buddy_mirrors(mut self, on: bool) -> Self {
        self.mirrors = on;
        self.left = self.mirrored_neighbour(&self.owner);
        self
    }

    /// The ownership map whose chunks this rank mirrors under `owner`: its left neighbour's, when mirrors
    /// are asked for, the update is sharded and the group has several ranks.
    fn mirrored_neighbour(&self, owner: &Owner) -> Option<Owner> {
        crate::trainer::buddy::left_of(owner).filter(|_| self.mirrors && self.update == UpdateMode::Sharded)
    }

    /// Forgets the last step (a step that failed half way leaves nothing behind): read-backs still in
    /// flight are finished and dropped, so the backend releases what they hold (its errors were the failed
    /// step's, already reported).
    fn forget_step<B: Backend>(&mut self, be: &mut B) {
        self.next = 0;
        self.reduced = false;
        for (_, read) in self.reading.drain(..) {
            let _ = be.finish_download(read);
        }
        self.in_flight.clear();
        self.trace = SyncTrace::default();
    }

    /// Backward has finished the gradient elements `from..`: reads back every bucket now complete, and
    /// hands every read that has arrived to the communication thread.
    fn finished<B: Backend>(&mut self, be: &mut B, comm: &CommThread, grads: View, from: usize) -> Result<()> {
        while let Some(bucket) = self.plan.buckets.get(self.next).filter(|b| b.start >= from).cloned() {
            let host = self.spare.pop().unwrap_or_default();
            let read = be.begin_download(grads.sub(bucket.start, bucket.len()), host)?;
            self.reading.push_back((self.next, read));
            self.next += 1;
        }
        self.hand_over(be, comm, false)
    }

    /// Starts the collective of each read that has arrived, in plan order; with `wait`, of every read.
    fn hand_over<B: Backend>(&mut self, be: &mut B, comm: &CommThread, wait: bool) -> Result<()> {
        while let Some((_, read)) = self.reading.front() {
            if !wait && !be.download_ready(read)? {
                break;
            }
            let (bucket, read) = self.reading.pop_front().expect("front exists");
            let host = be.finish_download(read)?;
            let sum = matches!(self.reduction, Reduction::SumOfShares { .. });
            let pending = match (self.update, sum) {
                (UpdateMode::Sharded, sum) if self.left.is_some() => comm.reduce_scatter_and_shift(host, sum),
                (UpdateMode::Replicated, false) => comm.all_reduce_mean(host),
                (UpdateMode::Sharded, false) => comm.reduce_scatter_mean(host),
                (UpdateMode::Replicated, true) => comm.all_reduce_sum(host),
                (UpdateMode::Sharded, true) => comm.reduce_scatter_sum(host),
            };
            self.in_flight.push((bucket, pending));
        }
        Ok(())
    }

    /// After backward: starts what is left, waits for every bucket, and puts the mean gradient back on the
    /// device (all of it when replicated, the owned chunk of each bucket when sharded). Sharded, returns the
    /// sum of squares of the owned, reduced elements (this rank's share of the norm).
    fn finish<B: Backend>(&mut self, be: &mut B, comm: &CommThread, grads: View) -> Result<Option<f64>> {
        self.finished(be, comm, grads, 0)?;
        self.hand_over(be, comm, true)?;
        let mut owned_sq = 0.0;
        for (bucket, pending) in std::mem::take(&mut self.in_flight) {
            let (host, times) = self.ledger.wait(pending)?;
            self.trace.bucket_started.push(times.started);
            let range = self.plan.buckets[bucket].clone();
            match self.update {
                UpdateMode::Replicated => be.upload(grads.sub(range.start, range.len()), &host)?,
                UpdateMode::Sharded => {
                    let local = self.plan.owned_within(bucket, &self.owner);
                    be.upload(grads.sub(range.start + local.start, local.len()), &host[local.clone()])?;
                    owned_sq += host_sum_squares(&host[local]);
                    if let Some(left) = &self.left {
                        let mirrored = self.plan.owned_within(bucket, left);
                        be.upload(grads.sub(range.start + mirrored.start, mirrored.len()), &host[mirrored])?;
                    }
                }
            }
            self.spare.push(host);
        }
        self.reduced = true;
        Ok((self.update == UpdateMode::Sharded).then_some(owned_sq))
    }

    /// Sharded, after the update: every rank contributes its updated chunk of each bucket's parameters and
    /// will receive the others'. The gathers start in forward order (the embeddings' bucket first) and are
    /// not waited for here: [`BucketedSync::gathered_upto`] puts each bucket on the device when the next
    /// forward reaches it (or all of them, before anything else reads the parameters).
    fn start_gather<B: Backend>(&mut self, be: &mut B, comm: &CommThread, params: View) -> Result<()> {
        for bucket in (0..self.plan.buckets.len()).rev() {
            let range = self.plan.buckets[bucket].clone();
            let local = self.plan.owned_within(bucket, &self.owner);
            let mut host = self.spare.pop().unwrap_or_default();
            host.resize(range.len(), 0.0);
            be.download(params.sub(range.start + local.start, local.len()), &mut host[local])?;
            self.gathering.push_back((range, comm.all_gather(host)));
        }
        Ok(())
    }

    /// Waits for the gathers of every bucket that starts before `upto` and uploads them: the parameters
    /// `..upto` are then current on the device.
    fn gathered_upto<B: Backend>(&mut self, be: &mut B, params: View, upto: usize) -> Result<()> {
        while self.gathering.front().is_some_and(|(range, _)| range.start < upto) {
            let (range, pending) = self.gathering.pop_front().expect("front exists");
            let (host, _) = self.ledger.wait(pending)?;
            be.upload(params.sub(range.start, range.len()), &host)?;
            self.spare.push(host);
        }
        Ok(())
    }

    /// The loss and the squared gradient norm over the ranks. Sharded ranks contribute the squares of their
    /// chunks; replicated ranks all hold the same full gradient, so rank 0's square alone is summed.
    fn agree<B: Backend>(
        &mut self,
        be: &mut B,
        comm: &CommThread,
        grads: View,
        local: LocalStep,
        owned_sq: Option<f64>,
    ) -> Result<AgreedStep> {
        let local_loss = local.loss;
        let local_sq = match owned_sq {
            Some(sq) => sq,
            None => be.sum_squares(grads)?,
        };
        if self.world == 1 {
            return Ok(AgreedStep {
                loss: local_loss,
                grad_sq: local_sq,
            });
        }
        let sq = match self.update {
            UpdateMode::Sharded => local_sq,
            UpdateMode::Replicated if self.rank == 0 => local_sq,
            UpdateMode::Replicated => 0.0,
        };
        // Equal shares average the ranks' mean losses; uneven ones sum each rank's losses over its tokens.
        let loss_part = match self.reduction {
            Reduction::MeanOfEqualShares => local_loss,
            Reduction::SumOfShares { .. } => local_loss * local.tokens as f64,
        };
        let pending = comm.submit(move |c| {
            let mut vals = [loss_part, sq];
            c.all_reduce_scalars(&mut vals).map(|()| vals)
        });
        let (vals, _) = self.ledger.wait(pending)?;
        let loss = match self.reduction {
            Reduction::MeanOfEqualShares => vals[0] / self.world as f64,
            Reduction::SumOfShares { global_tokens } => vals[0] / global_tokens as f64,
        };
        Ok(AgreedStep { loss, grad_sq: vals[1] })
    }
}

impl<B: Backend> GradientSync<B> for BucketedSync {
    /// Equal shares, which the ring averages: the mean over this rank's tokens. Uneven shares, which the ring
    /// sums: the mean over the global batch's tokens.
    fn loss_scale(&self, local_tokens: usize) -> f32 {
        match self.reduction {
            Reduction::MeanOfEqualShares => 1.0 / local_tokens as f32,
            Reduction::SumOfShares { global_tokens } => 1.0 / global_tokens as f32,
        }
    }

    fn begin_step(&mut self, be: &mut B, step: u64) {
        self.forget_step(be);
        self.step = step;
    }

    fn await_params(&mut self, be: &mut B, params: View, upto: usize) -> Result<()> {
        self.gathered_upto(be, params, upto)
    }

    fn overlaps_backward(&self) -> bool {
        self.world > 1 && self.overlap
    }

    /// The buckets travel while the rank computes: the transport may batch its reads meanwhile.
    fn backward_starting(&mut self, comm: &CommThread) {
        comm.set_compute_busy(true);
    }

    fn gradients_final(&mut self, be: &mut B, comm: &CommThread, grads: View, from: usize) -> Result<()> {
        self.finished(be, comm, grads, from)
    }

    fn synchronise(&mut self, be: &mut B, comm: &CommThread, grads: View, local: LocalStep) -> Result<AgreedStep> {
        comm.set_compute_busy(false);
        self.trace.backward_ended = Some(Instant::now());
        let owned_sq = match self.world {
            1 => None,
            _ => self.finish(be, comm, grads)?,
        };
        self.agree(be, comm, grads, local, owned_sq)
    }

    /// Sharded over several ranks: the gathers need every rank's update, which needs the global norm, so they
    /// cannot overlap this step's backward; they overlap the next step's forward instead (as FSDP
    /// prefetches), or with `--overlap off` complete here, exposed.
    fn after_update(&mut self, be: &mut B, comm: &CommThread, params: View) -> Result<()> {
        if self.update == UpdateMode::Sharded && self.world > 1 {
            self.start_gather(be, comm, params)?;
            if !self.overlap {
                self.gathered_upto(be, params, usize::MAX)?;
            }
        }
        Ok(())
    }

    fn settle_params(&mut self, be: &mut B, params: View) -> Result<()> {
        self.gathered_upto(be, params, usize::MAX)
    }

    fn take_comm_time(&mut self) -> CommTime {
        self.ledger.take()
    }

    fn clear_comm_time(&mut self) {
        self.ledger.clear();
    }

    /// Parameter gathers still in flight belonged to the old group and are dropped: a caller settles them
    /// first, or (after a loss, when they cannot finish) rebuilds the parameters they carried.
    fn membership_changed(&mut self, be: &mut B, plan: &BucketPlan, owner: &Owner, reduction: Reduction) -> Result<()> {
        self.forget_step(be);
        self.gathering.clear();
        self.plan = plan.clone();
        (self.world, self.rank) = (owner.world(), owner.rank());
        self.owner = owner.clone();
        self.left = self.mirrored_neighbour(owner);
        self.reduction = reduction;
        Ok(())
    }

    fn reduced_step(&self) -> Option<u64> {
        self.reduced.then_some(self.step)
    }

    fn trace(&self) -> Option<&SyncTrace> {
        Some(&self.trace)
    }
}
