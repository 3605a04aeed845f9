//! `--sync outer`: periodic outer synchronisation (DiLoCo, arXiv 2311.08105).
//!
//! Each rank trains alone on its share of every global batch, with its own inner AdamW (full moments on
//! every rank: inner steps do not communicate), for `--outer-every` H inner steps. Then, at the end of every
//! H-th step, the ranks average the change of the parameters since the last outer step (the
//! pseudo-gradient Δ = θ_anchor − θ_local) by a reduce-scatter (`--update sharded`: each rank applies the
//! outer optimizer, SGD with Nesterov momentum as torch's `SGD(nesterov=True)` computes it, to its chunk,
//! and an all-gather copies the chunks' bits to every rank) or an all-reduce (`replicated`: every rank
//! applies it to everything). Both give the same bits: the ring's mean is the same, and the update is
//! element-wise on the host. So every rank ends each outer step with identical parameters, which become
//! the next anchor.
//!
//! What a step reports: an inner step's `loss` is this rank's own (the ranks do not talk between outer
//! steps, and a per-step exchange would cost a round trip on the slow links this mode is for); the outer
//! step's record ([`OuterRound`]) carries the mean over ranks and the round's inner steps, agreed with the
//! outer step's collectives, and the norm of the averaged Δ.
//!
//! The whole outer step (reduction, outer optimizer, gather, the round's scalars) runs as one job on the
//! communication thread. By default the step waits for it, at the end of the round: exposed.
//!
//! `--outer-overlap on` runs it while the next round trains and applies it one round late (the delayed
//! outer gradient of the local-SGD literature), keeping each rank's own progress: at the end of round k a
//! rank takes Δ_k against the parameters its round k started from, waits for round k−1's outer step (run
//! during round k) and makes its result the new shared parameters A, starts round k+1 from A − Δ_k (the
//! shared parameters plus its own progress of round k, which the outer step now in flight will replace by
//! the average), and starts round k's outer step from A on the communication thread. Every round's
//! averaged progress enters A once, and nothing depends on timing; the price is that Δ_k is applied one
//! outer step late. So the shared parameters (the anchor, and the outer step's result) are identical on
//! every rank at every outer step, while each rank's working parameters are its own from the first outer
//! step on (like its inner moments); evaluation, the replica check and the model files use the shared
//! ones ([`GradientSync::shared_params`]). At the run's last step its outer step is waited for and put on
//! the device, so the final model holds every round and is the same on every rank.
//!
//! State: the anchor `[P]` on every rank (host memory; the same bits everywhere) and the outer momentum of
//! this rank's chunk `[≈P/N]`. A checkpoint carries both, full, as `sync.outer_anchor` and
//! `sync.outer_momentum`; with `--outer-overlap on`, after waiting for the outer step in flight, also its
//! parameters (`sync.outer_next`) and round record (`sync.outer_next_round`), the momentum then being the
//! one after it, and each rank's own round start (`ROUND_START`, which the trainer stores per rank).

use super::checkpointing::{u64_as_f32_pair, u64_from_f32_pair};
use super::comm_ledger::{CommLedger, CommTime};
use super::sync::{AgreedStep, GradientSync, LocalStep, SyncState};
use super::{grad_sync::Reduction, BucketPlan, OuterOptions, UpdateMode};
use crate::backend::{Backend, View};
use crate::collective::comm_thread::{CommThread, Pending};
use crate::collective::{Collective, CollectiveError, Owner};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::Arc;

/// What an outer step agreed on, for its step's metrics.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OuterRound {
    /// The mean over ranks of each rank's mean inner loss since the last outer step.
    pub loss: f64,
    /// The L2 norm of the averaged pseudo-gradient (the change of the parameters the outer step applied
    /// its optimizer to).
    pub delta_norm: f64,
    /// Inner steps in the round.
    pub inner_steps: u64,
}

/// The outer sync of one rank.
pub struct OuterSync {
    outer: OuterOptions,
    /// Sharded: each rank keeps the outer momentum of its chunk and the new parameters are all-gathered;
    /// replicated: Δ is all-reduced and every rank runs the outer step on everything.
    update: UpdateMode,
    world: usize,
    owner: Owner,
    /// The 0-based index of the step under way.
    step: u64,
    /// The run's last step (exclusive): with `--outer-overlap on` the last outer step is waited for and its
    /// parameters put on the device, so that the run's final model holds every round.
    steps: u64,
    /// `[P]`: the parameters the round under way started from (the run's start before the first outer
    /// step), the same on every rank. Empty until the first forward reads the parameters. Shared with the
    /// outer step in flight, which applies its Δ to them.
    anchor: Arc<Vec<f32>>,
    /// `[owned elements]`: the outer Nesterov momentum of this rank's part of the flat parameters (empty
    /// while an outer step that updates it is in flight).
    momentum: Vec<f32>,
    /// `--outer-overlap on`: `[P]`, this rank's parameters at the start of the round under way (its own:
    /// the shared parameters plus its progress of the round before). Empty until the first forward.
    round_start: Vec<f32>,
    /// Whether the device holds the shared parameters (the run's start, after an outer step without
    /// overlap, and at the end of an overlapped run), rather than this rank's own.
    device_shared: bool,
    /// Inner losses summed since the last outer step, and how many.
    round_loss: f64,
    round_steps: u64,
    /// The last outer step's record, until the step's metrics take it.
    finished_round: Option<OuterRound>,
    /// `--outer-overlap on`: the outer step running on the communication thread during this round.
    in_flight: Option<Pending<OuterResult>>,
    /// `--outer-overlap on`: an outer step finished but not yet applied (waited for by a checkpoint, or the
    /// run's last, or read from a checkpoint).
    ready: Option<OuterResult>,
    ledger: CommLedger,
    /// A checkpoint's state, waiting for the first forward (which sizes the anchor).
    restored: Option<SyncState>,
}

/// What one outer step computes.
pub(super) struct OuterResult {
    /// `[P]`: the new shared parameters.
    params: Vec<f32>,
    /// `[owned elements]`: this rank's part of the outer momentum after the step.
    momentum: Vec<f32>,
    round: OuterRound,
}

/// An outer step's inputs, moved to the communication thread, which runs all of it: the reduction of Δ,
/// the outer optimizer on this rank's part, the gather of the new parameters and the round's scalars.
struct OuterStep {
    /// `[P]`: Δ = anchor − θ_local, or θ_local itself when `averaging`.
    buf: Vec<f32>,
    /// `[P]`: the parameters Δ is applied to.
    anchor: Arc<Vec<f32>>,
    /// `[owned elements]`
    momentum: Vec<f32>,
    owned: Range<usize>,
    sharded: bool,
    /// `--outer-lr 1 --outer-momentum 0` without overlap: θ = the mean of the ranks' θ, computed as that
    /// mean (so one rank keeps its own bits).
    averaging: bool,
    outer: OuterOptions,
    /// Whether this rank adds its squared norm of Δ̄ to the sum (replicated ranks all compute the whole).
    counts_norm: bool,
    /// This rank's mean inner loss over the round, and the round's inner steps.
    round_loss: f64,
    inner_steps: u64,
    world: usize,
}

impl OuterStep {
    fn run(mut self, c: &mut dyn Collective) -> crate::collective::Result<OuterResult> {
        let reduced = match self.sharded {
            true => c.reduce_scatter_mean(&mut self.buf)?,
            false => {
                c.all_reduce_mean(&mut self.buf)?;
                0..self.buf.len()
            }
        };
        let owned = self.owned.clone();
        if reduced != owned {
            return Err(CollectiveError::Local(format!(
                "the reduction left this rank elements {reduced:?}, its part is {owned:?}"
            )));
        }
        let anchor = &self.anchor[owned.clone()];
        let delta_sq = match self.averaging {
            // Δ̄ = anchor − mean θ, kept as the momentum buffer torch's SGD would hold.
            true => {
                let mut sq = 0f64;
                for ((m, a), mean) in self.momentum.iter_mut().zip(anchor).zip(&self.buf[owned.clone()]) {
                    *m = *a - *mean;
                    sq += f64::from(*m) * f64::from(*m);
                }
                sq
            }
            false => outer_update(anchor, &mut self.buf[owned], &mut self.momentum, self.outer),
        };
        if self.sharded {
            c.all_gather(&mut self.buf)?;
        }
        let mut sums = [self.round_loss, if self.counts_norm { delta_sq } else { 0.0 }];
        c.all_reduce_scalars(&mut sums)?;
        Ok(OuterResult {
            params: self.buf,
            momentum: self.momentum,
            round: OuterRound {
                loss: sums[0] / self.world as f64,
                delta_norm: sums[1].sqrt(),
                inner_steps: self.inner_steps,
            },
        })
    }
}

impl OuterSync {
    /// The outer sync of the rank whose collective has the ownership map `owner`, in a run of `steps` steps.
    pub fn new(outer: OuterOptions, update: UpdateMode, owner: Owner, steps: u64) -> Self {
        OuterSync {
            outer,
            update,
            world: owner.world(),
            owner,
            step: 0,
            steps,
            anchor: Arc::default(),
            momentum: Vec::new(),
            round_start: Vec::new(),
            device_shared: true,
            round_loss: 0.0,
            round_steps: 0,
            finished_round: None,
            in_flight: None,
            ready: None,
            ledger: CommLedger::default(),
            restored: None,
        }
    }

    /// This rank's part of the `[P]` flat parameters: its chunk when sharded, all of them when replicated.
    fn owned(&self) -> Range<usize> {
        match self.update {
            UpdateMode::Sharded => self.owner.range(self.anchor.len()),
            UpdateMode::Replicated => 0..self.anchor.len(),
        }
    }

    /// Sizes the anchor from the parameters on the device (the run's start), or from a checkpoint's state.
    fn start<B: Backend>(&mut self, be: &mut B, params: View) -> Result<()> {
        if !self.anchor.is_empty() {
            return Ok(());
        }
        match self.restored.take() {
            Some(mut state) => {
                let anchor = state.remove(ANCHOR).context("the checkpoint has no outer anchor")?;
                let momentum = state.remove(MOMENTUM).context("the checkpoint has no outer momentum")?;
                let round = state.remove(ROUND).context("the checkpoint has no outer round")?;
                ensure!(
                    round.len() == 3,
                    "the checkpoint's outer round has {} values, not 3",
                    round.len()
                );
                let bits = u64_from_f32_pair([round[0], round[1]]);
                (self.round_loss, self.round_steps) = (f64::from_bits(bits), round[2] as u64);
                ensure!(
                    self.round_steps < self.outer.every,
                    "the checkpoint's outer round has {} inner steps, --outer-every is {}",
                    self.round_steps,
                    self.outer.every
                );
                ensure!(
                    anchor.len() == params.len && momentum.len() == params.len,
                    "the checkpoint's outer state has {} and {} elements, the model {}",
                    anchor.len(),
                    momentum.len(),
                    params.len
                );
                self.anchor = Arc::new(anchor);
                self.momentum = momentum[self.owned()].to_vec();
                self.ready = restore_next(&mut state, params.len, &self.momentum)?;
                let mid_round = self.round_steps > 0;
                self.device_shared = !mid_round;
                if self.outer.overlap {
                    self.round_start = match state.remove(ROUND_START) {
                        Some(start) => {
                            ensure!(
                                start.len() == params.len,
                                "the checkpoint's round start has {} elements, the model {}",
                                start.len(),
                                params.len
                            );
                            start
                        }
                        // Written without overlap: its rounds start at the anchor.
                        None => self.anchor.to_vec(),
                    };
                    if !mid_round {
                        // The model files hold the shared parameters; this rank goes on from its own.
                        be.upload(params, &self.round_start)?;
                        self.device_shared = bit_equal(&self.round_start, &self.anchor);
                    }
                }
            }
            None => {
                let mut anchor = vec![0.0; params.len];
                be.download(params, &mut anchor)?;
                if self.outer.overlap {
                    self.round_start = anchor.clone();
                }
                self.anchor = Arc::new(anchor);
                self.momentum = vec![0.0; self.owned().len()];
            }
        }
        Ok(())
    }

    /// This rank's parameters, from the device.
    fn download_params<B: Backend>(be: &mut B, params: View) -> Result<Vec<f32>> {
        let mut host = vec![0f32; params.len];
        be.download(params, &mut host)?;
        Ok(host)
    }

    /// The outer step of the round just ended, ready to run: `buf` (Δ, or this rank's parameters when
    /// `averaging`), the anchor it applies to, and the momentum it updates (taken: it comes back with the
    /// result).
    fn job(&mut self, buf: Vec<f32>, averaging: bool) -> OuterStep {
        let sharded = self.update == UpdateMode::Sharded;
        let step = OuterStep {
            buf,
            anchor: self.anchor.clone(),
            momentum: std::mem::take(&mut self.momentum),
            owned: self.owned(),
            sharded,
            averaging,
            outer: self.outer,
            counts_norm: sharded || self.owner.rank() == 0,
            round_loss: self.round_loss / self.round_steps.max(1) as f64,
            inner_steps: self.round_steps,
            world: self.world,
        };
        (self.round_loss, self.round_steps) = (0.0, 0);
        step
    }

    /// Makes an outer step's parameters the anchor, with its momentum and round record.
    fn adopt(&mut self, result: OuterResult) {
        self.anchor = Arc::new(result.params);
        self.momentum = result.momentum;
        self.finished_round = Some(result.round);
    }

    /// The outer step, at the end of its round: averages Δ over the ranks, applies the outer optimizer (to
    /// this rank's chunk when sharded, to everything when replicated), gathers the new parameters everywhere
    /// when sharded, and makes them the anchor and the device's parameters. With `--outer-lr 1
    /// --outer-momentum 0` the step is plain averaging, θ = mean of the ranks' θ, computed as that mean (so
    /// one rank keeps its own bits).
    fn outer_step<B: Backend>(&mut self, be: &mut B, comm: &CommThread, params: View) -> Result<()> {
        let averaging = self.outer.lr == 1.0 && self.outer.momentum == 0.0;
        let mut buf = Self::download_params(be, params)?;
        if !averaging {
            for (d, a) in buf.iter_mut().zip(self.anchor.iter()) {
                *d = *a - *d;
            }
        }
        let step = self.job(buf, averaging);
        let result = self.ledger.wait(comm.submit(move |c| step.run(c)))?.0;
        be.upload(params, &result.params)?;
        self.adopt(result);
        self.device_shared = true;
        Ok(())
    }

    /// `--outer-overlap on`: Δ of the round just ended is taken against the parameters this rank started
    /// it from; the previous outer step (run during this round) becomes the shared parameters A, the next
    /// round starts from A − Δ (this rank's own progress kept, until the outer step now starting replaces
    /// it by the average), and this round's outer step starts from A on the communication thread, to be
    /// applied at the end of the next round. The first outer step has nothing to apply: the rank goes on
    /// from its own parameters. At the run's last step the outer step is waited for and its parameters put
    /// on the device (the round start stays, so a resume continues the same run).
    fn overlapped_outer_step<B: Backend>(&mut self, be: &mut B, comm: &CommThread, params: View) -> Result<()> {
        let local = Self::download_params(be, params)?;
        let delta: Vec<f32> = self.round_start.iter().zip(&local).map(|(s, l)| *s - *l).collect();
        self.drain()?;
        self.round_start = match self.ready.take() {
            Some(previous) => {
                self.adopt(previous);
                let start: Vec<f32> = self.anchor.iter().zip(&delta).map(|(a, d)| *a - *d).collect();
                be.upload(params, &start)?;
                start
            }
            None => local,
        };
        let step = self.job(delta, false);
        let pending = comm.submit(move |c| step.run(c));
        if self.step + 1 >= self.steps {
            // The run's end: its final model holds every round, and its metrics the last round's record.
            let last = self.ledger.wait(pending)?.0;
            be.upload(params, &last.params)?;
            self.finished_round = Some(last.round);
            self.ready = Some(last);
            self.device_shared = true;
        } else {
            self.in_flight = Some(pending);
            self.device_shared = false;
        }
        Ok(())
    }

    /// Waits for the outer step in flight, keeping its result to apply later.
    fn drain(&mut self) -> Result<()> {
        if let Some(pending) = self.in_flight.take() {
            self.ready = Some(self.ledger.wait(pending)?.0);
        }
        Ok(())
    }
}

/// The finished outer step a checkpoint of `--outer-overlap on` carries, if any: its parameters and its
/// round record; its momentum is the checkpoint's (`momentum`, this rank's part).
fn restore_next(state: &mut SyncState, len: usize, momentum: &[f32]) -> Result<Option<OuterResult>> {
    let (Some(params), Some(round)) = (state.remove(NEXT), state.remove(NEXT_ROUND)) else {
        return Ok(None);
    };
    ensure!(
        params.len() == len && round.len() == 6,
        "the checkpoint's pending outer step has {} and {} values, the model {len} and 6",
        params.len(),
        round.len()
    );
    let f64_at = |i: usize| f64::from_bits(u64_from_f32_pair([round[i], round[i + 1]]));
    Ok(Some(OuterResult {
        params,
        momentum: momentum.to_vec(),
        round: OuterRound {
            loss: f64_at(0),
            delta_norm: f64_at(2),
            inner_steps: u64_from_f32_pair([round[4], round[5]]),
        },
    }))
}

/// The outer optimizer over one chunk: torch's `SGD(nesterov=True)` with the averaged Δ as its gradient
/// (`buf = mu * buf + g; g = g + mu * buf; p = p - lr * g`, in f32). `delta` holds Δ and receives the new
/// parameters; `anchor` holds the parameters it starts from. Returns the sum of squares of Δ.
fn outer_update(anchor: &[f32], delta: &mut [f32], momentum: &mut [f32], outer: OuterOptions) -> f64 {
    let (lr, mu) = (outer.lr as f32, outer.momentum as f32);
    let mut delta_sq = 0f64;
    for ((d, m), a) in delta.iter_mut().zip(momentum.iter_mut()).zip(anchor) {
        delta_sq += f64::from(*d) * f64::from(*d);
        *m = mu * *m + *d;
        let step = *d + mu * *m;
        *d = *a - lr * step;
    }
    delta_sq
}

/// The sync-state names of the anchor, the momentum, and the round under way (its inner loss sum as the
/// two halves of an f64's bits, and its step count).
pub(super) const ANCHOR: &str = "outer_anchor";
const MOMENTUM: &str = "outer_momentum";
pub(super) const ROUND: &str = "outer_round";
/// `--outer-overlap on`: the outer step finished and not yet applied: its parameters and its round record
/// (loss and Δ norm as f64 bit pairs, then the inner steps as a pair); `MOMENTUM` is then the momentum after
/// it.
const NEXT: &str = "outer_next";
const NEXT_ROUND: &str = "outer_next_round";
/// `--outer-overlap on`: this rank's own round start; the trainer stores it per rank
/// (`inner_round_start.rank<R>`) and gives each rank its own back.
pub(super) const ROUND_START: &str = "outer_round_start";

/// The newest shared parameters a checkpoint's outer state holds: the outer step still to apply, else the
/// anchor (what [`GradientSync::shared_params`] gives once the state is restored).
pub(super) fn newest_shared(state: &SyncState) -> Option<&[f32]> {
    state.get(NEXT).or_else(|| state.get(ANCHOR)).map(Vec::as_slice)
}

/// Whether two buffers hold the same bits.
fn bit_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

impl<B: Backend> GradientSync<B> for OuterSync {
    /// Each rank's gradient is the mean over its own tokens: nothing is reduced between outer steps.
    fn loss_scale(&self, local_tokens: usize) -> f32 {
        1.0 / local_tokens as f32
    }

    fn begin_step(&mut self, _be: &mut B, step: u64) {
        self.step = step;
    }

    fn await_params(&mut self, be: &mut B, params: View, _upto: usize) -> Result<()> {
        self.start(be, params)
    }

    fn overlaps_backward(&self) -> bool {
        false
    }

    fn gradients_final(&mut self, _be: &mut B, _comm: &CommThread, _grads: View, _from: usize) -> Result<()> {
        Ok(())
    }

    /// An inner step: this rank's own loss and gradient norm (the clipping is each rank's own, as a lone
    /// worker's would be).
    fn synchronise(&mut self, be: &mut B, _comm: &CommThread, grads: View, local: LocalStep) -> Result<AgreedStep> {
        self.round_loss += local.loss;
        self.round_steps += 1;
        self.device_shared = false;
        Ok(AgreedStep {
            loss: local.loss,
            grad_sq: be.sum_squares(grads)?,
        })
    }

    fn after_update(&mut self, _be: &mut B, _comm: &CommThread, _params: View) -> Result<()> {
        Ok(())
    }

    /// After every H-th step, updated or skipped (every rank must take part in the outer step).
    fn end_of_step(&mut self, be: &mut B, comm: &CommThread, params: View) -> Result<()> {
        if (self.step + 1) % self.outer.every == 0 {
            self.start(be, params)?;
            match self.outer.overlap {
                true => self.overlapped_outer_step(be, comm, params)?,
                false => self.outer_step(be, comm, params)?,
            }
        }
        Ok(())
    }

    fn settle_params(&mut self, _be: &mut B, _params: View) -> Result<()> {
        Ok(())
    }

    fn take_comm_time(&mut self) -> CommTime {
        self.ledger.take()
    }

    fn clear_comm_time(&mut self) {
        self.ledger.clear();
    }

    /// The anchor (the same on every rank) and the outer momentum, gathered from every chunk when sharded;
    /// with `--outer-overlap on`, the outer step not yet applied too (waited for: it is the same on every
    /// rank). Collective.
    fn checkpoint_state(&mut self, _be: &mut B, comm: &CommThread) -> Result<SyncState> {
        if self.anchor.is_empty() {
            // Saved before the first step: the state is the checkpoint's, or the start's (zero momentum).
            if let Some(state) = &self.restored {
                return Ok(state.clone());
            }
            bail!("the outer sync has no state before the run's first forward");
        }
        self.drain()?;
        let owned = match &self.ready {
            Some(next) => next.momentum.clone(),
            None => self.momentum.clone(),
        };
        let momentum = match self.update {
            UpdateMode::Replicated => owned,
            UpdateMode::Sharded => {
                let mut momentum = vec![0f32; self.anchor.len()];
                momentum[self.owned()].copy_from_slice(&owned);
                comm.run(move |c| c.all_gather(&mut momentum).map(|()| momentum))?
            }
        };
        let [lo, hi] = u64_as_f32_pair(self.round_loss.to_bits());
        let round = vec![lo, hi, self.round_steps as f32];
        let mut state = SyncState::from([
            (ANCHOR.to_string(), self.anchor.to_vec()),
            (MOMENTUM.to_string(), momentum),
            (ROUND.to_string(), round),
        ]);
        if self.outer.overlap {
            state.insert(ROUND_START.to_string(), self.round_start.clone());
        }
        if let Some(next) = &self.ready {
            let r = next.round;
            let record = [r.loss.to_bits(), r.delta_norm.to_bits(), r.inner_steps];
            state.insert(NEXT.to_string(), next.params.clone());
            state.insert(
                NEXT_ROUND.to_string(),
                record.into_iter().flat_map(u64_as_f32_pair).collect(),
            );
        }
        Ok(state)
    }

    /// Takes a checkpoint's outer state; refuses one of `--sync every-step`, which has none, and one with
    /// an outer step still to apply (`--outer-overlap on`) when this run applies its steps at once.
    fn restore_state(&mut self, _be: &mut B, state: SyncState) -> Result<()> {
        let expected = [ANCHOR, MOMENTUM, ROUND];
        let names: Vec<&str> = state.keys().map(|k| k.as_str()).collect();
        let pending = state.contains_key(NEXT) && state.contains_key(NEXT_ROUND);
        let extra = if pending { 2 } else { 0 } + usize::from(state.contains_key(ROUND_START));
        ensure!(
            expected.iter().all(|k| state.contains_key(*k)) && names.len() == expected.len() + extra,
            "the checkpoint holds the synchronisation state {names:?}, not --sync outer's {expected:?}: it was \
             written by a run of another --sync mode; resume it with that mode"
        );
        ensure!(
            !pending || self.outer.overlap,
            "the checkpoint holds an outer step still to be applied: it was written with --outer-overlap on; \
             resume it with --outer-overlap on"
        );
        self.restored = Some(state);
        self.anchor = Arc::default();
        (self.in_flight, self.ready) = (None, None);
        Ok(())
    }

    fn membership_changed(
        &mut self,
        _be: &mut B,
        _plan: &BucketPlan,
        owner: &Owner,
        _reduction: Reduction,
    ) -> Result<()> {
        ensure!(
            owner.world() == self.world && *owner == self.owner,
            "--sync outer does not re-form its group"
        );
        Ok(())
    }

    fn take_round(&mut self) -> Option<OuterRound> {
        self.finished_round.take()
    }

    /// Between outer steps, and with `--outer-overlap on` after them too, the device holds this rank's own
    /// parameters: the shared ones are the newest outer step's (waited for, or applied), else the anchor.
    fn shared_params(&self) -> Option<&[f32]> {
        if self.device_shared || self.anchor.is_empty() {
            return None;
        }
        Some(match &self.ready {
            Some(next) => &next.params,
            None => &self.anchor,
        })
    }

    /// The anchor, and the outer momentum when replicated (a sharded rank's chunk is its own); with
    /// `--outer-overlap on` the momentum travels with the outer step in flight and is not compared.
    fn replicated_state(&mut self) -> Vec<&mut [f32]> {
        let mut state = Vec::new();
        if !self.anchor.is_empty() {
            state.push(Arc::make_mut(&mut self.anchor).as_mut_slice());
        }
        if self.update == UpdateMode::Replicated && !self.momentum.is_empty() {
            state.push(self.momentum.as_mut_slice());
        }
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the replica check compares: the anchor, and the momentum only where every rank holds all of it.
    #[test]
    fn the_replicated_state_is_the_anchor_and_a_replicated_momentum() {
        let outer = OuterOptions {
            every: 2,
            lr: 0.7,
            momentum: 0.9,
            overlap: false,
        };
        let owner = Owner::flat(2, 1);
        for (update, parts) in [(UpdateMode::Replicated, 2), (UpdateMode::Sharded, 1)] {
            let mut sync = OuterSync::new(outer, update, owner.clone(), 4);
            assert!(GradientSync::<crate::backend::cpu::CpuBackend>::replicated_state(&mut sync).is_empty());
            sync.anchor = Arc::new(vec![1.0; 6]);
            sync.momentum = vec![0.5; sync.owned().len()];
            let state = GradientSync::<crate::backend::cpu::CpuBackend>::replicated_state(&mut sync);
            assert_eq!(state.len(), parts, "{update:?}");
            assert_eq!(state[0], &[1.0; 6][..]);
        }
    }

    /// torch's `SGD([p], lr, momentum, nesterov=True)` (torch/optim/sgd.py: `buf = momentum * buf + grad`,
    /// the first step's buffer being the gradient itself; `grad = grad + momentum * buf`; `p -= lr * grad`),
    /// transcribed step by step for three gradients, against `outer_update` applied three times with the
    /// anchor following the parameters.
    #[test]
    fn the_outer_update_is_torch_sgd_with_nesterov_momentum() {
        let outer = OuterOptions {
            every: 1,
            lr: 0.7,
            momentum: 0.9,
            overlap: false,
        };
        let (lr, mu) = (0.7f32, 0.9f32);
        let grads = [
            [0.25f32, -0.5, 0.1, 0.0],
            [-0.125, 0.3, 0.2, -1.0],
            [0.0625, 0.0, -0.3, 0.5],
        ];
        let mut p = [1.5f32, -0.75, 0.3125, 2.0];
        let mut buf: Option<[f32; 4]> = None;
        for g in grads {
            let b = match buf {
                None => g,
                Some(b) => std::array::from_fn(|i| mu * b[i] + g[i]),
            };
            buf = Some(b);
            for i in 0..4 {
                p[i] -= lr * (g[i] + mu * b[i]);
            }
        }
        let (mut anchor, mut momentum) = ([1.5f32, -0.75, 0.3125, 2.0], [0f32; 4]);
        let mut squares = 0.0;
        for g in grads {
            let mut delta = g;
            squares += outer_update(&anchor, &mut delta, &mut momentum, outer);
            anchor = delta;
        }
        assert_eq!(anchor.map(f32::to_bits), p.map(f32::to_bits));
        assert_eq!(momentum, buf.unwrap());
        let expected: f64 = grads.iter().flatten().map(|&g| f64::from(g) * f64::from(g)).sum();
        assert_eq!(squares, expected);
    }
}
