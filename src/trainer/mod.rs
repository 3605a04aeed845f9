//! The training loop: replicate, shard, local compute, synchronise, update (the five stages in ARCHITECTURE.md).
//!
//! Every rank runs the same `Trainer` over a [`Collective`]; with one rank the collective is never used.
//! - Replicate: at start the ranks compare parameter hashes; on a mismatch rank 0's parameters win.
//! - Shard: the global batch's windows are split by [`split_for_rank`].
//! - Local compute: forward/backward over this rank's micro-batches, gradients accumulated on the device.
//! - Synchronise ([`grad_sync`]): gradients travel in `--bucket-mb` buckets, each handed to the
//!   communication thread as soon as backward has finished it (`--overlap on`) or after backward (`off`);
//!   `replicated` all-reduces each bucket, `sharded` (ZeRO-1) reduce-scatters it so each rank holds the
//!   mean of its chunk of every bucket ([`buckets`]).
//! - Update: the gradient norm, the loss and the non-finite decision come from reduced values, so every rank
//!   decides alike; `replicated` runs AdamW on everything, `sharded` on the owned chunks and then
//!   all-gathers the parameters bucket by bucket, so replicas are bit-identical by construction.

use crate::backend::{Backend, View};
use crate::collective::comm_thread::CommThread;
use crate::collective::{diverged_ranks, Collective};
use crate::data::{eval_windows, fill_batch, split_for_rank, DataSplits, TokenStream, WindowSampler};
use crate::metrics::StepMetrics;
use crate::model::checkpoint::{self, TrainerState};
use crate::model::{init::init_params, Gpt2, ModelConfig, ParamLayout};
use crate::optim::adamw::clip_coefficient;
use crate::optim::AdamW;
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub mod buckets;
pub mod comm_ledger;
pub mod fault_injection;
pub mod grad_sync;
pub mod loss_spike;
mod memory_plan;
mod options;
mod shard_guard;

use buckets::BucketPlan;
use fault_injection::{write_if_final, NonFiniteFault, PendingInjection};
use grad_sync::{GradSync, SyncTrace};
use loss_spike::LossSpikeDetector;
use shard_guard::ShardGuard;

pub use memory_plan::{host_available, measured_peak, Available, MemoryPlan};

pub use options::{
    bucket_elems, default_batch_size, default_lr, OnDivergence, OnNonFinite, TrainOptions, UpdateMode,
    DEFAULT_BATCH_SIZE, DEFAULT_BUCKET_MB, DEFAULT_STEPS, SMALL_BATCH_SIZE,
};

/// Where the parameters of a new run come from.
pub enum ModelSource {
    /// A fresh GPT-2 init from `TrainOptions::seed`.
    Fresh(ModelConfig),
    /// `--init DIR`: a Hugging Face GPT-2 directory.
    Init(PathBuf),
    /// `--resume DIR`: parameters, optimizer state and data cursor of an earlier run.
    Resume(PathBuf),
}

pub struct Trainer<B: Backend> {
    pub be: B,
    /// The model. In a sharded run over several ranks the parameter all-gather of the last step may still
    /// be in flight between steps (it overlaps the next forward): call [`Trainer::settle_params`] before
    /// reading `model.params` directly. The trainer's own readers (hashes, save, eval) do.
    pub model: Gpt2,
    pub opt: AdamW,
    pub opts: TrainOptions,
    train: TokenStream,
    val: Option<TokenStream>,
    sampler: WindowSampler,
    /// Optimizer steps completed (including skipped ones): the next step's index.
    pub step: u64,
    /// Tokens consumed so far, over all ranks.
    pub tokens_seen: u64,
    world: usize,
    rank: usize,
    /// The ring, on its own thread; only used when `world > 1`.
    comm: CommThread,
    /// The bucketed gradient sync (and the sharded parameter gather).
    sync: GradSync,
    /// Host staging for one micro-batch: `[batch_size * seq_len]` each.
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// `--loss-spike`: the running average each step's loss is compared with.
    spikes: LossSpikeDetector,
    /// A test hook ([`fault_injection`]): the step at which one rank's gradient is made non-finite.
    fault: Option<NonFiniteFault>,
    /// Sharded over several ranks with `--verify-every`: the checksum of this rank's shard between its updates
    /// ([`shard_guard`]).
    guard: ShardGuard,
}

impl<B: Backend> Trainer<B> {
    /// A trainer over `comm` (use a one-rank collective for a single process).
    pub fn new(
        mut be: B,
        source: ModelSource,
        data: DataSplits,
        opts: TrainOptions,
        comm: Box<dyn Collective>,
    ) -> Result<Self> {
        let (config, params, resume) = match source {
            ModelSource::Fresh(cfg) => {
                cfg.validate()?;
                let layout = ParamLayout::new(&cfg);
                let params = init_params(&cfg, &layout, opts.seed);
                (cfg, params, None)
            }
            ModelSource::Init(dir) => {
                let (cfg, params) =
                    checkpoint::load_model(&dir).with_context(|| format!("--init {}", dir.display()))?;
                (cfg, params, None)
            }
            ModelSource::Resume(dir) => {
                let dir = checkpoint::resolve_checkpoint_dir(&dir)?;
                let (cfg, params) =
                    checkpoint::load_model(&dir).with_context(|| format!("--resume {}", dir.display()))?;
                let state = checkpoint::load_trainer_state(&dir, &ParamLayout::new(&cfg))
                    .with_context(|| format!("--resume {}: trainer state", dir.display()))?;
                (cfg, params, Some(state))
            }
        };
        ensure!(
            opts.seq_len >= 1 && opts.seq_len <= config.n_positions,
            "--seq-len {} must be between 1 and the model's n_positions ({})",
            opts.seq_len,
            config.n_positions
        );
        ensure!(
            opts.batch_size >= 1 && opts.grad_accum >= 1,
            "--batch-size and --grad-accum must be at least 1"
        );
        data.train.validate_vocab(config.vocab_size)?;
        if let Some(val) = &data.val {
            val.validate_vocab(config.vocab_size)?;
        }
        let (world, rank) = (comm.world(), comm.rank());
        let global = world * opts.batch_size * opts.grad_accum;
        let sampler = WindowSampler::for_tokens(data.train.len(), opts.seq_len, global, opts.shuffle, opts.seed)?;
        be.check_step_shape(opts.batch_size, opts.seq_len, config.n_embd, config.n_head)?;
        let model = Gpt2::new(&mut be, config, &params)?;
        model.zero_grads(&mut be);
        // ZeRO-1: a sharded rank keeps the moments of its own chunk only (the chunk its reduce-scatter
        // leaves it); checkpoints gather them into full tensors.
        let plan = BucketPlan::new(&model.layout, opts.bucket_elems);
        let mut opt = AdamW::for_ranges(&mut be, opts.adamw, plan.owned(opts.update, world, rank))?;
        let (mut step, mut tokens_seen) = (0, 0);
        if let Some(state) = resume {
            ensure!(
                state.config_hash == model.config.hash_hex(),
                "--resume: the trainer state belongs to another model shape"
            );
            ensure!(
                state.seed == opts.seed,
                "--resume: the checkpoint was trained with --seed {}, this run has --seed {}; pass --seed {} to continue the same data order",
                state.seed,
                opts.seed,
                state.seed
            );
            ensure!(
                state.data_cursor % global as u64 == 0,
                "--resume: the checkpoint stopped at window {}, which is not a whole number of global batches of {global}",
                state.data_cursor
            );
            be.upload(opt.m, &opt.cut(&state.m))?;
            be.upload(opt.v, &opt.cut(&state.v))?;
            step = state.data_cursor / global as u64;
            tokens_seen = state.tokens_seen;
            opt.step = match state.extra.get("optimizer_step") {
                Some(s) => s.parse().context("--resume: bad optimizer_step in trainer state")?,
                None => state.step,
            };
        }
        let n = opts.batch_size * opts.seq_len;
        // The shard checksum completes what --verify-every checks in sharded mode (see shard_guard).
        let guard_shard = opts.update == UpdateMode::Sharded && world > 1 && opts.verify_every > 0;
        let sync = GradSync::new(plan, opts.update, world, rank);
        let spikes = LossSpikeDetector::new(opts.loss_spike);
        let mut trainer = Trainer {
            be,
            model,
            opt,
            opts,
            train: data.train,
            val: data.val,
            sampler,
            step,
            tokens_seen,
            world,
            rank,
            comm: CommThread::spawn(comm).context("starting the communication thread")?,
            sync,
            inputs: vec![0; n],
            targets: vec![0; n],
            spikes,
            fault: None,
            guard: ShardGuard::new(guard_shard),
        };
        trainer.replicate()?;
        Ok(trainer)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Arms a fault ([`fault_injection`]): when it names this rank, one element of the local gradient is
    /// made non-finite at its step, before synchronisation.
    pub fn arm_fault(&mut self, fault: NonFiniteFault) {
        self.fault = Some(fault);
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Stage 1: every rank must start from the same parameters (and moments). Hashes are compared; on a
    /// mismatch rank 0's state is broadcast. Returns whether a broadcast happened.
    pub fn replicate(&mut self) -> Result<bool> {
        if self.world == 1 {
            return Ok(false);
        }
        let hash = self.state_hash(self.moments_are_replicated())?;
        let hashes = self.comm.run(move |c| c.gather_hashes(hash))?;
        if diverged_ranks(&hashes).is_empty() {
            return Ok(false);
        }
        self.broadcast_state()?;
        Ok(true)
    }

    /// Whether every rank holds the whole optimizer state (replicated update, or one rank), so that the
    /// moments are part of what replicas must agree on.
    fn moments_are_replicated(&self) -> bool {
        self.opt.owned_len() == self.model.layout.total
    }

    /// The views every replica must hold bit for bit: the parameters, plus the moments when replicated.
    fn replicated_views(&self) -> Vec<View> {
        match self.moments_are_replicated() {
            true => vec![self.model.params, self.opt.m, self.opt.v],
            false => vec![self.model.params],
        }
    }

    /// blake3 over the parameters (and, when asked, both moments): the replica fingerprint.
    fn state_hash(&mut self, with_moments: bool) -> Result<[u8; 32]> {
        self.settle_params()?;
        let mut hasher = blake3::Hasher::new();
        let views = if with_moments {
            vec![self.model.params, self.opt.m, self.opt.v]
        } else {
            vec![self.model.params]
        };
        for view in views {
            let mut host = vec![0f32; view.len];
            self.be.download(view, &mut host)?;
            hash_into(&mut hasher, &host);
        }
        Ok(*hasher.finalize().as_bytes())
    }

    /// Copies rank 0's replicated state (parameters, and moments when every rank holds them all) to every
    /// rank.
    fn broadcast_state(&mut self) -> Result<()> {
        self.settle_params()?;
        for view in self.replicated_views() {
            let mut host = vec![0f32; view.len];
            self.be.download(view, &mut host)?;
            let host = self.comm.run(move |c| c.broadcast(&mut host, 0).map(|()| host))?;
            self.be.upload(view, &host)?;
        }
        Ok(())
    }

    /// Tokens in one global batch.
    pub fn tokens_per_step(&self) -> u64 {
        (self.sampler.global_batch() * self.opts.seq_len) as u64
    }

    /// One optimizer step: the local micro-batches, synchronisation, then the update.
    pub fn train_step(&mut self) -> Result<StepMetrics> {
        let started = Instant::now();
        let (b, t, k) = (self.opts.batch_size, self.opts.seq_len, self.opts.grad_accum);
        // Shard: this rank's micro-batches of the global batch.
        let windows = self.sampler.windows_for_step(self.step);
        let micro = split_for_rank(&windows, self.rank, self.world, b, k)?;
        // Local compute: gradients accumulate over the micro-batches, weighted so that their sum is the
        // gradient of this rank's mean loss; the mean over ranks in the sync makes it the global batch's.
        self.model.zero_grads(&mut self.be);
        self.sync.begin_step(&mut self.be);
        // Only what this step waits for counts in its communication time.
        self.sync.ledger.clear();
        if self.world > 1 {
            let step = self.step;
            let _ = self.comm.submit(move |c| {
                c.set_step(step);
                Ok(())
            });
        }
        let dloss = 1.0 / (b * t * k) as f32;
        let mut loss_sum = 0.0;
        // Sharded: the last update's parameter gathers arrive while forward runs; what forward waits for
        // them is exposed communication (the ledger records it).
        // Fault injection: written once the last micro-batch's backward has finished its element.
        let mut inject = (self.fault)
            .filter(|f| f.fires(self.rank, self.step))
            .map(|f| PendingInjection::new(f, self.model.layout.total));
        for (i, windows) in micro.iter().enumerate() {
            fill_batch(&self.train, windows, t, &mut self.inputs, &mut self.targets)?;
            let (sync, params) = (&mut self.sync, self.model.params);
            loss_sum += self.model.forward_train(
                &mut self.be,
                &self.inputs,
                &self.targets,
                b,
                t,
                Some(dloss),
                &mut |be, upto| sync.await_params(be, params, upto),
            )?;
            // Only the last micro-batch's backward finishes gradients (DDP's no_sync before it).
            let overlap = self.world > 1 && self.opts.overlap && i + 1 == micro.len();
            if overlap {
                let (sync, comm, grads) = (&mut self.sync, &self.comm, self.model.grads);
                let inject = &mut inject;
                // The buckets travel while this backward computes; after it, the rank waits for them.
                comm.set_compute_busy(true);
                let backward = self.model.backward_reporting(&mut self.be, dloss, &mut |be, from| {
                    write_if_final(inject, be, grads, from)?;
                    sync.finished(be, comm, grads, from)
                });
                comm.set_compute_busy(false);
                backward?;
            } else {
                self.model.backward(&mut self.be, dloss)?;
            }
        }
        // Without overlap the local gradients are final here, before any of them is read back.
        write_if_final(&mut inject, &mut self.be, self.model.grads, 0)?;
        self.sync.trace.backward_ended = Some(Instant::now());
        // Synchronise: average gradients (and the loss) over ranks.
        let owned_sq = match self.world {
            1 => None,
            _ => {
                self.sync
                    .finish(&mut self.be, &self.comm, self.model.grads)?
                    .owned_sum_squares
            }
        };
        let local_loss = loss_sum / k as f64;
        let local_sq = match owned_sq {
            Some(sq) => sq,
            None => self.be.sum_squares(self.model.grads)?,
        };
        let (loss, grad_sq) = self.reduce_scalars(local_loss, local_sq)?;
        // Update: decisions come from reduced values, so every rank decides alike.
        let grad_norm = grad_sq.sqrt();
        let lr = self.opts.schedule.lr_at(self.step);
        let skipped = !grad_norm.is_finite() || !loss.is_finite();
        let loss_spike_reference = self.spikes.observe(loss);
        if skipped {
            if self.opts.on_nonfinite == OnNonFinite::Abort {
                bail!(
                    "step {}: non-finite loss ({loss}) or gradient norm ({grad_norm}); stopping (--on-nonfinite abort)",
                    self.step + 1
                );
            }
        } else {
            let coef = clip_coefficient(grad_norm, self.opts.grad_clip);
            let layout = &self.model.layout;
            let (params, grads) = (self.model.params, self.model.grads);
            self.guard
                .check(&mut self.be, params, &self.opt, self.rank, self.step + 1)?;
            self.opt.update(&mut self.be, layout, params, grads, lr, coef);
            self.guard.record(&mut self.be, params, &self.opt, self.step + 1)?;
            if !self.moments_are_replicated() {
                // The gather needs every rank's update, which needs the global norm, so it cannot overlap
                // this step's backward: it overlaps the next step's forward instead (as FSDP prefetches),
                // or with `--overlap off` completes here, exposed.
                self.sync.start_gather(&mut self.be, &self.comm, params)?;
                if !self.opts.overlap {
                    self.sync.settle_params(&mut self.be, params)?;
                }
            }
        }
        // The collectives waited for in this step: its buckets, the scalars, and the gathers (the last
        // step's, when they overlap this forward).
        let comm_time = self.sync.ledger.take();
        let mut param_hash = None;
        let verify = self.opts.verify_every;
        if verify > 0 && (self.step + 1) % verify == 0 {
            param_hash = Some(self.verify_replicas()?);
        }
        self.be.synchronize()?;
        self.step += 1;
        self.tokens_seen += self.tokens_per_step();
        let step_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(StepMetrics {
            step: self.step,
            loss,
            lr,
            grad_norm,
            tokens: self.tokens_seen,
            tokens_per_s: self.tokens_per_step() as f64 / (step_ms / 1e3),
            step_ms,
            // One rank communicates nothing; what the timers saw there is bookkeeping.
            comm_ms: if self.world > 1 {
                comm_time.busy.as_secs_f64() * 1e3
            } else {
                0.0
            },
            exposed_comm_ms: if self.world > 1 {
                comm_time.exposed.as_secs_f64() * 1e3
            } else {
                0.0
            },
            world_size: self.world,
            update: self.opts.update.as_str().to_string(),
            param_hash,
            val_loss: None,
            skipped,
            loss_spike_reference,
        })
    }

    /// Puts any parameter all-gather still in flight on the device (see [`Trainer::model`]).
    pub fn settle_params(&mut self) -> Result<()> {
        self.sync.settle_params(&mut self.be, self.model.params)
    }

    /// When the last step's bucket collectives started against the end of its backward.
    pub fn last_sync_trace(&self) -> &SyncTrace {
        &self.sync.trace
    }

    /// The gradient buckets, in the order backward finishes them.
    pub fn bucket_plan(&self) -> &BucketPlan {
        &self.sync.plan
    }

    /// The global mean loss and squared gradient norm. Sharded ranks contribute the squares of their
    /// chunks; replicated ranks all hold the same full gradient, so rank 0's square alone is summed.
    fn reduce_scalars(&mut self, local_loss: f64, local_sq: f64) -> Result<(f64, f64)> {
        if self.world == 1 {
            return Ok((local_loss, local_sq));
        }
        let sq = match self.opts.update {
            UpdateMode::Sharded => local_sq,
            UpdateMode::Replicated if self.rank == 0 => local_sq,
            UpdateMode::Replicated => 0.0,
        };
        let pending = self.comm.submit(move |c| {
            let mut vals = [local_loss, sq];
            c.all_reduce_scalars(&mut vals).map(|()| vals)
        });
        let (vals, _) = self.sync.ledger.wait(pending)?;
        Ok((vals[0] / self.world as f64, vals[1]))
    }

    /// Compares replica fingerprints (parameters; plus moments in replicated mode, where each rank keeps
    /// the whole optimizer state). On a mismatch: abort naming the ranks, or resync from rank 0.
    fn verify_replicas(&mut self) -> Result<String> {
        let with_moments = self.opts.update == UpdateMode::Replicated;
        let hash = self.state_hash(with_moments)?;
        if self.world > 1 {
            let hashes = self.comm.run(move |c| c.gather_hashes(hash))?;
            let diverged = diverged_ranks(&hashes);
            if !diverged.is_empty() {
                match self.opts.on_divergence {
                    OnDivergence::Abort => bail!(
                        "step {}: replicas diverged: rank(s) {diverged:?} differ from the others \
                         (--on-divergence resync would copy rank 0's state)",
                        self.step + 1
                    ),
                    OnDivergence::Resync => {
                        tracing::warn!(
                            "step {}: rank(s) {diverged:?} diverged; resyncing from rank 0",
                            self.step + 1
                        );
                        // Sharded moments belong to their rank; only what is replicated is copied.
                        self.broadcast_state()?;
                        // The copy rewrote this rank's parameter chunks too.
                        self.guard
                            .record(&mut self.be, self.model.params, &self.opt, self.step + 1)?;
                        return Ok(blake3::Hash::from(self.state_hash(with_moments)?).to_hex().to_string());
                    }
                }
            }
        }
        Ok(blake3::Hash::from(hash).to_hex().to_string())
    }

    /// Mean loss over the validation batches (the first windows of the validation stream, in order).
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        self.settle_params()?;
        let Some(val) = &self.val else { return Ok(None) };
        let (b, t) = (self.opts.batch_size, self.opts.seq_len);
        let batches = eval_windows(val.n_windows(t), self.opts.eval_batches, b);
        if batches.is_empty() {
            return Ok(None);
        }
        let mut sum = 0.0;
        for windows in &batches {
            fill_batch(val, windows, t, &mut self.inputs, &mut self.targets)?;
            sum += self.model.forward(&mut self.be, &self.inputs, &self.targets, b, t)?;
        }
        Ok(Some(sum / batches.len() as f64))
    }

    /// blake3 of the parameter bytes (little-endian f32), hex.
    pub fn param_hash(&mut self) -> Result<String> {
        self.settle_params()?;
        let params = self.model.download_params(&mut self.be)?;
        Ok(hash_f32(&params))
    }

    /// Writes a checkpoint (model + trainer state) atomically to `dir`. Collective: every rank must call
    /// it (sharded moments are gathered first); rank 0 writes.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        self.settle_params()?;
        let params = self.model.download_params(&mut self.be)?;
        let total = self.model.layout.total;
        let (mut m, mut v) = (vec![0f32; total], vec![0f32; total]);
        for (moment, view) in [(&mut m, self.opt.m), (&mut v, self.opt.v)] {
            let mut owned = vec![0f32; view.len];
            self.be.download(view, &mut owned)?;
            self.opt.place(&owned, moment);
            if !self.moments_are_replicated() {
                // Sharded: each rank holds its chunk of every bucket; gather the full tensors.
                self.gather_moment(moment)?;
            }
        }
        if self.rank != 0 {
            return Ok(());
        }
        let mut extra = BTreeMap::new();
        extra.insert("optimizer_step".to_string(), self.opt.step.to_string());
        extra.insert("train_args".to_string(), self.opts.args_json.clone());
        extra.insert("update".to_string(), self.opts.update.as_str().to_string());
        extra.insert(
            "sampler".to_string(),
            "order is a pure function of (seed, epoch); no RNG state to save".into(),
        );
        let state = TrainerState {
            step: self.step,
            tokens_seen: self.tokens_seen,
            data_cursor: self.step * self.sampler.global_batch() as u64,
            world_size: self.world,
            config_hash: self.model.config.hash_hex(),
            seed: self.opts.seed,
            m,
            v,
            extra,
        };
        checkpoint::save_checkpoint(dir, &self.model.config, &self.model.layout, &params, Some(&state))
    }

    /// All-gathers a sharded moment, bucket by bucket (rank r holds chunk r of each).
    fn gather_moment(&mut self, moment: &mut [f32]) -> Result<()> {
        for range in self.sync.plan.buckets.clone() {
            let part = moment[range.clone()].to_vec();
            let part = self.comm.run(move |c| {
                let mut part = part;
                c.all_gather(&mut part).map(|()| part)
            })?;
            moment[range].copy_from_slice(&part);
        }
        Ok(())
    }

    /// Tells the other ranks that this one failed, so they stop instead of waiting for it.
    pub fn abort(&mut self, reason: &str) {
        if self.world > 1 {
            let reason = reason.to_string();
            // After the collectives already queued, which peers are waiting on too.
            let _ = self.comm.run(move |c| {
                c.abort(&reason);
                Ok(())
            });
        }
    }
}

fn hash_into(hasher: &mut blake3::Hasher, values: &[f32]) {
    for chunk in values.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
        hasher.update(&bytes);
    }
}

/// blake3 of f32s as little-endian bytes, hex: the replica fingerprint.
pub fn hash_f32(values: &[f32]) -> String {
    let mut hasher = blake3::Hasher::new();
    hash_into(&mut hasher, values);
    hasher.finalize().to_hex().to_string()
}
