//! What the training loop is asked to do: [`TrainOptions`], the choices it holds, their defaults, and the
//! digest of what every rank of a job must agree on.

use super::loss_spike::DEFAULT_LOSS_SPIKE;
use crate::collective::{CollectiveChoice, Wire};
use crate::data::{BatchPlan, BatchSplit};
use crate::elastic::ElasticRules;
use crate::model::ModelConfig;
use crate::optim::schedule::ScheduleKind;
use crate::optim::{AdamWConfig, LrSchedule};
use std::path::PathBuf;

/// Sequences per micro-batch per rank by default (the `small` preset's default is [`SMALL_BATCH_SIZE`]).
pub const DEFAULT_BATCH_SIZE: usize = 8;

/// Sequences per micro-batch per rank by default for the `small` preset: 64 of 128 tokens, as nanoGPT's
/// character-level preset trains on 64 sequences. With 8, consecutive batches at `small`'s late, low losses
/// differ by up to 28% on their own (the final model held fixed already scores consecutive batches 26% apart:
/// scripts/batch_noise.py), so a 200-step default run showed loss jumps over 20% without any instability;
/// with 16 or 32 sequences the worst jump was still 23% and 21%, with 64 it is 15% (BENCHMARKS.md, "Default
/// runs"). `tiny` stays at 8: its default run has no jump over 16%, and it is the test model and the main job.
pub const SMALL_BATCH_SIZE: usize = 64;

/// The default batch for `model`: [`SMALL_BATCH_SIZE`] for the `small` preset's shape, else
/// [`DEFAULT_BATCH_SIZE`].
pub fn default_batch_size(model: &ModelConfig) -> usize {
    if *model == ModelConfig::small() {
        SMALL_BATCH_SIZE
    } else {
        DEFAULT_BATCH_SIZE
    }
}

/// The most token positions one micro-batch may hold (`batch_size × seq_len`): the GPU kernels index them
/// with 32 bits, and the activations scale with them.
pub const MAX_MICRO_BATCH_TOKENS: usize = 1 << 31;

/// The largest gradient bucket, MiB.
pub const MAX_BUCKET_MB: f64 = 4096.0;

/// Optimizer steps by default.
pub const DEFAULT_STEPS: u64 = 200;

/// Gradient bucket of the replicated all-reduce by default, MiB.
pub const DEFAULT_BUCKET_MB: f64 = 25.0;

/// The default peak learning rate: 3e-3 for narrow models (C <= 256: tiny, small), which tolerate and need a
/// high rate to learn in a few hundred steps, and GPT-2's 6e-4 for anything wider. The rate is safe only with
/// [`default_warmup`]: without warmup, Adam's first updates move every weight by about the full rate whatever
/// its gradient, and `small` at 3e-3 blows up within its first ten steps (PyTorch does the same from the same
/// weights on the same batches: scripts/compare_torch_training.py).
pub fn default_lr(model: &ModelConfig) -> f64 {
    if model.n_embd <= 256 {
        3e-3
    } else {
        6e-4
    }
}

/// The default linear warmup of a run of `steps` optimizer steps: a fifth of them (40 of the default 200).
/// A tenth was not enough: `tiny` with seed 1 still blew up at step 17, right before the peak.
pub fn default_warmup(steps: u64) -> u64 {
    steps / 5
}

/// A gradient bucket of `mb` MiB in f32 elements (at least one).
pub fn bucket_elems(mb: f64) -> usize {
    ((mb * 1024.0 * 1024.0 / 4.0) as usize).max(1)
}

/// What to do when the (globally reduced) gradient norm is not finite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnNonFinite {
    /// Skip the update (parameters and moments untouched), log it, go on.
    Skip,
    /// Stop the run with an error.
    Abort,
}

/// `--outer-every` by default: inner steps per outer step (see BENCHMARKS.md, "Outer synchronisation").
pub const DEFAULT_OUTER_EVERY: u64 = 50;

/// `--outer-lr` by default: DiLoCo's (arXiv 2311.08105).
pub const DEFAULT_OUTER_LR: f64 = 0.7;

/// `--outer-momentum` by default: DiLoCo's Nesterov momentum.
pub const DEFAULT_OUTER_MOMENTUM: f64 = 0.9;

/// `--outer-momentum` by default with `--outer-overlap on`: a Δ applied one round late overshoots with
/// DiLoCo's 0.9, which corrects itself only a round later (BENCHMARKS.md, "Outer synchronisation").
pub const DEFAULT_OVERLAPPED_OUTER_MOMENTUM: f64 = 0.5;

/// How the ranks stay together (`--sync`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SyncMode {
    /// Every step's gradient is reduced over the ranks before the update (the default).
    EveryStep,
    /// DiLoCo: each rank trains alone for `every` inner steps, then the ranks average the change of the
    /// parameters and apply it with an outer Nesterov step ([`super::outer_sync`]).
    Outer(OuterOptions),
}

/// The outer optimizer of `--sync outer`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OuterOptions {
    /// `--outer-every`: inner steps per outer step.
    pub every: u64,
    /// `--outer-lr`.
    pub lr: f64,
    /// `--outer-momentum`: Nesterov momentum.
    pub momentum: f64,
    /// `--outer-overlap on`: each outer step runs on the communication thread while the next round trains,
    /// and its result is applied one round late ([`super::outer_sync`]).
    pub overlap: bool,
}

impl SyncMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            SyncMode::EveryStep => "every-step",
            SyncMode::Outer(_) => "outer",
        }
    }

    /// The outer options, for `--sync outer`.
    pub fn outer(&self) -> Option<OuterOptions> {
        match self {
            SyncMode::Outer(o) => Some(*o),
            SyncMode::EveryStep => None,
        }
    }
}

/// How the optimizer update is distributed over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateMode {
    /// ZeRO-1: reduce-scatter, AdamW on the owned chunk, all-gather the parameters.
    Sharded,
    /// Classic DDP: all-reduce, every rank runs the full AdamW.
    Replicated,
}

impl UpdateMode {
    pub fn as_str(self) -> &'static str {
        match self {
            UpdateMode::Sharded => "sharded",
            UpdateMode::Replicated => "replicated",
        }
    }
}

/// What to do when the replicas' hashes disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnDivergence {
    Abort,
    /// Broadcast rank 0's parameters (and moments) and go on.
    Resync,
}

/// Everything the loop needs, already validated and resolved. [`TrainOptions::for_model`] gives the defaults;
/// the command line starts from them and applies its flags and TOML file.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    /// Sequences per micro-batch on this rank (ranks may differ when shares are uneven).
    pub batch_size: usize,
    pub seq_len: usize,
    /// Micro-batches per step on every rank, for the default global batch.
    pub grad_accum: usize,
    /// Sequences per optimizer step over all ranks (`--global-batch`); `None`: world × batch_size ×
    /// grad_accum.
    pub global_batch: Option<usize>,
    /// How the global batch is divided among the ranks (`--batch-split`).
    pub batch_split: BatchSplit,
    pub steps: u64,
    pub schedule: LrSchedule,
    pub adamw: AdamWConfig,
    pub grad_clip: f64,
    pub seed: u64,
    pub shuffle: bool,
    pub on_nonfinite: OnNonFinite,
    /// Warn when a step's loss exceeds this many times the running average of the earlier losses (0: never);
    /// only reported, never acted on ([`super::loss_spike`]).
    pub loss_spike: f64,
    pub eval_every: u64,
    pub eval_batches: usize,
    pub save: Option<PathBuf>,
    pub save_every: u64,
    pub update: UpdateMode,
    /// Which reduction schedule the ranks run (`--collective`): the flat ring, the two-level one, or rank
    /// 0's choice from the hosts at rendezvous. It decides how the sums are grouped, so it is in the job
    /// hash; the transport applies it.
    pub collective: CollectiveChoice,
    pub verify_every: u64,
    pub on_divergence: OnDivergence,
    /// Gradient bucket size, in f32 elements.
    pub bucket_elems: usize,
    /// Start each bucket's collective while backward goes on (`--overlap on`), or after it (`off`); the
    /// bits are the same.
    pub overlap: bool,
    /// Elastic membership: the survivors of a lost rank re-form the group and go on under these rules
    /// (`None`: a lost rank ends the job). Flat ring, `even` or `auto` split only.
    pub elastic: Option<ElasticRules>,
    /// `--sync`: every step (the gradient all-reduced) or a periodic outer step ([`super::outer_sync`]).
    pub sync: SyncMode,
    /// `--wire`: the format the reduced values (gradients, outer pseudo-gradients) travel in between ranks;
    /// parameters always travel in f32.
    pub wire: Wire,
    /// The settings the run was asked for, as JSON (the command line stores its flags), kept in checkpoints
    /// for inspection; empty when the options were built in code.
    pub args_json: String,
}

impl TrainOptions {
    /// The defaults for a run of `model`: [`default_batch_size`] (8, or 64 for `small`) sequences of the
    /// model's longest sequence length (at most 1024 tokens),
    /// no accumulation, 200 steps of cosine decay from [`default_lr`] to a tenth of it after a linear warmup
    /// over the first fifth of the steps ([`default_warmup`]),
    /// AdamW (0.9, 0.95, 1e-8, decay 0.1), clipping at norm 1, seed 1337, shuffled data, skip non-finite
    /// steps, warn of losses over 3x their running average, evaluate every 100 steps on 16 batches, no
    /// checkpoints, the sharded update, no replica verification (abort on divergence when asked for it),
    /// 25 MiB buckets overlapping backward.
    pub fn for_model(model: &ModelConfig) -> TrainOptions {
        let lr = default_lr(model);
        TrainOptions {
            batch_size: default_batch_size(model),
            seq_len: model.n_positions.min(1024),
            grad_accum: 1,
            global_batch: None,
            batch_split: BatchSplit::Even,
            steps: DEFAULT_STEPS,
            schedule: LrSchedule {
                kind: ScheduleKind::Cosine,
                lr,
                warmup: default_warmup(DEFAULT_STEPS),
                min_lr: lr / 10.0,
                total_steps: DEFAULT_STEPS,
            },
            adamw: AdamWConfig::default(),
            grad_clip: 1.0,
            seed: 1337,
            shuffle: true,
            on_nonfinite: OnNonFinite::Skip,
            loss_spike: DEFAULT_LOSS_SPIKE,
            eval_every: 100,
            eval_batches: 16,
            save: None,
            save_every: 0,
            update: UpdateMode::Sharded,
            collective: CollectiveChoice::Auto,
            verify_every: 0,
            on_divergence: OnDivergence::Abort,
            bucket_elems: bucket_elems(DEFAULT_BUCKET_MB),
            overlap: true,
            elastic: None,
            sync: SyncMode::EveryStep,
            wire: Wire::F32,
            args_json: String::new(),
        }
    }

    /// What an elastic run can re-form: the global batch must re-split over any number of ranks, on the flat
    /// ring (the sharded update keeps buddy mirrors there, [`super::buddy`]).
    fn validate_elastic(&self) -> anyhow::Result<()> {
        let Some(rules) = &self.elastic else { return Ok(()) };
        anyhow::ensure!(rules.min_ranks >= 1, "--min-ranks must be at least 1");
        anyhow::ensure!(
            matches!(self.batch_split, BatchSplit::Even | BatchSplit::Auto),
            "--elastic with --batch-split {}: weights name ranks, which a membership change renumbers; use even or \
             auto",
            self.batch_split
        );
        anyhow::ensure!(
            self.collective != CollectiveChoice::Hierarchical,
            "--elastic with --collective hierarchical: after a membership change the hosts left may not hold \
             equal numbers of ranks, which the two-level ring needs; use --collective auto (two levels while they \
             do, the flat ring when not)"
        );
        Ok(())
    }

    /// The ring the transport is asked to form: `--collective`, except that an elastic run of the sharded
    /// update keeps its buddy mirrors on the flat ring (a buddy is the left neighbour there; the two-level
    /// ring's chunk order has none), so `auto` forms the flat ring for it.
    pub fn ring_to_form(&self) -> CollectiveChoice {
        match (self.elastic.is_some(), self.update, self.collective) {
            (true, UpdateMode::Sharded, CollectiveChoice::Auto) => CollectiveChoice::Flat,
            (_, _, choice) => choice,
        }
    }

    /// What `--sync outer` runs with: equal shares (the outer step averages the ranks' changes alike), and the run's
    /// evaluations, replica checks and end fall on outer steps, where the ranks hold the same
    /// parameters.
    fn validate_outer(&self) -> anyhow::Result<()> {
        let Some(outer) = self.sync.outer() else { return Ok(()) };
        let h = outer.every;
        anyhow::ensure!(h >= 1, "--outer-every must be at least 1");
        anyhow::ensure!(
            outer.lr.is_finite() && outer.lr > 0.0,
            "--outer-lr {} must be a positive number",
            outer.lr
        );
        anyhow::ensure!(
            outer.momentum.is_finite() && (0.0..1.0).contains(&outer.momentum),
            "--outer-momentum {} must be in [0, 1)",
            outer.momentum
        );
        anyhow::ensure!(
            self.elastic.is_none(),
            "--sync outer with --elastic is not built: a lost rank's inner progress since the last outer step \
             would have to be dropped or waited for; run --sync outer without --elastic"
        );
        anyhow::ensure!(
            self.batch_split == BatchSplit::Even,
            "--sync outer with --batch-split {}: the outer step averages the ranks' changes with equal weights, so \
             their shares must be equal (--batch-split even)",
            self.batch_split
        );
        for (flag, n) in [
            ("--steps", self.steps),
            ("--eval-every", self.eval_every),
            ("--verify-every", self.verify_every),
        ] {
            anyhow::ensure!(
                n % h == 0,
                "{flag} {n} is not a multiple of --outer-every {h}: with --sync outer the ranks hold the same \
                 parameters only after an outer step, where evaluations, replica checks and the run's end must \
                 fall"
            );
        }
        Ok(())
    }

    /// Sets the number of optimizer steps and the schedule's length with it (the cosine reaches its floor at
    /// the last step), and the warmup to that length's [`default_warmup`]: set a warmup of your own after.
    pub fn with_steps(mut self, steps: u64) -> TrainOptions {
        self.steps = steps;
        self.schedule.total_steps = steps;
        self.schedule.warmup = default_warmup(steps);
        self
    }

    /// Refuses options no run of `model` over `world` ranks can train with, naming the flag that sets each
    /// value. [`super::Trainer::new`] calls it, so the command line, the sim and the library API get the same
    /// checks and messages.
    pub fn validate(&self, model: &ModelConfig, world: usize) -> anyhow::Result<()> {
        use anyhow::{bail, ensure};
        let (b, t, k) = (self.batch_size, self.seq_len, self.grad_accum);
        ensure!(b >= 1, "--batch-size must be at least 1");
        ensure!(k >= 1, "--grad-accum must be at least 1");
        ensure!(world >= 1, "a run needs at least one rank");
        ensure!(
            t >= 1 && t <= model.n_positions,
            "--seq-len {t} must be between 1 and the model's n_positions ({})",
            model.n_positions
        );
        if b.checked_mul(t).is_none_or(|n| n > MAX_MICRO_BATCH_TOKENS) {
            bail!(
                "--batch-size {b} x --seq-len {t} is over {MAX_MICRO_BATCH_TOKENS} tokens per micro-batch, more \
                 than any backend can index; use --grad-accum for larger batches"
            );
        }
        ensure!(
            b.checked_mul(k).and_then(|n| n.checked_mul(world)).is_some(),
            "--batch-size {b} x --grad-accum {k} x {world} ranks is too large"
        );
        ensure!(
            self.global_batch.is_none() || k == 1,
            "--grad-accum {k} with --global-batch: --grad-accum only sets the default global batch (ranks x \
             --batch-size x --grad-accum); with --global-batch each rank runs as many micro-batches of at most \
             --batch-size as its share needs, so give one of the two"
        );
        self.batch_plan(world)?;
        self.validate_elastic()?;
        self.validate_outer()?;
        let lr = self.schedule.lr;
        ensure!(lr.is_finite() && lr > 0.0, "--lr {lr} must be a positive number");
        let min_lr = self.schedule.min_lr;
        ensure!(
            min_lr.is_finite() && min_lr >= 0.0 && min_lr <= lr,
            "--min-lr {min_lr} must be between 0 and --lr"
        );
        let a = &self.adamw;
        for (name, v) in [("--beta1", a.beta1), ("--beta2", a.beta2)] {
            ensure!((0.0..1.0).contains(&v), "{name} {v} must be in [0, 1)");
        }
        ensure!(
            a.eps.is_finite() && a.eps > 0.0,
            "--eps {} must be a positive number",
            a.eps
        );
        for (name, v) in [("--weight-decay", a.weight_decay), ("--grad-clip", self.grad_clip)] {
            ensure!(v.is_finite() && v >= 0.0, "{name} {v} must be a non-negative number");
        }
        let spike = self.loss_spike;
        ensure!(
            spike == 0.0 || (spike.is_finite() && spike > 1.0),
            "--loss-spike {spike} must be a factor over 1, or 0 to turn the warning off"
        );
        let max_bucket = bucket_elems(MAX_BUCKET_MB);
        ensure!(
            self.bucket_elems >= 1 && self.bucket_elems <= max_bucket,
            "--bucket-mb must be in (0, {MAX_BUCKET_MB}] ({} elements is not)",
            self.bucket_elems
        );
        Ok(())
    }

    /// Sequences per optimizer step over `world` ranks: `--global-batch`, else world × batch × grad-accum.
    pub fn global_batch_for(&self, world: usize) -> usize {
        self.global_batch
            .unwrap_or_else(|| world.saturating_mul(self.batch_size).saturating_mul(self.grad_accum))
    }

    /// How each step's global batch is laid out over `world` ranks: each rank's share, and whether the shares
    /// are equal whole micro-batches (today's layout and averaging ring).
    pub fn batch_plan(&self, world: usize) -> anyhow::Result<BatchPlan> {
        let global = self.global_batch_for(world);
        Ok(BatchPlan::new(
            global,
            world,
            &self.batch_split,
            self.batch_size,
            self.grad_accum,
        )?)
    }

    /// Digest of everything the ranks of a `world`-rank job on `model` must agree on: the model shape, the
    /// batch layout (the global batch and its split, and with equal whole micro-batches their size and
    /// count, which lay the batch out; uneven shares let each rank pick its own micro-batch size), and
    /// whatever decides which collectives run (verification, checkpoint gathers), so that a rank started
    /// with different settings is refused at rendezvous instead of hanging a collective.
    pub fn job_hash(&self, model: &ModelConfig, world: usize) -> u64 {
        // An elastic job is one job over any membership: a new member cannot know the world of the moment,
        // and the global batch (below) is what fixes the bits.
        let layout = match self.elastic {
            Some(_) => format!(
                "elastic-b{}|k{}|split{}",
                self.batch_size, self.grad_accum, self.batch_split
            ),
            None => match self.batch_plan(world).ok().and_then(|plan| plan.equal) {
                Some((b, k)) => format!("world{world}|b{b}|k{k}"),
                None => format!("world{world}|split{}", self.batch_split),
            },
        };
        // The sync mode and the outer cadence decide when the ranks communicate; --elastic adds the joiner
        // agreement after every step (and the buddy shifts under the sharded update); --wire decides the
        // frames' kind and every rounded bit.
        let sync = match self.sync.outer() {
            Some(o) => format!(
                "outer{}/{:x}/{:x}/overlap{}",
                o.every,
                o.lr.to_bits(),
                o.momentum.to_bits(),
                o.overlap
            ),
            None => "every-step".to_string(),
        };
        let text = format!(
            "{}|g{}|{layout}|t{}|steps{}|seed{}|{}|shuffle{}|verify{}|save{}|every{}|{}|{sync}|elastic{}|wire{}",
            model.hash_hex(),
            self.global_batch_for(world),
            self.seq_len,
            self.steps,
            self.seed,
            self.update.as_str(),
            self.shuffle,
            self.verify_every,
            self.save.is_some(),
            self.save_every,
            self.collective,
            self.elastic.is_some(),
            self.wire
        );
        let digest = blake3::hash(text.as_bytes());
        u64::from_le_bytes(digest.as_bytes()[..8].try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_schedule_warms_up_over_a_fifth_of_the_run() {
        let tiny = TrainOptions::for_model(&ModelConfig::tiny());
        assert_eq!(
            (tiny.schedule.lr, tiny.schedule.warmup, tiny.schedule.total_steps),
            (3e-3, 40, 200)
        );
        // The first step runs at a fortieth of the peak, the peak is reached at step 40 (1-based).
        assert!((tiny.schedule.lr_at(0) - 7.5e-5).abs() < 1e-12);
        assert!((tiny.schedule.lr_at(38) - 3e-3 * 39.0 / 40.0).abs() < 1e-12);
        assert!((tiny.schedule.lr_at(39) - 3e-3).abs() < 1e-12);
        let short = tiny.clone().with_steps(30);
        assert_eq!((short.schedule.warmup, short.schedule.total_steps), (6, 30));
        assert_eq!(
            TrainOptions::for_model(&ModelConfig::tiny())
                .with_steps(4)
                .schedule
                .warmup,
            0
        );
        assert_eq!(TrainOptions::for_model(&ModelConfig::gpt2()).schedule.lr, 6e-4);
    }

    /// Ranks that would run other collectives at other steps must not meet: the sync mode, its cadence and
    /// --elastic are in the job hash.
    #[test]
    fn the_job_hash_separates_sync_modes_cadences_and_elastic_runs() {
        let model = ModelConfig::tiny();
        let base = TrainOptions::for_model(&model);
        let outer = |every| TrainOptions {
            sync: SyncMode::Outer(OuterOptions {
                every,
                lr: DEFAULT_OUTER_LR,
                momentum: DEFAULT_OUTER_MOMENTUM,
                overlap: false,
            }),
            ..base.clone()
        };
        let elastic = TrainOptions {
            elastic: Some(ElasticRules::default()),
            ..base.clone()
        };
        let hashes = [&base, &outer(10), &outer(20), &elastic].map(|o| o.job_hash(&model, 2));
        let distinct: std::collections::BTreeSet<_> = hashes.iter().collect();
        assert_eq!(distinct.len(), 4, "{hashes:?}");
        assert_eq!(outer(10).job_hash(&model, 2), hashes[1]);
        // An elastic job's hash holds its global batch, not the world: a new member given the job's global
        // batch computes it alone; without one, the global batch follows the world and so does the hash.
        let fixed = TrainOptions {
            global_batch: Some(24),
            ..elastic.clone()
        };
        assert_eq!(fixed.job_hash(&model, 1), fixed.job_hash(&model, 3));
        assert_ne!(elastic.job_hash(&model, 1), elastic.job_hash(&model, 3));
        let static_job = TrainOptions {
            global_batch: Some(24),
            ..base.clone()
        };
        assert_ne!(static_job.job_hash(&model, 1), static_job.job_hash(&model, 3));
    }

    #[test]
    fn the_library_refuses_what_no_run_can_train_with_naming_the_flag() {
        let tiny = ModelConfig::tiny();
        let ok = TrainOptions::for_model(&tiny);
        assert!(ok.validate(&tiny, 4).is_ok());
        let refused = |opts: TrainOptions, world: usize| opts.validate(&tiny, world).unwrap_err().to_string();
        let huge = TrainOptions {
            batch_size: 1 << 30,
            seq_len: 64,
            ..ok.clone()
        };
        assert!(refused(huge, 1).contains("tokens per micro-batch"));
        let long = TrainOptions {
            seq_len: 65,
            ..ok.clone()
        };
        assert!(refused(long, 1).contains("--seq-len 65"));
        let mut negative = ok.clone();
        negative.schedule.lr = -1.0;
        assert!(refused(negative, 1).contains("--lr -1 must be a positive number"));
        let mut beta = ok.clone();
        beta.adamw.beta2 = 1.0;
        assert!(refused(beta, 1).contains("--beta2 1 must be in [0, 1)"));
        let spike = TrainOptions {
            loss_spike: 0.5,
            ..ok.clone()
        };
        assert!(refused(spike, 1).contains("--loss-spike"));
        // Under the micro-batch limit, but not times the ranks and the accumulation.
        let overflow = TrainOptions {
            batch_size: 1 << 30,
            seq_len: 1,
            grad_accum: usize::MAX / 4,
            ..ok
        };
        assert!(refused(overflow, 4).contains("ranks is too large"));
    }

    #[test]
    fn small_trains_on_64_sequences_by_default_and_the_others_on_8() {
        let batch = |m: ModelConfig| TrainOptions::for_model(&m).batch_size;
        assert_eq!(batch(ModelConfig::small()), 64);
        assert_eq!(batch(ModelConfig::tiny()), 8);
        assert_eq!(batch(ModelConfig::gpt2()), 8);
        // Only the preset's exact shape: a wider model built from flags keeps 8.
        let wider = ModelConfig {
            n_embd: 256,
            ..ModelConfig::small()
        };
        assert_eq!(batch(wider), 8);
    }
}
