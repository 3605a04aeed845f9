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

use crate::backend::{Backend, StepShape};
use crate::collective::comm_thread::CommThread;
use crate::collective::{Collective, CollectiveChoice, Owner};
use crate::data::{eval_windows, fill_batch, BatchPlan, DataSplits, TokenStream, WindowSampler};
use crate::metrics::StepMetrics;
use crate::model::checkpoint::{self, TrainerState};
use crate::model::{init::init_params, Gpt2, ModelConfig, ParamLayout};
use crate::optim::adamw::clip_coefficient;
use crate::optim::AdamW;
use anyhow::{bail, ensure, Context, Result};
use std::path::PathBuf;
use std::time::Instant;

pub mod auto_split;
pub mod buckets;
pub(crate) mod buddy;
mod checkpointing;
pub mod comm_ledger;
pub mod fault_injection;
pub mod grad_sync;
pub mod loss_spike;
mod membership;
mod memory_plan;
mod options;
pub mod outer_sync;
mod replicas;
mod run;
mod shard_guard;
pub mod sync;

use crate::data::BatchSplit;
use crate::elastic::Membership;
use crate::fault_plan::FaultPlan;
use auto_split::AutoSplit;
use buckets::BucketPlan;
use fault_injection::{write_if_final, PendingInjection};
use grad_sync::{BucketedSync, Reduction, SyncTrace};
use loss_spike::LossSpikeDetector;
use shard_guard::ShardGuard;
use sync::{AgreedStep, GradientSync, LocalStep, SyncState};

pub use replicas::hash_f32;
pub use run::{blamed_peer, MembershipEvent, Quiet, Regroup, Regrouped, RunObserver};

pub use memory_plan::{host_available, measured_peak, Available, MemoryPlan};

pub use options::{
    bucket_elems, default_batch_size, default_lr, OnDivergence, OnNonFinite, OuterOptions, SyncMode, TrainOptions,
    UpdateMode, DEFAULT_BATCH_SIZE, DEFAULT_BUCKET_MB, DEFAULT_OUTER_EVERY, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM,
    DEFAULT_OVERLAPPED_OUTER_MOMENTUM, DEFAULT_STEPS, MAX_BUCKET_MB, MAX_MICRO_BATCH_TOKENS, SMALL_BATCH_SIZE,
};

/// Where the parameters of a new run come from.
pub enum ModelSource {
    /// A fresh GPT-2 init from `TrainOptions::seed`.
    Fresh(ModelConfig),
    /// `--init DIR`: a Hugging Face GPT-2 directory.
    Init(PathBuf),
    /// `--resume DIR`: parameters, optimizer state and data cursor of an earlier run.
    Resume(PathBuf),
    /// A source already read from its files ([`ModelSource::read`]), so that they are read once.
    Read(ReadModel),
}

/// A model source read from its files: the config, the flat parameters and, when resuming, the trainer
/// state.
pub struct ReadModel {
    pub config: ModelConfig,
    pub params: Vec<f32>,
    pub resume: Option<TrainerState>,
}

impl ModelSource {
    /// Reads the files the source names (nothing for a fresh init, which only draws its parameters), so a
    /// caller can check them and learn the model's shape before the trainer takes them.
    pub fn read(self, seed: u64) -> Result<ReadModel> {
        Ok(match self {
            ModelSource::Fresh(cfg) => {
                cfg.validate()?;
                let layout = ParamLayout::new(&cfg);
                let params = init_params(&cfg, &layout, seed);
                ReadModel {
                    config: cfg,
                    params,
                    resume: None,
                }
            }
            ModelSource::Init(dir) => {
                let (config, params) =
                    checkpoint::load_model(&dir).with_context(|| format!("--init {}", dir.display()))?;
                ReadModel {
                    config,
                    params,
                    resume: None,
                }
            }
            ModelSource::Resume(dir) => {
                let dir = checkpoint::resolve_checkpoint_dir(&dir)?;
                let (config, params) =
                    checkpoint::load_model(&dir).with_context(|| format!("--resume {}", dir.display()))?;
                let state = checkpoint::load_trainer_state(&dir, &ParamLayout::new(&config))
                    .with_context(|| format!("--resume {}: trainer state", dir.display()))?;
                ReadModel {
                    config,
                    params,
                    resume: Some(state),
                }
            }
            ModelSource::Read(read) => read,
        })
    }

    /// Whether the run continues an earlier one (a [`TrainerState`] comes with it).
    pub fn is_resume(&self) -> bool {
        match self {
            ModelSource::Resume(_) => true,
            ModelSource::Read(read) => read.resume.is_some(),
            _ => false,
        }
    }
}

/// One rank's trainer: its replica of the model, its optimizer state, its share of the data and its
/// synchronisation with the other ranks. Every field is private: the parameters are read through
/// [`Trainer::params`], which first puts any parameter all-gather still in flight on the device.
pub struct Trainer<B: Backend> {
    be: B,
    model: Gpt2,
    opt: AdamW,
    opts: TrainOptions,
    train: TokenStream,
    val: Option<TokenStream>,
    sampler: WindowSampler,
    /// Each rank's share of a step's global batch, and how this rank runs its share.
    batch: BatchPlan,
    /// The shares the metrics last recorded.
    reported_shares: Option<Vec<usize>>,
    /// `--batch-split auto` over several ranks: the measurements and estimates that re-split the batch.
    auto_split: Option<AutoSplit>,
    /// A recorded split history to follow instead ([`Trainer::replay_splits`]): shares by 1-based step.
    split_replay: Option<std::collections::BTreeMap<u64, Vec<usize>>>,
    /// Optimizer steps completed (including skipped ones): the next step's index.
    step: u64,
    /// Tokens consumed so far, over all ranks.
    tokens_seen: u64,
    world: usize,
    rank: usize,
    /// The collective's ownership map: which part of every bucket this rank reduces, updates and gathers.
    owner: Owner,
    /// The ring, on its own thread; only used when `world > 1`.
    comm: CommThread,
    /// Who owns which chunk of every gradient bucket (the optimizer's ranges and the checkpoint gathers).
    plan: BucketPlan,
    /// The synchronisation seam ([`sync`]); today's bucketed sync unless replaced.
    sync: Box<dyn GradientSync<B>>,
    /// Host staging for one micro-batch: `[batch_size * seq_len]` each.
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// `--loss-spike`: the running average each step's loss is compared with.
    spikes: LossSpikeDetector,
    /// Injected faults ([`fault_injection`]); the trainer applies the kinds that act on its rank's compute
    /// and state.
    faults: FaultPlan,
    /// The plan as armed, its ranks naming the first membership's members: a re-formed group takes the
    /// faults of its members from it ([`FaultPlan::for_members`]).
    armed_faults: FaultPlan,
    /// Sharded over several ranks with `--verify-every`: the checksum of this rank's shard between its updates
    /// ([`shard_guard`]).
    guard: ShardGuard,
    /// The members of the group and its epoch (elastic runs re-form it; otherwise it stays the first).
    membership: Membership,
    /// A change of membership made before the run loop started (a joiner's admission), for the metrics of
    /// its first step, with when it began.
    pending_change: Option<(crate::elastic::MembershipChange, Instant)>,
    /// The sync's state read from the checkpoint this run resumes, handed to the sync before the first step
    /// (after any [`Trainer::wrap_sync`]).
    resumed_sync_state: Option<SyncState>,
    /// Elastic and sharded over several ranks: the buddy mirror of the left neighbour's optimizer chunk
    /// ([`buddy`]), updated every step with the same reduced gradient and scalars as the owner's, so a lost
    /// rank's chunk survives on its right neighbour.
    mirror: Option<AdamW>,
    /// The group whose chunks the optimizer state (and the mirror) are cut by: a re-form after a loss
    /// finds there who held which chunk ([`buddy`]).
    layout: buddy::StateLayout,
    /// The last step whose scalars this rank agreed on: its 0-based index and the agreed values.
    last_agreed: Option<(u64, AgreedStep)>,
    /// The 0-based index of a step whose reduced gradient stayed on the device when its agreement failed
    /// (a loss): a re-form may still apply that step ([`buddy`]'s roll-forward).
    reduced_step: Option<u64>,
    /// The transport's count of bytes sent at the end of the last step (0 for a new collective).
    sent_mark: u64,
}

/// The shares a checkpoint of a `world`-rank run recorded (`batch_shares`), when they split this run's
/// global batch; `None` when it recorded none or split another global batch.
/// `comm` on its own thread, its reducing collectives sending in `wire` (`--wire`).
fn comm_thread(mut comm: Box<dyn Collective>, wire: crate::collective::Wire) -> Result<CommThread> {
    comm.set_wire(wire);
    CommThread::spawn(comm).context("starting the communication thread")
}

fn resumed_shares(
    extra: &std::collections::BTreeMap<String, String>,
    global: usize,
    world: usize,
) -> Result<Option<Vec<usize>>> {
    let Some(text) = extra.get("batch_shares") else {
        return Ok(None);
    };
    let shares = text
        .split(',')
        .map(|n| n.trim().parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .with_context(|| format!("--resume: batch_shares {text:?} is not a list of sequence counts"))?;
    let fits = shares.len() == world && shares.iter().sum::<usize>() == global && !shares.contains(&0);
    Ok(fits.then_some(shares))
}

/// One rank's optimizer moments: the ranges of the flat layout it keeps (all of it when replicated) and
/// AdamW's two moments over them, laid range after range.
#[derive(Clone, Debug, PartialEq)]
pub struct Moments {
    /// AdamW's step count (its bias correction).
    pub step: u64,
    pub owned: Vec<std::ops::Range<usize>>,
    /// `[owned elements]`: the first moment (`exp_avg`).
    pub m: Vec<f32>,
    /// `[owned elements]`: the second moment (`exp_avg_sq`).
    pub v: Vec<f32>,
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
        let ReadModel { config, params, resume } = source.read(opts.seed)?;
        opts.validate(&config, comm.world())?;
        // The transport applies `--collective` when it joins; a collective that runs another ring than the
        // options name would train with other bits than the job hash promises.
        match (opts.collective, comm.two_level().is_some()) {
            (CollectiveChoice::Hierarchical, false) => bail!(
                "the options ask for the two-level ring (--collective hierarchical), but this collective runs the \
                 flat ring (a single process, or a transport without two levels)"
            ),
            (CollectiveChoice::Flat, true) => {
                bail!("the options ask for the flat ring (--collective flat), but this collective runs two levels")
            }
            _ => {}
        }
        data.train.validate_vocab(config.vocab_size)?;
        if let Some(val) = &data.val {
            val.validate_vocab(config.vocab_size)?;
        }
        let (world, rank) = (comm.world(), comm.rank());
        let mut batch = opts.batch_plan(world)?;
        let global = batch.global;
        let sampler = WindowSampler::for_tokens(data.train.len(), opts.seq_len, global, opts.shuffle, opts.seed)?;
        be.check_step_shape(StepShape {
            batch: opts.batch_size,
            seq_len: opts.seq_len,
            width: config.n_embd,
            heads: config.n_head,
            vocab: config.vocab_size,
        })?;
        let model = Gpt2::new(&mut be, config, &params)?;
        model.zero_grads(&mut be);
        // ZeRO-1: a sharded rank keeps the moments of its own chunk only (the chunk its reduce-scatter
        // leaves it); checkpoints gather them into full tensors.
        let plan = BucketPlan::new(&model.layout, opts.bucket_elems);
        let owner = comm.owner();
        // Under --sync outer the inner steps do not communicate: every rank keeps its whole inner optimizer.
        let inner_update = match opts.sync.outer() {
            Some(_) => UpdateMode::Replicated,
            None => opts.update,
        };
        let mut opt = AdamW::for_ranges(&mut be, opts.adamw, plan.owned(inner_update, &owner))?;
        let mut mirror = buddy::mirror_for(&mut be, &opts, &plan, &owner)?;
        let (mut step, mut tokens_seen, mut resumed_sync_state) = (0, 0, None);
        let auto = opts.batch_split == BatchSplit::Auto && world > 1;
        let mut auto_split = auto.then(AutoSplit::default);
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
            if state.data_cursor % global as u64 != 0 {
                let theirs = match state.extra.get("global_batch") {
                    Some(g) => format!(" (it was trained with a global batch of {g}: pass --global-batch {g} to continue its data exactly)"),
                    None => String::new(),
                };
                bail!(
                    "--resume: the checkpoint stopped at window {}, which is not a whole number of this run's global \
                     batches of {global}{theirs}",
                    state.data_cursor
                );
            }
            be.upload(opt.m, &opt.cut(&state.m))?;
            be.upload(opt.v, &opt.cut(&state.v))?;
            if let Some(mirror) = &mirror {
                be.upload(mirror.m, &mirror.cut(&state.m))?;
                be.upload(mirror.v, &mirror.cut(&state.v))?;
            }
            step = state.data_cursor / global as u64;
            tokens_seen = state.tokens_seen;
            let mut sync_state = state.sync;
            let mut inner_step = None;
            if opts.sync.outer().is_some() {
                // Checked on every rank before any collective, so that all refuse alike.
                ensure!(
                    sync_state.contains_key(outer_sync::ANCHOR),
                    "--resume: the checkpoint holds no --sync outer state: it was written by a run of another \
                     --sync mode; resume it with that mode"
                );
                // Each rank's own inner moments (rank 0's are the checkpoint's moments).
                ensure!(
                    state.world_size == world,
                    "--resume: the --sync outer checkpoint holds the inner optimizer state of {} ranks; resume \
                     it with {0} ranks",
                    state.world_size
                );
                let (m_key, v_key) = (
                    format!("{}.rank{rank}", checkpointing::INNER_M),
                    format!("{}.rank{rank}", checkpointing::INNER_V),
                );
                if rank > 0 {
                    let m = sync_state
                        .get(&m_key)
                        .context("--resume: no inner moments for this rank")?;
                    let v = sync_state
                        .get(&v_key)
                        .context("--resume: no inner moments for this rank")?;
                    ensure!(
                        m.len() == opt.owned_len() && v.len() == opt.owned_len(),
                        "--resume: rank {rank}'s inner moments have {} and {} elements, the model {}",
                        m.len(),
                        v.len(),
                        opt.owned_len()
                    );
                    be.upload(opt.m, m)?;
                    be.upload(opt.v, v)?;
                }
                // Saved between outer steps: this rank's own parameters (the model files hold the shared ones).
                if let Some(local) = sync_state.get(&format!("{}.rank{rank}", checkpointing::INNER_P)) {
                    ensure!(
                        local.len() == model.layout.total,
                        "--resume: rank {rank}'s parameters have {} elements, the model {}",
                        local.len(),
                        model.layout.total
                    );
                    be.upload(model.params, local)?;
                }
                // This rank's round under way, for the outer sync, and its own inner optimizer step.
                let round = sync_state
                    .get(&format!("{}.rank{rank}", checkpointing::INNER_ROUND))
                    .cloned()
                    .context("--resume: no outer round for this rank")?;
                let round_start = sync_state.remove(&format!("{}.rank{rank}", checkpointing::INNER_ROUND_START));
                sync_state.retain(|k, _| !k.starts_with(checkpointing::INNER_PREFIX));
                if let Some(start) = round_start {
                    sync_state.insert(outer_sync::ROUND_START.to_string(), start);
                }
                ensure!(
                    round.len() == 5,
                    "--resume: this rank's outer round has {} values, not 5",
                    round.len()
                );
                inner_step = Some(checkpointing::u64_from_f32_pair([round[3], round[4]]));
                sync_state.insert(outer_sync::ROUND.to_string(), round[..3].to_vec());
            }
            resumed_sync_state = Some(sync_state);
            opt.step = match (inner_step, state.extra.get("optimizer_step")) {
                (Some(own), _) => own,
                (None, Some(s)) => s.parse().context("--resume: bad optimizer_step in trainer state")?,
                (None, None) => state.step,
            };
            if let Some(mirror) = &mut mirror {
                mirror.step = opt.step;
            }
            if auto && state.world_size == world {
                // The split the run had reached, and what it had measured, for the same ranks.
                if let Some(shares) = resumed_shares(&state.extra, global, world)? {
                    batch = BatchPlan::with_shares(global, shares)?;
                }
                auto_split = Some(AutoSplit::restore(&state.extra, world)?);
            }
        }
        let n = opts.batch_size * opts.seq_len;
        let reduction = Reduction::of(&batch, opts.seq_len);
        let sync: Box<dyn GradientSync<B>> = match opts.sync.outer() {
            Some(outer) => Box::new(outer_sync::OuterSync::new(
                outer,
                opts.update,
                owner.clone(),
                opts.steps,
            )),
            None => Box::new(
                BucketedSync::new(plan.clone(), opts.update, opts.overlap, owner.clone())
                    .reducing(reduction)
                    .with_buddy_mirrors(buddy::mirrors_wanted(&opts)),
            ),
        };
        let layout = buddy::StateLayout::first(world, owner.clone());
        let spikes = LossSpikeDetector::new(opts.loss_spike);
        let guard = ShardGuard::for_run(&opts, world);
        let wire = opts.wire;
        let mut trainer = Trainer {
            be,
            model,
            opt,
            opts,
            train: data.train,
            val: data.val,
            sampler,
            batch,
            reported_shares: None,
            auto_split,
            split_replay: None,
            step,
            tokens_seen,
            world,
            rank,
            owner,
            comm: comm_thread(comm, wire)?,
            plan,
            sync,
            inputs: vec![0; n],
            targets: vec![0; n],
            spikes,
            faults: FaultPlan::default(),
            armed_faults: FaultPlan::default(),
            guard,
            membership: Membership::initial(world),
            pending_change: None,
            resumed_sync_state,
            mirror,
            layout,
            last_agreed: None,
            reduced_step: None,
            sent_mark: 0,
        };
        trainer.replicate()?;
        // The start's comparison is not the first step's traffic.
        trainer.sent_mark = trainer.comm.sent_bytes();
        Ok(trainer)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The group's members and epoch.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Optimizer steps completed (skipped ones included): the 0-based index of the next step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Tokens consumed so far, over all ranks.
    pub fn tokens_seen(&self) -> u64 {
        self.tokens_seen
    }

    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Parameters in the flat layout.
    pub fn param_count(&self) -> usize {
        self.model.layout.total
    }

    /// Forward FLOPs per token at the run's sequence length.
    pub fn flops_per_token(&self) -> f64 {
        self.model.flops_per_token(self.opts.seq_len)
    }

    /// The backend's name (`cpu`, `wgpu`, `cuda`).
    pub fn backend_name(&self) -> String {
        self.be.name().to_string()
    }

    /// The parameters in the flat layout, current on every rank (any gather in flight is settled first).
    pub fn params(&mut self) -> Result<Vec<f32>> {
        self.settle_params()?;
        self.model.download_params(&mut self.be)
    }

    /// This rank's optimizer moments.
    pub fn moments(&mut self) -> Result<Moments> {
        let (mut m, mut v) = (vec![0f32; self.opt.m.len], vec![0f32; self.opt.v.len]);
        self.be.download(self.opt.m, &mut m)?;
        self.be.download(self.opt.v, &mut v)?;
        Ok(Moments {
            step: self.opt.step,
            owned: self.opt.owned.clone(),
            m,
            v,
        })
    }

    /// Arms a fault plan ([`fault_injection`]): the kinds that name this rank's gradient, compute or state
    /// fire at their steps. The transports apply the message kinds of the same plan.
    pub fn arm_faults(&mut self, plan: FaultPlan) {
        self.faults = plan.for_members(&self.membership.members);
        self.armed_faults = plan;
    }

    /// Replaces the synchronisation between steps: `wrap` receives the current one (to wrap or drop) and
    /// returns the new one, which must keep the ownership map this trainer's optimizer was cut by.
    pub fn wrap_sync(&mut self, wrap: impl FnOnce(Box<dyn GradientSync<B>>) -> Box<dyn GradientSync<B>>) -> Result<()> {
        self.settle_params()?;
        let placeholder: Box<dyn GradientSync<B>> = Box::new(BucketedSync::new(
            self.plan.clone(),
            self.opts.update,
            self.opts.overlap,
            self.owner.clone(),
        ));
        let current = std::mem::replace(&mut self.sync, placeholder);
        self.sync = wrap(current);
        Ok(())
    }

    /// Each rank's share of a step's global batch.
    pub fn batch_plan(&self) -> &BatchPlan {
        &self.batch
    }

    /// Tokens in one global batch.
    pub fn tokens_per_step(&self) -> u64 {
        (self.sampler.global_batch() * self.opts.seq_len) as u64
    }

    /// One optimizer step: local compute, synchronisation, update.
    pub fn train_step(&mut self) -> Result<StepMetrics> {
        let started = Instant::now();
        let local = self.local_compute()?;
        let agreed = self
            .sync
            .synchronise(&mut self.be, &self.comm, self.model.grads, local)?;
        let (lr, skipped, loss_spike_reference) = self.commit(agreed)?;
        if !skipped {
            self.sync.after_update(&mut self.be, &self.comm, self.model.params)?;
        }
        self.sync.end_of_step(&mut self.be, &self.comm, self.model.params)?;
        let outer = self.sync.take_round();
        let comm = self.sync.take_comm_time();
        let verify = self.opts.verify_every;
        let param_hash = match verify > 0 && self.step % verify == 0 {
            true => Some(self.verify_replicas()?),
            false => None,
        };
        self.be.synchronize()?;
        let batch_shares = self.shares_to_report();
        if let Some(shares) = self
            .auto_split
            .as_mut()
            .map(|a| a.finish_exchange(&self.batch))
            .transpose()?
            .flatten()
        {
            self.batch = BatchPlan::with_shares(self.batch.global, shares)?;
        }
        let step_ms = started.elapsed().as_secs_f64() * 1e3;
        let sent = self.comm.sent_bytes();
        let sent_bytes = sent.saturating_sub(self.sent_mark);
        self.sent_mark = sent;
        // One rank communicates nothing; what a clock saw there is bookkeeping.
        let ms = |d: std::time::Duration| if self.world > 1 { d.as_secs_f64() * 1e3 } else { 0.0 };
        Ok(StepMetrics {
            step: self.step,
            loss: agreed.loss,
            lr,
            grad_norm: agreed.grad_sq.sqrt(),
            tokens: self.tokens_seen,
            tokens_per_s: self.tokens_per_step() as f64 / (step_ms / 1e3),
            step_ms,
            comm_ms: ms(comm.busy),
            exposed_comm_ms: ms(comm.exposed),
            world_size: self.world,
            rank: self.rank,
            update: self.opts.update.as_str().to_string(),
            param_hash,
            val_loss: None,
            skipped,
            loss_spike_reference,
            batch_shares,
            membership: None,
            outer,
            sent_bytes,
        })
    }

    /// Uneven shares, on this process's first step and whenever they change (the metrics record the split).
    fn shares_to_report(&mut self) -> Option<Vec<usize>> {
        let shares = self.batch.equal.is_none().then(|| self.batch.shares.clone())?;
        let changed = self.reported_shares.as_ref() != Some(&shares);
        self.reported_shares = Some(shares.clone());
        changed.then_some(shares)
    }

    /// Follows a recorded `--batch-split auto` history instead of measuring: from each step of `history`
    /// (1-based, as the metrics count) the ranks use its shares, until the next. Every rank must be given the
    /// same history; a run given its own history reproduces its bits. Only for a run split `auto`, whose
    /// ring sums uneven shares.
    pub fn replay_splits(&mut self, history: std::collections::BTreeMap<u64, Vec<usize>>) -> Result<()> {
        ensure!(
            self.opts.batch_split == BatchSplit::Auto,
            "a split history can only be replayed by a run with --batch-split auto (it is {})",
            self.opts.batch_split
        );
        for (step, shares) in &history {
            BatchPlan::with_shares(self.batch.global, shares.clone())
                .ok()
                .filter(|_| shares.len() == self.world)
                .with_context(|| {
                    format!(
                        "the split history's shares {shares:?} at step {step} do not split a global batch of {}                          over {} ranks",
                        self.batch.global, self.world
                    )
                })?;
        }
        self.auto_split = None;
        self.split_replay = Some(history);
        Ok(())
    }

    /// Forward and backward over this rank's micro-batches of the step's global batch; the gradients
    /// accumulate on the device, scaled as the sync asks, and with overlap the sync starts on each gradient
    /// bucket as soon as the last backward has finished it.
    fn local_compute(&mut self) -> Result<LocalStep> {
        let started = Instant::now();
        if let Some(shares) = self.split_replay.as_ref().and_then(|h| h.get(&(self.step + 1))) {
            self.batch = BatchPlan::with_shares(self.batch.global, shares.clone())?;
        }
        let (b, t) = (self.opts.batch_size, self.opts.seq_len);
        let windows = self.sampler.windows_for_step(self.step);
        let micro = self.batch.micro_batches(&windows, self.rank, b)?;
        self.model.zero_grads(&mut self.be);
        self.reduced_step = None;
        if let Some(state) = self.resumed_sync_state.take() {
            self.sync.restore_state(&mut self.be, state)?;
        }
        self.sync.begin_step(&mut self.be, self.step);
        self.sync.clear_comm_time();
        if self.world > 1 {
            let step = self.step;
            let _ = self.comm.submit(move |c| {
                c.set_step(step);
                Ok(())
            });
        }
        if let Some(auto) = &mut self.auto_split {
            auto.start_exchange(&self.comm);
        }
        let tokens = self.batch.shares[self.rank] * t;
        let dloss = self.sync.loss_scale(tokens);
        self.freeze_if_due();
        // Fault injection: written once the last micro-batch's backward has finished its element.
        let mut inject = (self.faults)
            .nonfinite_at(self.rank, self.step + 1)
            .map(|value| PendingInjection::new(value, self.model.layout.total));
        let compute_delay = self.faults.compute_delay(self.rank);
        let speed = self.faults.speed_at(self.rank, self.step + 1);
        let mut loss_sum = 0.0;
        // Time spent waiting for parameters in flight: communication, not this rank's compute.
        let mut param_wait = std::time::Duration::ZERO;
        // The `speed` fault's stretch of a micro-batch: its compute (less its waits) × (100 / percent − 1).
        let stretch = |since: Instant, waited: std::time::Duration| {
            speed.map(|p| {
                since
                    .elapsed()
                    .saturating_sub(waited)
                    .mul_f64((100 - p) as f64 / p as f64)
            })
        };
        let mut last_micro = (started, std::time::Duration::ZERO);
        for (i, windows) in micro.iter().enumerate() {
            let micro_started = Instant::now();
            last_micro = (micro_started, param_wait);
            if let Some(delay) = compute_delay {
                std::thread::sleep(delay);
            }
            let rows = windows.len();
            let (inputs, targets) = (&mut self.inputs[..rows * t], &mut self.targets[..rows * t]);
            fill_batch(&self.train, windows, t, inputs, targets)?;
            let (sync, params) = (&mut self.sync, self.model.params);
            let mut await_params = |be: &mut B, upto| {
                let waiting = Instant::now();
                let done = sync.await_params(be, params, upto);
                param_wait += waiting.elapsed();
                done
            };
            let (inputs, targets) = (&*inputs, &*targets);
            let loss =
                (self.model).forward_train(&mut self.be, inputs, targets, rows, t, Some(dloss), &mut await_params)?;
            // Equal micro-batches average their means (the bits of runs before uneven shares); uneven ones
            // weigh each mean by its sequences.
            loss_sum += match self.batch.equal {
                Some(_) => loss,
                None => loss * rows as f64,
            };
            // Only the last micro-batch's backward finishes gradients (DDP's no_sync before it).
            if i + 1 == micro.len() && self.sync.overlaps_backward() {
                let (sync, comm, grads, inject) = (&mut self.sync, &self.comm, self.model.grads, &mut inject);
                sync.backward_starting(comm);
                self.model.backward_reporting(&mut self.be, dloss, &mut |be, from| {
                    write_if_final(inject, be, grads, from)?;
                    sync.gradients_final(be, comm, grads, from)
                })?;
            } else {
                self.model.backward(&mut self.be, dloss)?;
            }
            // Before the last micro-batch's backward has begun any read-back (a backend may reclaim one
            // that two synchronisations outlive), so the last one is stretched below.
            if speed.is_some() && i + 1 < micro.len() {
                self.be.synchronize()?;
                std::thread::sleep(stretch(micro_started, param_wait - last_micro.1).unwrap_or_default());
            }
        }
        // Without overlap the local gradients are final here, before any of them is read back.
        write_if_final(&mut inject, &mut self.be, self.model.grads, 0)?;
        if speed.is_some() || self.auto_split.is_some() {
            // The end of the last backward on the device: one synchronisation.
            self.be.synchronize()?;
            std::thread::sleep(stretch(last_micro.0, param_wait - last_micro.1).unwrap_or_default());
        }
        if let Some(auto) = &mut self.auto_split {
            // Less the waits for parameters: communication, not this rank's compute.
            let ms = started.elapsed().saturating_sub(param_wait).as_secs_f64() * 1e3;
            auto.record(ms, self.batch.shares[self.rank]);
        }
        let loss = match self.batch.equal {
            Some(_) => loss_sum / micro.len() as f64,
            None => loss_sum / self.batch.shares[self.rank] as f64,
        };
        Ok(LocalStep { loss, tokens })
    }

    /// The `freeze` fault: this rank's communication thread and compute thread both stop for the time given,
    /// so that it neither computes nor takes part in collectives.
    fn freeze_if_due(&mut self) {
        if let Some(duration) = self.faults.freeze_at(self.rank, self.step + 1) {
            let _ = self.comm.submit(move |_| {
                std::thread::sleep(duration);
                Ok(())
            });
            std::thread::sleep(duration);
        }
    }

    /// Applies the step under way with the scalars the ranks agreed on and counts it: committed, so the
    /// step counts even if what follows fails (an elastic re-form continues from here; a sharded one
    /// re-gathers the parameters from their owners). Returns the learning rate, whether the update was
    /// skipped, and the loss-spike reference.
    fn commit(&mut self, agreed: AgreedStep) -> Result<(f64, bool, Option<f64>)> {
        self.last_agreed = Some((self.step, agreed));
        let loss_spike_reference = self.spikes.observe(agreed.loss);
        let (lr, skipped) = self.update(agreed)?;
        self.step += 1;
        self.tokens_seen += self.tokens_per_step();
        Ok((lr, skipped, loss_spike_reference))
    }

    /// The update, decided from agreed values so that every rank decides alike (under `--sync outer` the
    /// values are each rank's own: a rank that stops on a non-finite value tells the others, whose next
    /// collective fails naming it): a non-finite loss or norm skips it (or stops the run), otherwise AdamW
    /// runs on what this rank owns (checked and recorded by the shard guard) and on its buddy mirror. The
    /// caller has the sync distribute the result. Returns the learning rate and whether it skipped.
    fn update(&mut self, agreed: AgreedStep) -> Result<(f64, bool)> {
        let grad_norm = agreed.grad_sq.sqrt();
        let lr = self.opts.schedule.lr_at(self.step);
        if !grad_norm.is_finite() || !agreed.loss.is_finite() {
            if self.opts.on_nonfinite == OnNonFinite::Abort {
                bail!(
                    "step {}: non-finite loss ({}) or gradient norm ({grad_norm}); stopping (--on-nonfinite abort)",
                    self.step + 1,
                    agreed.loss
                );
            }
            return Ok((lr, true));
        }
        let coef = clip_coefficient(grad_norm, self.opts.grad_clip);
        let (params, grads, step) = (self.model.params, self.model.grads, self.step + 1);
        self.guard.check(&mut self.be, params, &self.opt, self.rank, step)?;
        self.opt
            .update(&mut self.be, &self.model.layout, params, grads, lr, coef)?;
        if let Some(mirror) = &mut self.mirror {
            // The owner's chunk, computed here too: the all-gather then writes the owner's bits over it.
            mirror.update(&mut self.be, &self.model.layout, params, grads, lr, coef)?;
        }
        self.guard.record(&mut self.be, params, &self.opt, step)?;
        Ok((lr, false))
    }

    /// Puts any parameter all-gather still in flight on the device (see [`Trainer::params`]).
    pub fn settle_params(&mut self) -> Result<()> {
        self.sync.settle_params(&mut self.be, self.model.params)
    }

    /// When the last step's bucket collectives started against the end of its backward (syncs that trace).
    pub fn last_sync_trace(&self) -> Option<&SyncTrace> {
        self.sync.trace()
    }

    /// The gradient buckets, in the order backward finishes them, and who owns which chunk of each.
    pub fn bucket_plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Mean loss over the validation batches (the first windows of the validation stream, in order).
    /// Uses the parameters every rank holds alike: when the device holds this rank's own (`--sync outer`
    /// with `--outer-overlap on`), the shared ones are put there for the evaluation and this rank's own
    /// put back after it.
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        self.settle_params()?;
        let Some(shared) = self.sync.shared_params().map(<[f32]>::to_vec) else {
            return self.evaluate_device_params();
        };
        let own = self.model.download_params(&mut self.be)?;
        self.be.upload(self.model.params, &shared)?;
        let loss = self.evaluate_device_params();
        self.be.upload(self.model.params, &own)?;
        loss
    }

    /// The mean validation loss of the parameters on the device.
    fn evaluate_device_params(&mut self) -> Result<Option<f64>> {
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

    /// Each rank's smoothed compute time per sequence that `--batch-split auto` splits by, once the ranks
    /// have exchanged their first measurements.
    pub fn auto_split_estimates(&self) -> Option<&[auto_split::Estimate]> {
        self.auto_split.as_ref()?.estimates()
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
