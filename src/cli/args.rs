//! `ringtrain train` flags, the TOML config file that can hold any of them, and their resolution into
//! validated [`TrainOptions`]. Flags override the file; the file overrides the defaults.

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use ringtrain::collective::shm::LinkTransport;
use ringtrain::collective::{CollectiveChoice, Wire};
use ringtrain::data::{BatchSplit, TokenizerKind};
use ringtrain::elastic::{ElasticRules, Quorum};
use ringtrain::model::ModelConfig;
use ringtrain::optim::schedule::{LrScaling, ScheduleKind};
use ringtrain::optim::{AdamWConfig, LrSchedule};
use ringtrain::trainer::{
    bucket_elems, OnDivergence, OnNonFinite, OuterOptions, SyncMode, TrainOptions, UpdateMode, DEFAULT_OUTER_EVERY,
    DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DEFAULT_OVERLAPPED_OUTER_MOMENTUM, MAX_BUCKET_MB,
};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Every flag of `ringtrain train` (and `ringtrain bench step`). All optional so that a TOML file can
/// supply them; the keys of the file are the flag names (`batch-size = 8`).
#[derive(Args, Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TrainArgs {
    /// TOML file with any of these flags as keys
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Model preset: tiny, small or gpt2
    #[arg(long)]
    pub model: Option<String>,
    /// Custom shape: number of layers (overrides the preset)
    #[arg(long, allow_negative_numbers = true)]
    pub n_layer: Option<usize>,
    /// Custom shape: embedding width
    #[arg(long, allow_negative_numbers = true)]
    pub n_embd: Option<usize>,
    /// Custom shape: attention heads
    #[arg(long, allow_negative_numbers = true)]
    pub n_head: Option<usize>,
    /// Custom shape: vocabulary size (defaults to the tokenizer's)
    #[arg(long, allow_negative_numbers = true)]
    pub vocab_size: Option<usize>,
    /// Custom shape: longest sequence (position table size)
    #[arg(long, allow_negative_numbers = true)]
    pub n_positions: Option<usize>,
    /// Start from a Hugging Face GPT-2 directory
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Training data: synthetic, a .txt file, a .bin shard, a directory or glob of shards
    #[arg(long)]
    pub data: Option<String>,
    /// Validation data (same forms as --data)
    #[arg(long)]
    pub val_data: Option<String>,
    /// byte or gpt2
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// auto, cpu, wgpu or cuda
    #[arg(long)]
    pub backend: Option<String>,
    /// How matmuls multiply: fp32, or tf32 (CUDA's tensor cores; the other backends refuse it) [default: fp32]
    #[arg(long)]
    pub matmul_precision: Option<String>,
    /// Sequences per micro-batch per rank [default: 64 for the unchanged `small` preset (byte tokenizer), else 8]
    #[arg(long, allow_negative_numbers = true)]
    pub batch_size: Option<usize>,
    /// Tokens per sequence
    #[arg(long, allow_negative_numbers = true)]
    pub seq_len: Option<usize>,
    /// Micro-batches per optimizer step
    #[arg(long, allow_negative_numbers = true)]
    pub grad_accum: Option<usize>,
    /// Sequences per optimizer step over all ranks [default: ranks x --batch-size x --grad-accum]
    #[arg(long, allow_negative_numbers = true)]
    pub global_batch: Option<usize>,
    /// How the global batch is divided among the ranks: even, auto (each rank's share follows its measured
    /// speed), or one weight per rank such as 3,1 (each rank runs its share in micro-batches of at most its
    /// own --batch-size)
    #[arg(long)]
    pub batch_split: Option<String>,
    /// Optimizer steps (total, counting resumed ones)
    #[arg(long, allow_negative_numbers = true)]
    pub steps: Option<u64>,
    /// Peak learning rate [default: 3e-3 for models up to 256 wide, else 6e-4]
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// constant or cosine
    #[arg(long)]
    pub lr_schedule: Option<String>,
    /// Linear warmup steps [default: a fifth of --steps]
    #[arg(long, allow_negative_numbers = true)]
    pub warmup: Option<u64>,
    /// Floor of the cosine schedule (default lr/10)
    #[arg(long, allow_negative_numbers = true)]
    pub min_lr: Option<f64>,
    /// none, linear or sqrt: scale --lr by global batch / --base-batch
    #[arg(long)]
    pub lr_scaling: Option<String>,
    /// Global batch (sequences) that --lr was tuned for
    #[arg(long, allow_negative_numbers = true)]
    pub base_batch: Option<usize>,
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    pub beta1: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    pub beta2: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    pub eps: Option<f64>,
    /// Clip the global gradient L2 norm to this; 0 turns clipping off
    #[arg(long, allow_negative_numbers = true)]
    pub grad_clip: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// on or off
    #[arg(long)]
    pub shuffle: Option<String>,
    /// sharded (ZeRO-1) or replicated
    #[arg(long)]
    pub update: Option<String>,
    /// Compare replica hashes every N steps (0: never)
    #[arg(long, allow_negative_numbers = true)]
    pub verify_every: Option<u64>,
    /// abort or resync
    #[arg(long)]
    pub on_divergence: Option<String>,
    /// skip or abort
    #[arg(long)]
    pub on_nonfinite: Option<String>,
    /// Survivors of a lost rank re-form the ring and go on (sharded ranks keep a buddy mirror of a neighbour's optimizer chunk)
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub elastic: Option<bool>,
    /// With --elastic: who may go on after a loss, majority (a strict majority of the last membership) or
    /// any (then both sides of a network partition may continue) [default: majority]
    #[arg(long)]
    pub quorum: Option<String>,
    /// With --elastic: stop below this many ranks [default: 1]
    #[arg(long)]
    pub min_ranks: Option<usize>,
    /// every-step (each step's gradient is reduced over the ranks) or outer (DiLoCo: each rank trains alone
    /// for --outer-every steps, then the ranks average the change of the parameters with an outer Nesterov
    /// step) [default: every-step]
    #[arg(long)]
    pub sync: Option<String>,
    /// With --sync outer: inner steps per outer step [default: 50]
    #[arg(long)]
    pub outer_every: Option<u64>,
    /// With --sync outer: the outer learning rate [default: 0.7]
    #[arg(long, allow_negative_numbers = true)]
    pub outer_lr: Option<f64>,
    /// With --sync outer: the outer Nesterov momentum [default: 0.9; 0.5 with --outer-overlap on]
    #[arg(long, allow_negative_numbers = true)]
    pub outer_momentum: Option<f64>,
    /// With --sync outer: run each outer step on the communication thread while the next round trains, and
    /// apply it one round late (on), or at the end of its round, exposed (off) [default: off]
    #[arg(long)]
    pub outer_overlap: Option<String>,
    /// How reduced gradients travel between ranks: f32, bf16 (half the bytes) or int8 (blockwise-scaled, a
    /// little over a quarter); rounded at fixed points so replicas stay bit-identical [default: f32]
    #[arg(long, value_enum)]
    pub wire: Option<Wire>,
    /// Warn when a step's loss exceeds this many times the running average of the earlier losses; only
    /// logged, 0 turns it off [default: 3]
    #[arg(long, allow_negative_numbers = true)]
    pub loss_spike: Option<f64>,
    /// Gradient bucket size for the AllReduce, MiB
    #[arg(long, allow_negative_numbers = true)]
    pub bucket_mb: Option<f64>,
    /// on (communicate each gradient bucket while backward goes on) or off (after backward); same bits
    #[arg(long)]
    pub overlap: Option<String>,
    /// Checkpoint directory written at the end (and every --save-every steps)
    #[arg(long)]
    pub save: Option<PathBuf>,
    #[arg(long, allow_negative_numbers = true)]
    pub save_every: Option<u64>,
    /// Continue from a checkpoint directory
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// JSONL file with one line of metrics per step
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Evaluate on the validation data every N steps (0: only at the end)
    #[arg(long, allow_negative_numbers = true)]
    pub eval_every: Option<u64>,
    /// Validation batches per evaluation
    #[arg(long, allow_negative_numbers = true)]
    pub eval_batches: Option<usize>,
    /// Deadline of one collective, seconds
    #[arg(long, allow_negative_numbers = true)]
    pub timeout: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    pub rank: Option<usize>,
    #[arg(long, allow_negative_numbers = true)]
    pub world_size: Option<usize>,
    #[arg(long)]
    pub master_addr: Option<String>,
    #[arg(long)]
    pub master_port: Option<u16>,
    /// File holding the cluster secret (or set RINGTRAIN_SECRET)
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Ring links to ranks on this host: auto (shared memory where it attaches, else QUIC with a line
    /// saying why), shm (shared memory or fail), quic. Never changes the bits.
    #[arg(long, value_enum)]
    pub transport: Option<LinkTransport>,
    /// How gradients are summed: flat (one ring over every rank), hierarchical (within each host, then
    /// across hosts: needs several hosts with equal rank counts), auto (hierarchical where it fits, else
    /// flat). Changes the bits: every rank must give the same value.
    #[arg(long, value_enum)]
    pub collective: Option<CollectiveChoice>,
    /// Compute threads of this rank (default: RAYON_NUM_THREADS, else the host's cores / ranks on this host)
    #[arg(long, allow_negative_numbers = true)]
    pub threads: Option<usize>,
}

/// Largest `--config` file read: a run's settings fill a few hundred bytes, and the TOML parser allocates
/// many times the text it is given, so a huge or wrong file is refused before it is read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of a `--config` file, refused with its size when it is over [`MAX_CONFIG_BYTES`].
fn read_config_text(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let file = std::fs::File::open(path).with_context(|| format!("reading --config {}", path.display()))?;
    let mut text = String::new();
    // Read one byte past the limit, so a file that grows while being read is refused as well.
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("reading --config {}", path.display()))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        bail!(
            "--config {}: the file is over {} KiB, far more than any run's settings; is it the right file?",
            path.display(),
            MAX_CONFIG_BYTES >> 10
        );
    }
    Ok(text)
}

impl TrainArgs {
    /// Flags over the `--config` file (if any).
    pub fn merged_with_file(self) -> Result<TrainArgs> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = read_config_text(&path)?;
        let file: TrainArgs = toml::from_str(&text).with_context(|| format!("parsing --config {}", path.display()))?;
        let mut merged = serde_json::to_value(&file)?;
        let flags = serde_json::to_value(&self)?;
        if let (Some(base), Some(over)) = (merged.as_object_mut(), flags.as_object()) {
            for (key, value) in over {
                if !value.is_null() {
                    base.insert(key.clone(), value.clone());
                }
            }
        }
        let mut out: TrainArgs = serde_json::from_value(merged)?;
        out.config = Some(path);
        Ok(out)
    }

    pub fn tokenizer_kind(&self) -> Result<TokenizerKind> {
        Ok(self.tokenizer.as_deref().unwrap_or("byte").parse::<TokenizerKind>()?)
    }

    /// The model shape of a fresh run: the preset, then any custom values.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let tokenizer = self.tokenizer_kind()?;
        let mut cfg = match self.model.as_deref() {
            Some(name) => ModelConfig::preset(name)?,
            None => ModelConfig::tiny(),
        };
        if self.vocab_size.is_none() {
            // A byte-level preset with the gpt2 tokenizer needs the BPE vocabulary.
            cfg.vocab_size = cfg.vocab_size.max(tokenizer.vocab_size());
        }
        let custom = [
            (&mut cfg.n_layer, self.n_layer),
            (&mut cfg.n_embd, self.n_embd),
            (&mut cfg.n_head, self.n_head),
            (&mut cfg.vocab_size, self.vocab_size),
            (&mut cfg.n_positions, self.n_positions),
        ];
        for (slot, value) in custom {
            if let Some(v) = value {
                *slot = v;
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Validated options for the loop of a `model`-shaped run over `world` ranks: the trainer's defaults
    /// ([`TrainOptions::for_model`]) with the flags and file applied.
    pub fn resolve(&self, model: &ModelConfig, world: usize) -> Result<TrainOptions> {
        let defaults = TrainOptions::for_model(model);
        let steps = self.steps.unwrap_or(defaults.steps);
        // The defaults of a run of that length: the warmup follows the number of steps.
        let d = defaults.with_steps(steps);
        let batch_size = positive("--batch-size", self.batch_size.unwrap_or(d.batch_size))?;
        let seq_len = positive("--seq-len", self.seq_len.unwrap_or(d.seq_len))?;
        let grad_accum = positive("--grad-accum", self.grad_accum.unwrap_or(d.grad_accum))?;
        let overflow = || format!("--batch-size {batch_size} x --grad-accum {grad_accum} x {world} ranks is too large");
        let per_rank = batch_size.checked_mul(grad_accum).with_context(overflow)?;
        let global = match self.global_batch {
            Some(g) => positive("--global-batch", g)?,
            None => per_rank.checked_mul(world).with_context(overflow)?,
        };
        let batch_split = match self.batch_split.as_deref() {
            Some(text) => BatchSplit::parse(text).map_err(anyhow::Error::msg)?,
            None => d.batch_split.clone(),
        };
        let base_batch = positive("--base-batch", self.base_batch.unwrap_or(per_rank))?;
        let scaling = match self.lr_scaling.as_deref() {
            Some(name) => name.parse()?,
            None => LrScaling::None,
        };
        let lr = self.lr.unwrap_or(d.schedule.lr);
        // The value asked for is checked before scaling, so the message names it.
        ensure!(lr.is_finite() && lr > 0.0, "--lr {lr} must be a positive number");
        let lr = lr * scaling.factor(global, base_batch);
        let kind: ScheduleKind = match self.lr_schedule.as_deref() {
            Some(name) => name.parse()?,
            None => d.schedule.kind,
        };
        // The default floor follows the (scaled) peak: a tenth of it.
        let min_lr = self.min_lr.unwrap_or(lr / 10.0);
        let schedule = LrSchedule {
            kind,
            lr,
            warmup: self.warmup.unwrap_or(d.schedule.warmup),
            min_lr,
            total_steps: steps,
        };
        let adamw = AdamWConfig {
            beta1: self.beta1.unwrap_or(d.adamw.beta1),
            beta2: self.beta2.unwrap_or(d.adamw.beta2),
            eps: self.eps.unwrap_or(d.adamw.eps),
            weight_decay: self.weight_decay.unwrap_or(d.adamw.weight_decay),
        };
        let shuffle = match self.shuffle.as_deref() {
            None => d.shuffle,
            Some("on") => true,
            Some("off") => false,
            Some(other) => bail!("--shuffle {other:?}: expected on or off"),
        };
        let on_nonfinite = match self.on_nonfinite.as_deref() {
            None => d.on_nonfinite,
            Some("skip") => OnNonFinite::Skip,
            Some("abort") => OnNonFinite::Abort,
            Some(other) => bail!("--on-nonfinite {other:?}: expected skip or abort"),
        };
        let loss_spike = self.loss_spike.unwrap_or(d.loss_spike);
        let update = match self.update.as_deref() {
            None => d.update,
            Some("sharded") => UpdateMode::Sharded,
            Some("replicated") => UpdateMode::Replicated,
            Some(other) => bail!("--update {other:?}: expected sharded or replicated"),
        };
        let on_divergence = match self.on_divergence.as_deref() {
            None => d.on_divergence,
            Some("abort") => OnDivergence::Abort,
            Some("resync") => OnDivergence::Resync,
            Some(other) => bail!("--on-divergence {other:?}: expected abort or resync"),
        };
        let overlap = match self.overlap.as_deref() {
            None => d.overlap,
            Some("on") => true,
            Some("off") => false,
            Some(other) => bail!("--overlap {other:?}: expected on or off"),
        };
        let bucket_elems = match self.bucket_mb {
            None => d.bucket_elems,
            Some(mb) => {
                ensure!(
                    mb.is_finite() && mb > 0.0 && mb <= MAX_BUCKET_MB,
                    "--bucket-mb {mb} must be in (0, {MAX_BUCKET_MB}]"
                );
                bucket_elems(mb)
            }
        };
        let elastic = match self.elastic.unwrap_or(false) {
            true => Some(ElasticRules {
                quorum: Quorum::parse(self.quorum.as_deref().unwrap_or("majority")).map_err(anyhow::Error::msg)?,
                min_ranks: self.min_ranks.unwrap_or(1),
            }),
            false if self.quorum.is_some() || self.min_ranks.is_some() => {
                bail!("--quorum and --min-ranks apply to --elastic runs only")
            }
            false => None,
        };
        let outer_flags = self.outer_every.is_some()
            || self.outer_lr.is_some()
            || self.outer_momentum.is_some()
            || self.outer_overlap.is_some();
        let sync = match self.sync.as_deref() {
            None | Some("every-step") if outer_flags => {
                bail!("--outer-every, --outer-lr, --outer-momentum and --outer-overlap apply to --sync outer only")
            }
            None | Some("every-step") => SyncMode::EveryStep,
            Some("outer") => {
                let overlap = match self.outer_overlap.as_deref() {
                    None | Some("off") => false,
                    Some("on") => true,
                    Some(other) => bail!("--outer-overlap {other:?}: expected on or off"),
                };
                let default_momentum = match overlap {
                    true => DEFAULT_OVERLAPPED_OUTER_MOMENTUM,
                    false => DEFAULT_OUTER_MOMENTUM,
                };
                SyncMode::Outer(OuterOptions {
                    every: self.outer_every.unwrap_or(DEFAULT_OUTER_EVERY),
                    lr: self.outer_lr.unwrap_or(DEFAULT_OUTER_LR),
                    momentum: self.outer_momentum.unwrap_or(default_momentum),
                    overlap,
                })
            }
            Some(other) => bail!("--sync {other:?}: expected every-step or outer"),
        };
        let wire = self.wire.unwrap_or_default();
        let opts = TrainOptions {
            elastic,
            sync,
            wire,
            batch_size,
            seq_len,
            grad_accum,
            global_batch: self.global_batch,
            batch_split,
            steps,
            schedule,
            adamw,
            grad_clip: self.grad_clip.unwrap_or(d.grad_clip),
            seed: self.seed.unwrap_or(d.seed),
            shuffle,
            on_nonfinite,
            loss_spike,
            eval_every: self.eval_every.unwrap_or(d.eval_every),
            eval_batches: self.eval_batches.unwrap_or(d.eval_batches),
            save: self.save.clone(),
            save_every: self.save_every.unwrap_or(d.save_every),
            update,
            collective: self.collective.unwrap_or(d.collective),
            verify_every: self.verify_every.unwrap_or(d.verify_every),
            on_divergence,
            bucket_elems,
            overlap,
            args_json: serde_json::to_string(self)?,
        };
        // The library's checks, before anything is opened or joined.
        opts.validate(model, world)?;
        Ok(opts)
    }
}

fn positive(name: &str, v: usize) -> Result<usize> {
    ensure!(v >= 1, "{name} must be at least 1");
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_micro_batch_too_large_to_index_is_refused() {
        let args = TrainArgs {
            batch_size: Some(1 << 55),
            ..TrainArgs::default()
        };
        let err = format!("{:#}", args.resolve(&ModelConfig::tiny(), 1).unwrap_err());
        assert!(err.contains("--batch-size") && err.contains("--seq-len"), "{err}");
        let fits = TrainArgs {
            batch_size: Some(1 << 25),
            ..TrainArgs::default()
        };
        assert_eq!(fits.resolve(&ModelConfig::tiny(), 1).unwrap().batch_size, 1 << 25);
    }

    #[test]
    fn a_config_file_over_the_limit_is_refused_before_parsing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        let mut text = "steps = 3\n".to_string();
        text.push_str(&"# padding\n".repeat((MAX_CONFIG_BYTES as usize) / 10 + 1));
        std::fs::write(&path, &text).unwrap();
        let args = TrainArgs {
            config: Some(path.clone()),
            ..TrainArgs::default()
        };
        let err = format!("{:#}", args.merged_with_file().unwrap_err());
        assert!(err.contains("over 1024 KiB"), "{err}");
        // The same settings in a file of normal size are read.
        std::fs::write(&path, "steps = 3\n").unwrap();
        let args = TrainArgs {
            config: Some(path),
            ..TrainArgs::default()
        };
        assert_eq!(args.merged_with_file().unwrap().steps, Some(3));
    }

    /// `--sync outer`'s defaults: DiLoCo's momentum for the plain outer step, a lower one for the delayed
    /// (overlapped) step; a momentum given on the command line wins in both.
    #[test]
    fn the_outer_momentum_default_depends_on_overlap() {
        let outer = |overlap: Option<&str>, momentum: Option<f64>| {
            let args = TrainArgs {
                sync: Some("outer".into()),
                outer_overlap: overlap.map(str::to_string),
                outer_momentum: momentum,
                steps: Some(100),
                ..TrainArgs::default()
            };
            args.resolve(&ModelConfig::tiny(), 2).unwrap().sync.outer().unwrap()
        };
        assert_eq!(outer(None, None).momentum, DEFAULT_OUTER_MOMENTUM);
        assert_eq!(outer(Some("off"), None).momentum, DEFAULT_OUTER_MOMENTUM);
        assert_eq!(outer(Some("on"), None).momentum, DEFAULT_OVERLAPPED_OUTER_MOMENTUM);
        assert_eq!(outer(Some("on"), Some(0.8)).momentum, 0.8);
        assert_eq!(outer(None, Some(0.0)).momentum, 0.0);
    }

    /// No flags: the trainer's defaults, which are the values the command line has always resolved.
    #[test]
    fn no_flags_resolve_to_the_trainer_defaults() {
        let tiny = ModelConfig::tiny();
        let args = TrainArgs::default();
        let opts = args.resolve(&tiny, 2).unwrap();
        assert_eq!(
            opts,
            TrainOptions {
                args_json: serde_json::to_string(&args).unwrap(),
                ..TrainOptions::for_model(&tiny)
            }
        );
        let schedule = LrSchedule {
            kind: ScheduleKind::Cosine,
            lr: 3e-3,
            warmup: 40,
            min_lr: 3e-3 / 10.0,
            total_steps: 200,
        };
        assert_eq!(
            (
                opts.batch_size,
                opts.seq_len,
                opts.grad_accum,
                opts.steps,
                opts.schedule
            ),
            (8, 64, 1, 200, schedule)
        );
        assert_eq!(opts.adamw, AdamWConfig::default());
        assert_eq!((opts.grad_clip, opts.seed, opts.shuffle), (1.0, 1337, true));
        assert_eq!(
            (opts.eval_every, opts.eval_batches, opts.save_every, opts.verify_every),
            (100, 16, 0, 0)
        );
        assert_eq!(
            (opts.on_nonfinite, opts.update, opts.on_divergence),
            (OnNonFinite::Skip, UpdateMode::Sharded, OnDivergence::Abort)
        );
        assert_eq!(opts.bucket_elems, 25 * 1024 * 1024 / 4);
        // A wide model gets GPT-2's rate, and the sequence is capped at 1024.
        let gpt2 = args.resolve(&ModelConfig::gpt2(), 1).unwrap();
        assert_eq!((gpt2.schedule.lr, gpt2.seq_len), (6e-4, 1024));
        // The default warmup is a fifth of the steps asked for.
        let short = TrainArgs {
            steps: Some(50),
            ..TrainArgs::default()
        };
        let schedule = short.resolve(&tiny, 1).unwrap().schedule;
        assert_eq!((schedule.warmup, schedule.total_steps), (10, 50));
    }

    #[test]
    fn flags_override_the_defaults() {
        let args = TrainArgs {
            batch_size: Some(3),
            steps: Some(12),
            lr: Some(1e-3),
            lr_schedule: Some("constant".into()),
            lr_scaling: Some("linear".into()),
            warmup: Some(2),
            update: Some("replicated".into()),
            bucket_mb: Some(1.0),
            ..TrainArgs::default()
        };
        let opts = args.resolve(&ModelConfig::tiny(), 4).unwrap();
        // Linear scaling: global batch 12 over the base batch 3.
        let lr = 1e-3 * 4.0;
        let schedule = LrSchedule {
            kind: ScheduleKind::Constant,
            lr,
            warmup: 2,
            min_lr: lr / 10.0,
            total_steps: 12,
        };
        assert_eq!((opts.batch_size, opts.steps, opts.schedule), (3, 12, schedule));
        assert_eq!((opts.update, opts.bucket_elems), (UpdateMode::Replicated, 262_144));
        let bad = TrainArgs {
            update: Some("both".into()),
            ..TrainArgs::default()
        };
        let err = bad.resolve(&ModelConfig::tiny(), 1).unwrap_err().to_string();
        assert!(err.contains("--update"), "{err}");
    }

    /// Found by `tests/fuzz_readers.rs` (a `--config` file with a 20-digit batch size): the global batch
    /// overflowed, a panic in debug builds and a wrapped, wrong batch in release ones.
    #[test]
    fn a_global_batch_too_large_for_usize_is_an_error() {
        // A micro-batch small enough to index, so that the accumulation is what overflows.
        let args = TrainArgs {
            batch_size: Some(1 << 20),
            grad_accum: Some(usize::MAX / 4),
            ..TrainArgs::default()
        };
        let err = args.resolve(&ModelConfig::tiny(), 1).unwrap_err().to_string();
        assert!(err.contains("--grad-accum") && err.contains("too large"), "{err}");
        // Per rank it fits; over the ranks it does not.
        let args = TrainArgs {
            batch_size: Some(1 << 20),
            grad_accum: Some(1 << 40),
            ..TrainArgs::default()
        };
        let err = args.resolve(&ModelConfig::tiny(), 32).unwrap_err().to_string();
        assert!(err.contains("32 ranks") && err.contains("too large"), "{err}");
    }

    /// The sim and the integration tests build their options in code; these are the same values the flags
    /// they used to pass resolve to.
    #[test]
    fn options_built_in_code_match_the_flags() {
        let model = ModelConfig {
            n_layer: 1,
            ..ModelConfig::tiny()
        };
        let flags = TrainArgs {
            batch_size: Some(2),
            seq_len: Some(16),
            grad_accum: Some(2),
            steps: Some(12),
            lr_schedule: Some("cosine".into()),
            warmup: Some(2),
            update: Some("replicated".into()),
            eval_every: Some(0),
            verify_every: Some(1),
            ..TrainArgs::default()
        };
        let mut built = TrainOptions {
            batch_size: 2,
            seq_len: 16,
            grad_accum: 2,
            update: UpdateMode::Replicated,
            eval_every: 0,
            verify_every: 1,
            args_json: serde_json::to_string(&flags).unwrap(),
            ..TrainOptions::for_model(&model).with_steps(12)
        };
        built.schedule.warmup = 2;
        for world in [1, 3] {
            assert_eq!(flags.resolve(&model, world).unwrap(), built, "world {world}");
        }
    }
}
