//! ringtrain-sim: N virtual workers in one process, each a real [`Trainer`] on its own backend, joined by
//! the in-memory ring (or QUIC on loopback). After every step each rank fingerprints its parameters and
//! the harness checks that all replicas hold identical bits; it also runs the same global batch on a
//! single worker (on the CPU backend) and reports how far the losses are apart (float rounding only: the
//! sum over ranks reassociates the mean). Ranks may run different backends (`cpu`, `wgpu`): with the
//! sharded update the replicas stay bit-identical even then, because every parameter chunk is computed by
//! one owner and copied byte for byte.

use anyhow::{bail, Context, Result};
use ringtrain::backend::cpu::CpuBackend;
use ringtrain::backend::wgpu::{AdapterSelection, WgpuBackend};
use ringtrain::backend::Backend;
use ringtrain::cli::args::TrainArgs;
use ringtrain::collective::mem::{mem_cluster, Faults, MemOptions};
use ringtrain::collective::quic::{QuicCollective, QuicConfig};
use ringtrain::collective::Collective;
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{single_process, ModelSource, Trainer};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Mem,
    Quic,
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub workers: usize,
    /// Backend of each rank, cycled over the ranks: `cpu` or `wgpu`.
    pub backends: Vec<String>,
    pub model: ModelConfig,
    /// Per-rank train flags (batch size, seq len, grad accum, steps, update mode, ...).
    pub args: TrainArgs,
    pub transport: Transport,
    pub faults: Faults,
    pub deadline: Duration,
}

/// What one rank saw: per-step loss and parameter fingerprint.
#[derive(Clone, Debug, PartialEq)]
pub struct RankTrace {
    pub losses: Vec<f64>,
    pub hashes: Vec<String>,
}

#[derive(Clone, Debug)]
pub struct SimReport {
    pub ranks: Vec<RankTrace>,
    /// Losses of one worker running the whole global batch (world 1, batch × workers).
    pub single_worker_losses: Vec<f64>,
}

impl SimReport {
    /// First (step, rank) whose fingerprint differs from rank 0's.
    pub fn first_divergence(&self) -> Option<(usize, usize)> {
        let reference = &self.ranks[0].hashes;
        for step in 0..reference.len() {
            for (rank, trace) in self.ranks.iter().enumerate() {
                if trace.hashes.get(step) != reference.get(step) {
                    return Some((step + 1, rank));
                }
            }
        }
        None
    }

    /// Largest |loss(N workers) - loss(1 worker, same global batch)| over the steps.
    pub fn max_loss_gap(&self) -> f64 {
        self.ranks[0]
            .losses
            .iter()
            .zip(&self.single_worker_losses)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
    }
}

fn build_trainer<B: Backend>(
    be: B,
    cfg: &SimConfig,
    args: &TrainArgs,
    world: usize,
    comm: Box<dyn Collective>,
) -> Result<Trainer<B>> {
    let opts = args.resolve(&cfg.model, world)?;
    let data = load_splits(args.data.as_deref().unwrap_or("synthetic"), None, TokenizerKind::Byte)?;
    Trainer::new(be, ModelSource::Fresh(cfg.model.clone()), data, opts, comm)
}

fn run_rank(cfg: &SimConfig, comm: Box<dyn Collective>) -> Result<RankTrace> {
    let rank = comm.rank();
    let backend = cfg
        .backends
        .get(rank % cfg.backends.len().max(1))
        .map_or("cpu", String::as_str);
    match backend {
        "cpu" => run_rank_on(CpuBackend::<f32>::new(), cfg, comm),
        "wgpu" => {
            let be = WgpuBackend::new(AdapterSelection::any()).with_context(|| format!("rank {rank}: wgpu"))?;
            run_rank_on(be, cfg, comm)
        }
        other => bail!("rank {rank}: unknown backend {other:?} (expected cpu or wgpu)"),
    }
}

fn run_rank_on<B: Backend>(be: B, cfg: &SimConfig, comm: Box<dyn Collective>) -> Result<RankTrace> {
    let rank = comm.rank();
    let mut trainer = build_trainer(be, cfg, &cfg.args, cfg.workers, comm).with_context(|| format!("rank {rank}"))?;
    let mut trace = RankTrace {
        losses: Vec::new(),
        hashes: Vec::new(),
    };
    while trainer.step < trainer.opts.steps {
        match trainer.train_step() {
            Ok(m) => {
                trace.losses.push(m.loss);
                trace.hashes.push(trainer.param_hash()?);
            }
            Err(e) => {
                trainer.abort(&format!("{e:#}"));
                return Err(e.context(format!("rank {rank}, step {}", trainer.step + 1)));
            }
        }
    }
    Ok(trace)
}

fn connect_quic(rank: usize, world: usize, port: u16, deadline: Duration) -> Result<Box<dyn Collective>> {
    let master = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut q = QuicConfig::new(rank, world, master);
    q.timeout = deadline;
    q.secret = Some(b"ringtrain-sim".to_vec());
    Ok(Box::new(QuicCollective::connect(q)?))
}

/// Runs the virtual cluster and the single-worker reference.
pub fn run(cfg: &SimConfig) -> Result<SimReport> {
    if cfg.workers == 0 || cfg.workers > 64 {
        bail!("--workers {} must be between 1 and 64", cfg.workers);
    }
    let results: Vec<Result<RankTrace>> = match cfg.transport {
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
                    .map(|c| s.spawn(move || run_rank(cfg, Box::new(c))))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| bail!("a rank thread panicked")))
                    .collect()
            })
        }
        Transport::Quic => {
            let port = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..cfg.workers)
                    .map(|rank| s.spawn(move || run_rank(cfg, connect_quic(rank, cfg.workers, port, cfg.deadline)?)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| bail!("a rank thread panicked")))
                    .collect()
            })
        }
    };
    let mut ranks = Vec::with_capacity(results.len());
    for r in results {
        ranks.push(r?);
    }
    // The reference: one worker, the same global batch.
    let mut single = cfg.args.clone();
    single.batch_size = Some(cfg.args.batch_size.unwrap_or(4) * cfg.workers);
    let mut trainer = build_trainer(CpuBackend::<f32>::new(), cfg, &single, 1, single_process())?;
    let mut single_worker_losses = Vec::new();
    while trainer.step < trainer.opts.steps {
        single_worker_losses.push(trainer.train_step()?.loss);
    }
    Ok(SimReport {
        ranks,
        single_worker_losses,
    })
}
