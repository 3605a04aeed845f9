//! The training loop: replicate, shard, local compute, synchronise, update (DESIGN.md's five stages).
//!
//! This build runs one process (world size 1); the synchronise stage is the identity there, and the
//! collective layer plugs in at [`Trainer::synchronise`] when peers exist.

use crate::backend::Backend;
use crate::cli::metrics::StepMetrics;
use crate::data::{eval_windows, fill_batch, split_for_rank, DataSplits, TokenStream, WindowSampler};
use crate::model::checkpoint::{self, TrainerState};
use crate::model::{init::init_params, Gpt2, ModelConfig, ParamLayout};
use crate::optim::adamw::clip_coefficient;
use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What to do when the (globally reduced) gradient norm is not finite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnNonFinite {
    /// Skip the update (parameters and moments untouched), log it, go on.
    Skip,
    /// Stop the run with an error.
    Abort,
}

/// Everything the loop needs, already validated and resolved (the CLI builds it from flags and TOML).
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub batch_size: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
    pub steps: u64,
    pub schedule: LrSchedule,
    pub adamw: AdamWConfig,
    pub grad_clip: f64,
    pub seed: u64,
    pub shuffle: bool,
    pub on_nonfinite: OnNonFinite,
    pub eval_every: u64,
    pub eval_batches: usize,
    pub save: Option<PathBuf>,
    pub save_every: u64,
    pub update: String,
    /// The resolved options as JSON, stored in checkpoints for inspection.
    pub args_json: String,
}

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
    /// Host staging for one micro-batch: `[batch_size * seq_len]` each.
    inputs: Vec<u32>,
    targets: Vec<u32>,
}

impl<B: Backend> Trainer<B> {
    pub fn new(mut be: B, source: ModelSource, data: DataSplits, opts: TrainOptions) -> Result<Self> {
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
        let (world, rank) = (1, 0);
        let global = world * opts.batch_size * opts.grad_accum;
        let sampler = WindowSampler::for_tokens(data.train.len(), opts.seq_len, global, opts.shuffle, opts.seed)?;
        let model = Gpt2::new(&mut be, config, &params)?;
        model.zero_grads(&mut be);
        let mut opt = AdamW::new(&mut be, opts.adamw, model.layout.total)?;
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
            be.upload(opt.m, &state.m)?;
            be.upload(opt.v, &state.v)?;
            step = state.data_cursor / global as u64;
            tokens_seen = state.tokens_seen;
            opt.step = match state.extra.get("optimizer_step") {
                Some(s) => s.parse().context("--resume: bad optimizer_step in trainer state")?,
                None => state.step,
            };
        }
        let n = opts.batch_size * opts.seq_len;
        Ok(Trainer {
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
            inputs: vec![0; n],
            targets: vec![0; n],
        })
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
        // gradient of this rank's mean loss; the mean over ranks in `synchronise` makes it the global batch's.
        self.model.zero_grads(&mut self.be);
        let dloss = 1.0 / (b * t * k) as f32;
        let mut loss_sum = 0.0;
        for windows in &micro {
            fill_batch(&self.train, windows, t, &mut self.inputs, &mut self.targets)?;
            loss_sum += self.model.forward(&mut self.be, &self.inputs, &self.targets, b, t)?;
            self.model.backward(&mut self.be, dloss)?;
        }
        // Synchronise: average gradients (and the loss) over ranks.
        let comm_started = Instant::now();
        let loss = self.synchronise(loss_sum / k as f64)?;
        let comm_ms = comm_started.elapsed().as_secs_f64() * 1e3;
        // Update: decisions come from reduced values, so every rank decides alike.
        let grad_norm = self.be.sum_squares(self.model.grads)?.sqrt();
        let lr = self.opts.schedule.lr_at(self.step);
        let skipped = !grad_norm.is_finite() || !loss.is_finite();
        if skipped {
            if self.opts.on_nonfinite == OnNonFinite::Abort {
                bail!(
                    "step {}: non-finite loss ({loss}) or gradient norm ({grad_norm}); stopping (--on-nonfinite abort)",
                    self.step + 1
                );
            }
        } else {
            let coef = clip_coefficient(grad_norm, self.opts.grad_clip);
            let total = self.model.layout.total;
            let layout = &self.model.layout;
            self.opt.update_range(
                &mut self.be,
                layout,
                self.model.params,
                self.model.grads,
                0,
                total,
                lr,
                coef,
            );
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
            comm_ms,
            world_size: self.world,
            update: self.opts.update.clone(),
            param_hash: None,
            val_loss: None,
            skipped,
        })
    }

    /// Averages gradients over ranks. With one rank there is nothing to exchange.
    fn synchronise(&mut self, local_loss: f64) -> Result<f64> {
        debug_assert_eq!(
            self.world, 1,
            "multi-rank synchronisation is wired by the data-parallel trainer"
        );
        Ok(local_loss)
    }

    /// Mean loss over the validation batches (the first windows of the validation stream, in order).
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
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
        let params = self.model.download_params(&mut self.be)?;
        Ok(hash_f32(&params))
    }

    /// Writes a checkpoint (model + trainer state) atomically to `dir`.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        let params = self.model.download_params(&mut self.be)?;
        let total = self.model.layout.total;
        let (mut m, mut v) = (vec![0f32; total], vec![0f32; total]);
        self.be.download(self.opt.m, &mut m)?;
        self.be.download(self.opt.v, &mut v)?;
        let mut extra = BTreeMap::new();
        extra.insert("optimizer_step".to_string(), self.opt.step.to_string());
        extra.insert("train_args".to_string(), self.opts.args_json.clone());
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
}

/// blake3 of f32s as little-endian bytes, hex: the replica fingerprint.
pub fn hash_f32(values: &[f32]) -> String {
    let mut hasher = blake3::Hasher::new();
    for chunk in values.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
        hasher.update(&bytes);
    }
    hasher.finalize().to_hex().to_string()
}
