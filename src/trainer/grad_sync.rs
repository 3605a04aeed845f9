//! Stage 4 of a step, bucket by bucket: each gradient bucket is read back as soon as backward has finished
//! it and handed to the communication thread, which all-reduces it (`replicated`) or reduce-scatters it
//! (`sharded`) while backward goes on; after backward the trainer waits only for what is still in flight.
//!
//! The buckets are handed over in plan order on every rank, whatever the timing, so the collectives line
//! up; each bucket's elements are summed in the ring's fixed order, so the result does not depend on
//! whether communication overlapped backward (`--overlap on|off` give the same bits).

use super::buckets::BucketPlan;
use super::comm_ledger::CommLedger;
use super::UpdateMode;
use crate::backend::cpu::ops::sum_squares as host_sum_squares;
use crate::backend::{Backend, Download, View};
use crate::collective::comm_thread::{CommThread, Pending};
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

/// What the gradient sync of one step left.
pub struct SyncOutcome {
    /// Sharded: the sum of squares of the owned, reduced gradient elements (this rank's share of the norm).
    pub owned_sum_squares: Option<f64>,
}

/// The gradient sync of one rank.
pub struct GradSync {
    pub plan: BucketPlan,
    update: UpdateMode,
    world: usize,
    rank: usize,
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
    pub ledger: CommLedger,
    /// Host buffers for reuse, so a step does not allocate a gradient's worth of memory.
    spare: Vec<Vec<f32>>,
    pub trace: SyncTrace,
}

impl GradSync {
    pub fn new(plan: BucketPlan, update: UpdateMode, world: usize, rank: usize) -> Self {
        GradSync {
            plan,
            update,
            world,
            rank,
            next: 0,
            reading: VecDeque::new(),
            in_flight: Vec::new(),
            gathering: VecDeque::new(),
            ledger: CommLedger::default(),
            spare: Vec::new(),
            trace: SyncTrace::default(),
        }
    }

    /// Forgets the last step (a step that failed half way leaves nothing behind): read-backs still in
    /// flight are finished and dropped, so the backend releases what they hold (its errors were the failed
    /// step's, already reported).
    pub fn begin_step<B: Backend>(&mut self, be: &mut B) {
        self.next = 0;
        for (_, read) in self.reading.drain(..) {
            let _ = be.finish_download(read);
        }
        self.in_flight.clear();
        self.trace = SyncTrace::default();
    }

    /// Backward has finished the gradient elements `from..`: reads back every bucket now complete, and
    /// hands every read that has arrived to the communication thread.
    pub fn finished<B: Backend>(&mut self, be: &mut B, comm: &CommThread, grads: View, from: usize) -> Result<()> {
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
            let pending = match self.update {
                UpdateMode::Replicated => comm.all_reduce_mean(host),
                UpdateMode::Sharded => comm.reduce_scatter_mean(host),
            };
            self.in_flight.push((bucket, pending));
        }
        Ok(())
    }

    /// After backward: starts what is left, waits for every bucket, and puts the mean gradient back on the
    /// device (all of it when replicated, the owned chunk of each bucket when sharded).
    pub fn finish<B: Backend>(&mut self, be: &mut B, comm: &CommThread, grads: View) -> Result<SyncOutcome> {
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
                    let local = self.plan.owned_within(bucket, self.world, self.rank);
                    be.upload(grads.sub(range.start + local.start, local.len()), &host[local.clone()])?;
                    owned_sq += host_sum_squares(&host[local]);
                }
            }
            self.spare.push(host);
        }
        Ok(SyncOutcome {
            owned_sum_squares: (self.update == UpdateMode::Sharded).then_some(owned_sq),
        })
    }

    /// Sharded, after the update: every rank contributes its updated chunk of each bucket's parameters and
    /// will receive the others'. The gathers start in forward order (the embeddings' bucket first) and are
    /// not waited for here: [`GradSync::await_params`] puts each bucket on the device when the next forward
    /// reaches it (or [`GradSync::settle_params`] all of them, before anything else reads the parameters).
    pub fn start_gather<B: Backend>(&mut self, be: &mut B, comm: &CommThread, params: View) -> Result<()> {
        for bucket in (0..self.plan.buckets.len()).rev() {
            let range = self.plan.buckets[bucket].clone();
            let local = self.plan.owned_within(bucket, self.world, self.rank);
            let mut host = self.spare.pop().unwrap_or_default();
            host.resize(range.len(), 0.0);
            be.download(params.sub(range.start + local.start, local.len()), &mut host[local])?;
            self.gathering.push_back((range, comm.all_gather(host)));
        }
        Ok(())
    }

    /// Waits for the gathers of every bucket that starts before `upto` and uploads them: the parameters
    /// `..upto` are then current on the device.
    pub fn await_params<B: Backend>(&mut self, be: &mut B, params: View, upto: usize) -> Result<()> {
        while self.gathering.front().is_some_and(|(range, _)| range.start < upto) {
            let (range, pending) = self.gathering.pop_front().expect("front exists");
            let (host, _) = self.ledger.wait(pending)?;
            be.upload(params.sub(range.start, range.len()), &host)?;
            self.spare.push(host);
        }
        Ok(())
    }

    /// Puts every gathered bucket on the device.
    pub fn settle_params<B: Backend>(&mut self, be: &mut B, params: View) -> Result<()> {
        self.await_params(be, params, usize::MAX)
    }
}
