//! [`Cluster`]: the sim as a library for a user's own tests. A builder over [`SimConfig`] and [`run`]
//! (it adds no runner of its own) that returns one [`StepRecord`] per step: every rank's loss and
//! parameter fingerprint, whether the step was skipped, the single-worker loss on the same global batch,
//! and, with [`Cluster::network`], the network model's prediction of the step's time on that fabric.
//!
//! `docs/sim-and-ci.md`'s section "Testing your training setup in CI" has an example test;
//! `sim/tests/cluster_api.rs` runs it and checks that the two still match.
//!
//! What the design guarantees, and so what [`ClusterRun::identity_guaranteed`] says: replicas hold
//! identical bits at every step whatever the world size, transport, overlap or network perturbation, and
//! with mixed backends under the sharded update (each chunk is computed by one owner and copied). Under
//! the replicated update every rank runs the whole AdamW on its own backend, so nothing promises that ranks
//! on different backends agree to the bit (ARCHITECTURE.md, "wgpu backend"); there the trainer's replica
//! check is off, and only ranks on the same backend (which apply the same reduced gradient with the same
//! kernels) and the losses are comparable.

use crate::faults::parse_faults;
use crate::netmodel::profile::Segment;
use crate::netmodel::{auto_shares, predict_split, ComputeProfile, Network, StepPrediction};
use crate::{run, SimConfig, SimReport, Transport};
use anyhow::{bail, Context, Result};
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::ring::DEFAULT_SUB_CHUNK;
use ringtrain::data::BatchSplit;
use ringtrain::elastic::ElasticRules;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{OuterOptions, SyncMode, TrainOptions, UpdateMode};
use std::collections::BTreeMap;
use std::time::Duration;

/// Forward and backward passes timed per layer when a network is given without [`Cluster::compute_ms`].
const MEASURED_PASSES: usize = 2;

/// Compute per micro-batch, in milliseconds, for the network prediction.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ComputeMs {
    forward: f64,
    backward: f64,
    update: f64,
}

/// A virtual cluster to run (see the module doc). Defaults: the `tiny` model, every rank on the CPU
/// backend, the sharded update with overlap, 2 sequences of 32 tokens per rank, seed 1337, the in-memory
/// transport, no faults, no network, a 30 s deadline per collective.
#[derive(Clone, Debug)]
pub struct Cluster {
    workers: usize,
    backends: Vec<BackendChoice>,
    model: ModelConfig,
    options: TrainOptions,
    transport: Transport,
    faults: Vec<String>,
    network: Option<Network>,
    compute: Option<ComputeMs>,
    deadline: Duration,
    /// Each worker's speed relative to the fastest (`None`: all alike).
    speeds: Option<Vec<f64>>,
    split_replay: Option<BTreeMap<u64, Vec<usize>>>,
}

impl Cluster {
    pub fn new(workers: usize) -> Self {
        let model = ModelConfig::tiny();
        let options = TrainOptions {
            batch_size: 2,
            seq_len: 32,
            eval_every: 0,
            ..TrainOptions::for_model(&model)
        };
        Cluster {
            workers,
            backends: vec![BackendChoice::Cpu],
            model,
            options,
            transport: Transport::Mem,
            faults: Vec::new(),
            network: None,
            compute: None,
            deadline: Duration::from_secs(30),
            speeds: None,
            split_replay: None,
        }
    }

    /// The model every rank trains from a fresh init; the sequence length is capped at its context.
    pub fn model(mut self, model: ModelConfig) -> Self {
        self.options.seq_len = self.options.seq_len.min(model.n_positions);
        self.model = model;
        self
    }

    /// The backend of each rank, cycled over the ranks (`[Cpu, Wgpu]` on 3 ranks: cpu, wgpu, cpu).
    pub fn backends(mut self, backends: &[BackendChoice]) -> Self {
        self.backends = backends.to_vec();
        self
    }

    pub fn update(mut self, update: UpdateMode) -> Self {
        self.options.update = update;
        self
    }

    /// Gradient buckets travel while backward runs (`true`) or after it; the bits are the same.
    pub fn overlap(mut self, overlap: bool) -> Self {
        self.options.overlap = overlap;
        self
    }

    /// Sequences per micro-batch per rank.
    pub fn batch(mut self, batch: usize) -> Self {
        self.options.batch_size = batch;
        self
    }

    pub fn seq_len(mut self, seq_len: usize) -> Self {
        self.options.seq_len = seq_len;
        self
    }

    /// Micro-batches per optimizer step.
    pub fn grad_accum(mut self, grad_accum: usize) -> Self {
        self.options.grad_accum = grad_accum;
        self
    }

    /// Gradient bucket size in f32 elements (the trainer's `--bucket-mb`, default 25 MiB).
    pub fn bucket_elems(mut self, elems: usize) -> Self {
        self.options.bucket_elems = elems;
        self
    }

    /// Seeds the init and the data order.
    pub fn seed(mut self, seed: u64) -> Self {
        self.options.seed = seed;
        self
    }

    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Elastic membership: a lost worker (`kill`, `drop`, or `freeze` past the deadline) leaves, and the
    /// survivors re-form the group under `rules` and go on (either update; in-memory transport).
    pub fn elastic(mut self, rules: ElasticRules) -> Self {
        self.options.elastic = Some(rules);
        self
    }

    /// `--sync outer` (DiLoCo) with `outer`: the replicas are compared after every outer step, and checked
    /// by the trainers there (`--verify-every` H).
    pub fn outer_sync(mut self, outer: OuterOptions) -> Self {
        self.options.sync = SyncMode::Outer(outer);
        self
    }

    /// Per-collective deadline: a hung ring fails after it instead of hanging the test.
    pub fn timeout(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Replaces the training options wholesale (the step count still comes from [`Cluster::run`]; the
    /// replica check from the guarantee, see [`ClusterRun::identity_guaranteed`]).
    pub fn options(mut self, options: TrainOptions) -> Self {
        self.options = options;
        self
    }

    /// A fault in `ringtrain-sim --fault` form (`nan=1:2`, `delay=5`, `flip=0:3:param`, ...; see
    /// [`crate::faults::FAULT_HELP`]). Refused here when it does not parse or repeats a kind; refused by
    /// [`Cluster::run`] when it does not fit the cluster (a rank or step out of range, a transport that
    /// cannot apply it).
    pub fn fault(mut self, spec: &str) -> Result<Self> {
        self.faults.push(spec.to_string());
        parse_faults(&self.faults)?;
        Ok(self)
    }

    /// Attaches the network model's prediction for this configuration on `spec` (a preset such as
    /// `10gbe`, or `latency=..,bandwidth=..`: see [`Network::parse`]) to every step.
    pub fn network(mut self, spec: &str) -> Result<Self> {
        self.network = Some(Network::parse(spec)?);
        Ok(self)
    }

    /// Given compute per micro-batch for the network prediction, in milliseconds. Without it the
    /// compute is measured on rank 0's backend, and the predicted times vary run to run with the machine;
    /// with it they are a pure function of the configuration.
    pub fn compute_ms(mut self, forward: f64, backward: f64, update: f64) -> Self {
        self.compute = Some(ComputeMs {
            forward,
            backward,
            update,
        });
        self
    }

    /// Each worker's compute speed relative to the fastest (for example `[1.0, 0.5, 0.5]`): a slower
    /// worker's compute is stretched by the `speed` fault, and the network prediction times each worker's
    /// share at its speed. With [`Cluster::batch_split`] `auto` the shares follow the speeds.
    pub fn worker_speeds(mut self, speeds: &[f64]) -> Result<Self> {
        if speeds.len() != self.workers {
            bail!(
                "Cluster::worker_speeds: {} speeds for {} workers",
                speeds.len(),
                self.workers
            );
        }
        if let Some(bad) = speeds.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            bail!("Cluster::worker_speeds: {bad} is not a positive speed");
        }
        let fastest = speeds.iter().copied().fold(0.0, f64::max);
        let speeds: Vec<f64> = speeds.iter().map(|s| s / fastest).collect();
        for (rank, speed) in speeds.iter().enumerate().filter(|(_, s)| **s < 1.0) {
            let percent = ((speed * 100.0).round() as u64).clamp(1, 99);
            self = self.fault(&format!("speed={rank}:{percent}"))?;
        }
        self.speeds = Some(speeds);
        Ok(self)
    }

    /// The global batch (sequences per step over all workers) and how it is divided (`even`, `auto` or
    /// weights such as `3,1`).
    pub fn batch_split(mut self, global: usize, split: &str) -> Result<Self> {
        self.options.global_batch = Some(global);
        self.options.batch_split = BatchSplit::parse(split).map_err(anyhow::Error::msg)?;
        Ok(self)
    }

    /// Follows a recorded `auto` split history (shares from each step, counted from 1) instead of
    /// measuring: the same history gives the same bits (`Trainer::replay_splits`).
    pub fn replay_splits(mut self, history: BTreeMap<u64, Vec<usize>>) -> Self {
        self.split_replay = Some(history);
        self
    }

    /// Whether the design guarantees bit-identical replicas for this configuration: always under the
    /// sharded update; under the replicated one only when every rank runs the same backend.
    pub fn identity_guaranteed(&self) -> bool {
        let used = &self.backends[..self.backends.len().min(self.workers.max(1))];
        self.options.update == UpdateMode::Sharded || used.windows(2).all(|w| w[0] == w[1])
    }

    /// The [`SimConfig`] that [`Cluster::run`] hands to [`run`] for `steps` steps.
    pub fn config(&self, steps: u64) -> Result<SimConfig> {
        if self.backends.is_empty() {
            bail!("Cluster::backends: at least one backend is needed");
        }
        let faults = parse_faults(&self.faults)?;
        let options = TrainOptions {
            // The trainer's own replica check aborts on a mismatch, so it runs where identity is promised:
            // under --sync outer at every outer step (computed on the host, the same on any backend).
            verify_every: match self.options.sync.outer() {
                Some(outer) => outer.every,
                None => u64::from(self.identity_guaranteed()),
            },
            ..self.options.clone().with_steps(steps)
        };
        Ok(SimConfig {
            workers: self.workers,
            backends: self.backends.clone(),
            model: self.model.clone(),
            options,
            transport: self.transport,
            faults,
            deadline: self.deadline,
            split_replay: self.split_replay.clone(),
        })
    }

    /// Trains `steps` steps on every rank and the single-worker reference; errors when any rank fails
    /// (every failing rank's error, each naming its rank), or when the configuration is refused.
    pub fn run(&self, steps: u64) -> Result<ClusterRun> {
        if steps == 0 {
            bail!("Cluster::run: at least one step");
        }
        let cfg = self.config(steps)?;
        // The run first: it refuses a bad cluster with the clearer errors.
        let report = run(&cfg)?;
        let predicted = self.predict(&cfg).context("the network prediction")?;
        Ok(ClusterRun::new(report, predicted, self.identity_guaranteed()))
    }

    /// The network model's steady-state step on the given fabric, if one was given.
    fn predict(&self, cfg: &SimConfig) -> Result<Option<StepPrediction>> {
        let Some(net) = &self.network else {
            return Ok(None);
        };
        let profile = match self.compute {
            Some(c) => ComputeProfile::given(&cfg.model, c.forward / 1e3, c.backward / 1e3, c.update / 1e3)?,
            None => {
                let choice = cfg.backends[0];
                let (mut be, _) = factory::open(choice, 0).with_context(|| format!("measuring on {choice}"))?;
                let (batch, seq) = (cfg.options.batch_size, cfg.options.seq_len);
                ComputeProfile::measure(&mut be, choice.as_str(), &cfg.model, batch, seq, MEASURED_PASSES)?
            }
        };
        let profile = if cfg.options.overlap {
            profile
        } else {
            without_overlap(profile)
        };
        let speeds = self.speeds.clone().unwrap_or_else(|| vec![1.0; cfg.workers]);
        let shares =
            (cfg.options.batch_split == BatchSplit::Auto).then(|| auto_shares(&cfg.options, &profile, &speeds));
        let (model, options) = (&cfg.model, &cfg.options);
        predict_split(
            model,
            options,
            net,
            &profile,
            DEFAULT_SUB_CHUNK,
            &speeds,
            shares.as_deref(),
        )
        .map(Some)
    }
}

/// The profile of `--overlap off` for the schedule model: one backward segment that finishes every
/// gradient (so every bucket is handed over after backward), and one forward segment that reads every
/// parameter (so the sharded gathers are all waited for before forward, where the trainer waits for them
/// at the end of the previous step: the same steady-state period).
fn without_overlap(profile: ComputeProfile) -> ComputeProfile {
    let total = profile.forward.iter().map(|s| s.bound).max().unwrap_or(0);
    ComputeProfile {
        forward: vec![Segment {
            bound: total,
            seconds: profile.forward_s(),
        }],
        backward: vec![Segment {
            bound: 0,
            seconds: profile.backward_s(),
        }],
        update_s: profile.update_s,
        source: format!("{} (overlap off)", profile.source),
    }
}

/// One step of a [`ClusterRun`].
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// Counted from 1.
    pub step: u64,
    /// Each worker's loss (the global batch's mean, so the same on every rank up to the reduction's bits);
    /// NaN for a worker of an elastic run that did not record the step (it had left, or caught up past it).
    pub losses: Vec<f64>,
    /// Each worker's parameter fingerprint after the step; empty where its loss is NaN for that reason.
    pub hashes: Vec<String>,
    /// Some rank skipped the update for a non-finite loss or gradient norm (they all skip together).
    pub skipped: bool,
    /// One CPU worker on the same global batch, without the injected faults.
    pub single_worker_loss: f64,
    /// The network model's steady-state step for this configuration, with [`Cluster::network`].
    pub predicted: Option<StepPrediction>,
}

/// What [`Cluster::run`] returns.
#[derive(Clone, Debug)]
pub struct ClusterRun {
    pub steps: Vec<StepRecord>,
    /// See [`Cluster::identity_guaranteed`].
    pub identity_guaranteed: bool,
    /// The runner's own report (per-rank traces, the fingerprint right after an injected flip).
    pub report: SimReport,
}

impl ClusterRun {
    fn new(report: SimReport, predicted: Option<StepPrediction>, identity_guaranteed: bool) -> Self {
        let steps = (0..report.single_worker_losses.len())
            .map(|i| {
                let step = i as u64 + 1;
                StepRecord {
                    step,
                    losses: report
                        .ranks
                        .iter()
                        .map(|r| r.at(step).map_or(f64::NAN, |a| a.0))
                        .collect(),
                    hashes: report
                        .ranks
                        .iter()
                        .map(|r| r.at(step).map_or_else(String::new, |a| a.1.to_string()))
                        .collect(),
                    skipped: report.ranks.iter().any(|r| r.skipped.contains(&step)),
                    single_worker_loss: report.single_worker_losses[i],
                    predicted,
                }
            })
            .collect();
        ClusterRun {
            steps,
            identity_guaranteed,
            report,
        }
    }

    /// Every rank held the same parameter bits after every step.
    pub fn replicas_identical(&self) -> bool {
        self.first_divergence().is_none()
    }

    /// The first (step, rank) whose fingerprint differs from rank 0's.
    pub fn first_divergence(&self) -> Option<(u64, usize)> {
        self.report.first_divergence().map(|(step, rank)| (step as u64, rank))
    }

    /// Largest |rank 0's loss − the single worker's| over the steps.
    pub fn max_loss_gap_to_single_worker(&self) -> f64 {
        self.report.max_loss_gap()
    }

    /// The parameter fingerprint after the last step (of the first worker that recorded it).
    pub fn final_hash(&self) -> &str {
        let last = self.steps.last();
        last.and_then(|s| s.hashes.iter().find(|h| !h.is_empty()))
            .map_or("", |h| h.as_str())
    }

    /// The split history of uneven shares (from rank 0's metrics): the step (from 1) of each change and the
    /// shares from then on; what [`Cluster::replay_splits`] takes back.
    pub fn split_history(&self) -> BTreeMap<u64, Vec<usize>> {
        self.report
            .ranks
            .first()
            .map_or_else(BTreeMap::new, |r| r.splits.iter().cloned().collect())
    }
}
