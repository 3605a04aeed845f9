//! ringtrain-sim: N virtual workers in one process, each a real [`Trainer`] on its own backend, joined by
//! the in-memory ring (or QUIC on loopback). After every step each rank fingerprints its parameters and
//! the harness checks that all replicas hold identical bits; it also runs the same global batch on a
//! single worker (on the CPU backend) and reports how far the losses are apart (float rounding only: the
//! sum over ranks reassociates the mean). Ranks may run different backends (`cpu`, `wgpu`, and `cuda` with
//! the `cuda` feature): with the sharded update the replicas stay bit-identical even then, because every
//! parameter chunk is computed by one owner and copied byte for byte. `--fault` injects faults inside the process ([`faults`]).

pub mod cluster;
pub mod elastic;
pub mod netmodel;

pub use cluster::{Cluster, ClusterRun, StepRecord};

use anyhow::{bail, Context, Result};
use elastic::Board;
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::Backend;
use ringtrain::collective::mem::single_rank;
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::collective::shm::LinkTransport;
use ringtrain::collective::Collective;
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::dist::{self, JoinOptions, LaunchEnv, LaunchSource, NetworkEnv};
use ringtrain::fault_plan::{Fault, FaultPlan};
use ringtrain::metrics::StepMetrics;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, RunObserver, TrainOptions, Trainer};
use std::net::Ipv4Addr;
use std::time::Duration;

pub mod faults;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Mem,
    /// QUIC on every link.
    Quic,
    /// QUIC's control plane with every ring link through shared memory (`--transport shm`).
    Shm,
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub workers: usize,
    /// Backend of each rank, cycled over the ranks (every wgpu rank on the first usable adapter).
    pub backends: Vec<BackendChoice>,
    pub model: ModelConfig,
    /// Options of every rank (batch size, seq len, grad accum, steps, update mode, ...); the single-worker
    /// reference runs them with `workers` times the batch.
    pub options: TrainOptions,
    pub transport: Transport,
    /// Injected faults: each applied by the transport or the trainer that owns its kind
    /// ([`faults::validate`] refuses what the chosen transport cannot apply).
    pub faults: FaultPlan,
    pub deadline: Duration,
    /// A recorded `--batch-split auto` history every rank follows instead of measuring (shares from each
    /// step, counted from 1); see `Trainer::replay_splits`.
    pub split_replay: Option<std::collections::BTreeMap<u64, Vec<usize>>>,
}

/// What one worker saw: per-step loss and parameter fingerprint. Elastic runs: a worker lost on the way
/// has no entries after it left, and one that caught up from a survivor ahead of it has none for the step
/// it took over; `steps` says which step each entry is.
#[derive(Clone, Debug, PartialEq)]
pub struct RankTrace {
    /// The worker's rank in the first membership (its member id).
    pub member: u32,
    /// The step (from 1) of each entry of `losses` and `hashes`.
    pub steps: Vec<u64>,
    pub losses: Vec<f64>,
    /// The fingerprint of the parameters on the worker's device.
    pub hashes: Vec<String>,
    /// The fingerprint of the parameters every replica must hold alike: the device's, except where the
    /// worker holds its own by design (`--sync outer` between outer steps, and with `--outer-overlap on`
    /// after them), where it is the shared parameters' (`Trainer::shared_param_hash`).
    pub shared_hashes: Vec<String>,
    /// Steps (counted from 1) skipped for a non-finite loss or gradient norm.
    pub skipped: Vec<u64>,
    /// With a `flip` on this rank: its parameter fingerprint right after the flip.
    pub hash_after_flip: Option<String>,
    /// Uneven shares: the step (from 1) of each change of split, and the shares from then on.
    pub splits: Vec<(u64, Vec<usize>)>,
    /// Elastic runs: each change of membership this worker went through.
    pub memberships: Vec<ringtrain::elastic::MembershipChange>,
    /// Elastic runs: why this worker left the job before its end (killed, or lost as frozen), if it did.
    pub left: Option<String>,
    /// The parameter fingerprint at the end of the run, for a worker that finished it (one that caught up
    /// past the last step has no entry for it in `hashes`).
    pub final_hash: Option<String>,
}

impl RankTrace {
    fn new(member: u32) -> RankTrace {
        RankTrace {
            member,
            steps: Vec::new(),
            losses: Vec::new(),
            hashes: Vec::new(),
            shared_hashes: Vec::new(),
            skipped: Vec::new(),
            hash_after_flip: None,
            splits: Vec::new(),
            memberships: Vec::new(),
            left: None,
            final_hash: None,
        }
    }

    /// This worker's (loss, fingerprint) after step `step` (from 1), if it recorded that step.
    pub fn at(&self, step: u64) -> Option<(f64, &str)> {
        let i = self.steps.iter().position(|&s| s == step)?;
        Some((self.losses[i], self.hashes[i].as_str()))
    }

    /// This worker's shared-parameter fingerprint after step `step` (from 1), if it recorded that step.
    pub fn shared_at(&self, step: u64) -> Option<&str> {
        let i = self.steps.iter().position(|&s| s == step)?;
        Some(self.shared_hashes[i].as_str())
    }
}

#[derive(Clone, Debug)]
pub struct SimReport {
    pub ranks: Vec<RankTrace>,
    /// Losses of one worker running the whole global batch (world 1, batch × workers).
    pub single_worker_losses: Vec<f64>,
    /// The steps at which the replicas must agree: every step, or every `--outer-every`-th under
    /// `--sync outer` (between outer steps each worker's parameters are its own by design).
    pub agree_every: u64,
}

impl SimReport {
    /// The last step any worker recorded.
    pub fn last_step(&self) -> u64 {
        self.ranks
            .iter()
            .filter_map(|r| r.steps.last().copied())
            .max()
            .unwrap_or(0)
    }

    /// First (step, worker) whose shared-parameter fingerprint differs from the first worker that recorded
    /// that step.
    pub fn first_divergence(&self) -> Option<(usize, usize)> {
        let every = self.agree_every.max(1) as usize;
        for step in (every..=self.last_step() as usize).step_by(every).map(|s| s as u64) {
            let mut reference = None;
            for (rank, trace) in self.ranks.iter().enumerate() {
                let Some(hash) = trace.shared_at(step) else { continue };
                match reference {
                    None => reference = Some(hash),
                    Some(r) if r != hash => return Some((step as usize, rank)),
                    Some(_) => {}
                }
            }
        }
        // The end, for every worker that finished.
        let mut finished = self
            .ranks
            .iter()
            .enumerate()
            .filter_map(|(r, t)| Some((r, t.final_hash.as_ref()?)));
        let (_, first) = finished.next()?;
        finished
            .find(|(_, hash)| *hash != first)
            .map(|(rank, _)| (self.last_step() as usize, rank))
    }

    /// Largest |loss(N workers) - loss(1 worker, same global batch)| over the steps (each step's loss from
    /// the first worker that recorded it).
    pub fn max_loss_gap(&self) -> f64 {
        self.single_worker_losses
            .iter()
            .enumerate()
            .filter_map(|(i, single)| {
                let loss = self.ranks.iter().find_map(|r| r.at(i as u64 + 1))?.0;
                Some((loss - single).abs())
            })
            .fold(0.0, f64::max)
    }
}

fn build_trainer<B: Backend>(
    be: B,
    cfg: &SimConfig,
    options: &TrainOptions,
    comm: Box<dyn Collective>,
) -> Result<Trainer<B>> {
    let data = load_splits("synthetic", None, TokenizerKind::Byte)?;
    // The sim compares training, not validation: it evaluates and saves nothing.
    let options = TrainOptions {
        eval_batches: 0,
        save: None,
        ..options.clone()
    };
    Trainer::new(be, ModelSource::Fresh(cfg.model.clone()), data, options, comm)
}

fn run_rank(cfg: &SimConfig, comm: Box<dyn Collective>, board: Option<&Board>) -> Result<RankTrace> {
    let rank = comm.rank();
    let choice = cfg
        .backends
        .get(rank % cfg.backends.len().max(1))
        .copied()
        .unwrap_or(BackendChoice::Cpu);
    let (be, _) = factory::open(choice, 0).with_context(|| format!("rank {rank}: {choice}"))?;
    let mut trainer = build_trainer(be, cfg, &cfg.options, comm).with_context(|| format!("rank {rank}"))?;
    trainer.arm_faults(cfg.faults.clone());
    let mut recorder = Recorder {
        trace: RankTrace::new(rank as u32),
    };
    if let Some(history) = &cfg.split_replay {
        trainer
            .replay_splits(history.clone())
            .with_context(|| format!("rank {rank}"))?;
    }
    let Some(board) = board else {
        let run = trainer.run(&mut recorder);
        run.with_context(|| format!("rank {rank}, step {}", trainer.step() + 1))?;
        recorder.trace.final_hash = Some(trainer.param_hash()?);
        return Ok(recorder.trace);
    };
    let member = rank as u32;
    let run = trainer.run_elastic(&mut recorder, &mut board.member(member));
    elastic_outcome(cfg, board, member, &mut trainer, recorder, run.map(|_| ()))
}

/// What an elastic worker's run came to: its trace when it finished (the board is told) or left as the plan
/// says (killed, or gone on without: the run's outcome, not its failure), else its error.
fn elastic_outcome<B: Backend>(
    cfg: &SimConfig,
    board: &Board,
    member: u32,
    trainer: &mut Trainer<B>,
    mut recorder: Recorder,
    run: Result<()>,
) -> Result<RankTrace> {
    match run {
        Ok(()) => {
            board.finished(member, trainer.step());
            recorder.trace.final_hash = Some(trainer.param_hash()?);
            Ok(recorder.trace)
        }
        Err(e) if left_the_job(&cfg.faults, member, &e) => {
            recorder.trace.left = Some(format!("step {}: {e:#}", trainer.step() + 1));
            Ok(recorder.trace)
        }
        Err(e) => Err(e.context(format!(
            "member {member} (rank {}), step {}",
            trainer.rank(),
            trainer.step() + 1
        ))),
    }
}

/// Whether `error` ended member `member`'s part in an elastic run as planned: its injected death, or the
/// board's refusal of a member the group had already lost.
fn left_the_job(faults: &FaultPlan, member: u32, error: &anyhow::Error) -> bool {
    let text = format!("{error:#}");
    let killed = faults
        .faults()
        .iter()
        .any(|f| matches!(f, Fault::Kill { rank, .. } | Fault::Drop { rank, .. } if *rank == member as usize))
        && text.contains("injected");
    killed || text.contains("is no longer part of the job")
}

/// What the sim records of one rank after every step: the loss, the replica fingerprint and the skips; and
/// after the rank's `flip` fault, the fingerprint right after it.
struct Recorder {
    trace: RankTrace,
}

impl<B: Backend> RunObserver<B> for Recorder {
    fn step(&mut self, trainer: &mut Trainer<B>, m: &StepMetrics) -> Result<()> {
        self.trace.steps.push(m.step);
        self.trace.losses.push(m.loss);
        let device = trainer.param_hash()?;
        let shared = match trainer.holds_own_params() {
            true => trainer.shared_param_hash()?,
            false => device.clone(),
        };
        self.trace.hashes.push(device);
        self.trace.shared_hashes.push(shared);
        if m.skipped {
            self.trace.skipped.push(m.step);
        }
        if let Some(shares) = &m.batch_shares {
            self.trace.splits.push((m.step, shares.clone()));
        }
        if let Some(change) = &m.membership {
            self.trace.memberships.push(change.clone());
        }
        Ok(())
    }

    fn state_corrupted(&mut self, trainer: &mut Trainer<B>, _fault: &Fault) -> Result<()> {
        self.trace.hash_after_flip = Some(trainer.param_hash()?);
        Ok(())
    }
}

/// Rank `rank` joining the QUIC ring on loopback through the one join path a launched process takes
/// ([`dist::join_with`]), with the job's faults armed.
fn join_quic(cfg: &SimConfig, rank: usize, port: u16) -> Result<Box<dyn Collective>> {
    let launch = LaunchEnv {
        rank,
        world_size: cfg.workers,
        local_rank: rank,
        local_world_size: cfg.workers,
        master_addr: Ipv4Addr::LOCALHOST.to_string(),
        master_port: port,
        source: LaunchSource::Flags,
    };
    let opts = JoinOptions {
        config_hash: cfg.options.job_hash(&cfg.model, cfg.workers),
        secret: Some(b"ringtrain-sim".to_vec()),
        timeout: cfg.deadline,
        faults: cfg.faults.clone(),
        transport: match cfg.transport {
            Transport::Shm => LinkTransport::Shm,
            _ => LinkTransport::Quic,
        },
        collective: cfg.options.collective,
        epoch: 0,
        elastic: false,
    };
    dist::join_with(&launch, &opts, &NetworkEnv::default())
}

/// Runs the virtual cluster and the single-worker reference.
pub fn run(cfg: &SimConfig) -> Result<SimReport> {
    if cfg.workers == 0 || cfg.workers > 64 {
        bail!("--workers {} must be between 1 and 64", cfg.workers);
    }
    faults::validate(&cfg.faults, cfg.transport, cfg.workers, &cfg.model, &cfg.options)?;
    let results: Vec<Result<RankTrace>> = match cfg.transport {
        Transport::Mem if cfg.options.elastic.is_some() => run_elastic(cfg),
        Transport::Quic | Transport::Shm if cfg.options.elastic.is_some() => {
            bail!("--elastic runs over --transport mem only: the QUIC transport cannot re-form its ring yet")
        }
        Transport::Mem => {
            let opts = MemOptions {
                deadline: cfg.deadline,
                faults: cfg.faults.clone(),
                ..MemOptions::default()
            };
            let ranks = mem_cluster(cfg.workers, opts);
            std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .into_iter()
                    .map(|c| s.spawn(move || run_rank(cfg, Box::new(c), None)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| bail!("a rank thread panicked")))
                    .collect()
            })
        }
        Transport::Quic | Transport::Shm => {
            let port = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..cfg.workers)
                    .map(|rank| s.spawn(move || run_rank(cfg, join_quic(cfg, rank, port)?, None)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| bail!("a rank thread panicked")))
                    .collect()
            })
        }
    };
    // Every rank's failure, not only the first: a fault's outcome is what each rank did.
    let mut ranks = Vec::with_capacity(results.len());
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(trace) => ranks.push(trace),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    // The reference: one worker, the same global batch.
    let single = TrainOptions {
        batch_size: cfg.options.global_batch.unwrap_or(cfg.options.batch_size * cfg.workers),
        global_batch: None,
        batch_split: ringtrain::data::BatchSplit::Even,
        ..cfg.options.clone()
    };
    let (cpu, _) = factory::open(BackendChoice::Cpu, 0)?;
    let mut trainer = build_trainer(cpu, cfg, &single, single_rank())?;
    let mut losses = Losses::default();
    trainer.run(&mut losses)?;
    let single_worker_losses = losses.0;
    Ok(SimReport {
        ranks,
        single_worker_losses,
        agree_every: cfg.options.sync.outer().map_or(1, |o| o.every),
    })
}

/// The workers of an elastic run over the in-memory ring, sharing one [`Board`].
fn run_elastic(cfg: &SimConfig) -> Vec<Result<RankTrace>> {
    let rules = cfg.options.elastic.unwrap_or_default();
    let ring = MemOptions {
        deadline: cfg.deadline,
        faults: cfg.faults.clone(),
        ..MemOptions::default()
    };
    let board = Board::new(cfg.workers, rules, ring, cfg.deadline);
    let group = board.first_group();
    let board = &board;
    std::thread::scope(|s| {
        let mut handles: Vec<_> = group
            .into_iter()
            .map(|c| s.spawn(move || run_rank(cfg, c, Some(board))))
            .collect();
        if cfg.faults.join_before().is_some() {
            handles.push(s.spawn(move || run_joiner(cfg, board, cfg.workers as u32)));
        }
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a rank thread panicked")))
            .collect()
    })
}

/// The worker a `join=STEP` fault adds: it waits to be admitted, takes the running members' state through
/// the catch-up, and trains on with them.
fn run_joiner(cfg: &SimConfig, board: &Board, member: u32) -> Result<RankTrace> {
    let admitted = board.admit(member)?;
    let choice = cfg.backends[member as usize % cfg.backends.len().max(1)];
    let (be, _) = factory::open(choice, 0).with_context(|| format!("member {member}: {choice}"))?;
    // The job's global batch, which a trainer of one rank would otherwise size for itself.
    let global = cfg.options.global_batch_for(cfg.workers);
    let options = TrainOptions {
        global_batch: Some(global),
        grad_accum: 1,
        ..cfg.options.clone()
    };
    let mut trainer = build_trainer(be, cfg, &options, single_rank()).with_context(|| format!("member {member}"))?;
    trainer.arm_faults(cfg.faults.clone());
    let mut recorder = Recorder {
        trace: RankTrace::new(member),
    };
    let joined = trainer.join_running(admitted.comm, admitted.membership);
    let run = joined.and_then(|_| trainer.run_elastic(&mut recorder, &mut board.member(member)));
    elastic_outcome(cfg, board, member, &mut trainer, recorder, run.map(|_| ()))
}

/// The losses of a run, step by step.
#[derive(Default)]
struct Losses(Vec<f64>);

impl<B: Backend> RunObserver<B> for Losses {
    fn step(&mut self, _trainer: &mut Trainer<B>, m: &StepMetrics) -> Result<()> {
        self.0.push(m.loss);
        Ok(())
    }
}
