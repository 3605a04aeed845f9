//! `ringtrain-sim --workers N [--update sharded|replicated] [--steps S] [--transport mem|quic|shm] [--fault ...]
//! [--on-nonfinite skip|abort]`

use anyhow::{bail, Context, Result};
use clap::Parser;
use ringtrain::backend::factory::BackendChoice;
use ringtrain::collective::{CollectiveChoice, Wire};
use ringtrain::data::BatchSplit;
use ringtrain::elastic::{ElasticRules, Quorum};
use ringtrain::metrics::read_metrics;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{
    OnNonFinite, OuterOptions, SyncMode, TrainOptions, UpdateMode, DEFAULT_OUTER_EVERY, DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
};
use ringtrain_sim::faults::{parse_faults, FAULT_HELP};
use ringtrain_sim::{run, SimConfig, Transport};
use std::process::ExitCode;
use std::time::Duration;

// The --timing-only branch: flags to the library's network model (binary-only, next to the model).
#[path = "netmodel/cli.rs"]
mod timing;

#[derive(Parser)]
#[command(
    name = "ringtrain-sim",
    about = "N virtual data-parallel workers in one process, with a replica audit"
)]
struct Cli {
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Backend of each worker, comma-separated and cycled over the ranks: cpu, wgpu, cuda
    #[arg(long, default_value = "cpu")]
    backends: String,
    #[arg(long, default_value = "sharded")]
    update: String,
    #[arg(long, default_value_t = 10)]
    steps: u64,
    #[arg(long, default_value = "mem")]
    transport: String,
    /// The flat ring or the two-level one over the --network's hosts (hosts-of), as the trainer's
    /// --collective; only with --timing-only (the workers of a sim run share one host)
    #[arg(long, value_enum, default_value_t = CollectiveChoice::Auto)]
    collective: CollectiveChoice,
    /// delay, reorder, slow, drop, kill, nan, inf, flip (repeatable; --help lists their forms and outcomes)
    #[arg(long, long_help = FAULT_HELP)]
    fault: Vec<String>,
    /// What every rank does at a step whose loss or gradient norm is not finite: skip it, or abort
    #[arg(long, default_value = "skip")]
    on_nonfinite: String,
    #[arg(long, default_value = "tiny")]
    model: String,
    #[arg(long, default_value_t = 2)]
    batch_size: usize,
    #[arg(long, default_value_t = 32)]
    seq_len: usize,
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Sequences per step over all workers [default: workers x --batch-size x --grad-accum]
    #[arg(long)]
    global_batch: Option<usize>,
    /// How the global batch is divided: even, auto, or one weight per worker such as 3,1
    #[arg(long, default_value = "even")]
    batch_split: String,
    /// Each worker's compute speed, comma-separated and relative to the fastest (1,0.5,0.5): a slower
    /// worker's compute is stretched (the `speed` fault); --timing-only predicts the step with the
    /// even split and with the one `auto` settles on
    #[arg(long)]
    worker_speed: Option<String>,
    /// Follow the split history recorded in a metrics file (`train --metrics`, its batch_shares) instead
    /// of measuring; needs --batch-split auto
    #[arg(long)]
    replay_splits: Option<std::path::PathBuf>,
    /// Survivors of a lost worker (kill, drop, or freeze past --timeout) re-form the group and go on
    /// (either update, --transport mem)
    #[arg(long)]
    elastic: bool,
    /// With --elastic: who may go on after a loss, a strict majority of the last membership, or any
    /// survivors (then both sides of a partition may continue)
    #[arg(long, default_value = "majority")]
    quorum: String,
    /// With --elastic: stop cleanly below this many workers
    #[arg(long, default_value_t = 1)]
    min_ranks: usize,
    /// every-step, or outer (DiLoCo: each worker trains alone for --outer-every steps between outer
    /// Nesterov steps on the averaged change of the parameters; the replicas must agree after each)
    #[arg(long, default_value = "every-step")]
    sync: String,
    /// With --sync outer: inner steps per outer step
    #[arg(long, default_value_t = DEFAULT_OUTER_EVERY)]
    outer_every: u64,
    /// With --sync outer: the outer learning rate
    #[arg(long, default_value_t = DEFAULT_OUTER_LR)]
    outer_lr: f64,
    /// With --sync outer: the outer Nesterov momentum
    #[arg(long, default_value_t = DEFAULT_OUTER_MOMENTUM)]
    outer_momentum: f64,
    /// With --sync outer: on (each outer step runs while the next round trains, applied one round late) or off
    #[arg(long, default_value = "off")]
    outer_overlap: String,
    /// What the reduced gradients travel in (as train's --wire)
    #[arg(long, value_enum, default_value_t = Wire::F32)]
    wire: Wire,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Per-collective deadline, seconds
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Predict step times on a modelled fabric instead of training (needs --network)
    #[arg(long)]
    timing_only: bool,
    /// Fabric for --timing-only: a preset (shm, 10gbe, 100gbe-quic, ib-hdr100, wan, dgx) or
    /// latency=..,bandwidth=..[,cpu-per-byte=..][,hosts-of=..,intra-latency=..,intra-bandwidth=..
    /// [,intra-cpu-per-byte=..]]
    /// [,shared-cores=C[,rank-cpu-per-byte=..]] (C cores shared by a host's ranks, or by every rank
    /// without hosts-of; a rank's CPU per byte sent on all its threads, default cpu-per-byte)
    #[arg(long)]
    network: Option<String>,
    /// Given compute per micro-batch instead of measuring it: forward=MS,backward=MS[,update=MS]
    #[arg(long)]
    compute_ms: Option<String>,
    /// Gradient bucket size in MiB for --timing-only (the trainer's --bucket-mb)
    #[arg(long)]
    bucket_mb: Option<f64>,
    /// With --timing-only: predict one f32 all-reduce of each of these sizes (B, KiB, MiB, GiB) over
    /// --workers ranks, as `ringtrain bench allreduce` measures it, instead of a training step
    #[arg(long)]
    allreduce_size: Option<String>,
}

/// `--worker-speed`: one positive number per worker, scaled so that the fastest is 1.
fn parse_speeds(text: &str, workers: usize) -> Result<Vec<f64>> {
    let speeds = text
        .split(',')
        .map(|s| match s.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => bail!("--worker-speed {text:?}: {s:?} is not a positive number"),
        })
        .collect::<Result<Vec<f64>>>()?;
    if speeds.len() != workers {
        bail!(
            "--worker-speed gives {} speeds for {workers} workers; give one per worker",
            speeds.len()
        );
    }
    let fastest = speeds.iter().copied().fold(0.0, f64::max);
    Ok(speeds.iter().map(|s| s / fastest).collect())
}

/// The `speed` faults that make the workers of a full run compute at `speeds` (whole percents, at least 1).
fn speed_faults(speeds: &[f64]) -> Vec<String> {
    speeds
        .iter()
        .enumerate()
        .filter(|(_, s)| **s < 1.0)
        .map(|(rank, s)| format!("speed={rank}:{}", ((s * 100.0).round() as u64).clamp(1, 99)))
        .collect()
}

/// The split history a metrics file recorded: the shares from each step that changed them.
fn recorded_splits(path: &std::path::Path) -> Result<std::collections::BTreeMap<u64, Vec<usize>>> {
    let records = read_metrics(path).with_context(|| format!("--replay-splits {}", path.display()))?;
    let history: std::collections::BTreeMap<u64, Vec<usize>> = records
        .into_iter()
        .filter_map(|m| Some((m.step, m.batch_shares?)))
        .collect();
    if history.is_empty() {
        bail!(
            "--replay-splits {}: the metrics record no batch_shares (a run with --batch-split auto records them)",
            path.display()
        );
    }
    Ok(history)
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<ExitCode> {
    let cli = Cli::parse();
    let backends = cli
        .backends
        .split(',')
        .map(|b| match b.trim() {
            "cpu" => Ok(BackendChoice::Cpu),
            "wgpu" => Ok(BackendChoice::Wgpu),
            "cuda" => Ok(BackendChoice::Cuda),
            bad => bail!("--backends: unknown backend {bad:?} (expected cpu, wgpu or cuda)"),
        })
        .collect::<Result<Vec<_>>>()?;
    let update = match cli.update.as_str() {
        "sharded" => UpdateMode::Sharded,
        "replicated" => UpdateMode::Replicated,
        other => bail!("--update {other:?}: expected sharded or replicated"),
    };
    let transport = match cli.transport.as_str() {
        "mem" => Transport::Mem,
        "quic" => Transport::Quic,
        "shm" => Transport::Shm,
        other => bail!("--transport {other:?}: expected mem, quic or shm"),
    };
    if !(cli.timeout.is_finite() && cli.timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds");
    }
    let on_nonfinite = match cli.on_nonfinite.as_str() {
        "skip" => OnNonFinite::Skip,
        "abort" => OnNonFinite::Abort,
        other => bail!("--on-nonfinite {other:?}: expected skip or abort"),
    };
    let model = ModelConfig::preset(&cli.model)?;
    let speeds = match &cli.worker_speed {
        Some(text) => Some(parse_speeds(text, cli.workers)?),
        None => None,
    };
    let sync = match cli.sync.as_str() {
        "every-step" => SyncMode::EveryStep,
        "outer" => SyncMode::Outer(OuterOptions {
            every: cli.outer_every,
            lr: cli.outer_lr,
            momentum: cli.outer_momentum,
            overlap: match cli.outer_overlap.as_str() {
                "on" => true,
                "off" => false,
                other => bail!("--outer-overlap {other:?}: expected on or off"),
            },
        }),
        other => bail!("--sync {other:?}: expected every-step or outer"),
    };
    let options = TrainOptions {
        sync,
        wire: cli.wire,
        batch_size: cli.batch_size,
        seq_len: cli.seq_len,
        grad_accum: cli.grad_accum,
        global_batch: cli.global_batch,
        batch_split: BatchSplit::parse(&cli.batch_split).map_err(anyhow::Error::msg)?,
        update,
        seed: cli.seed,
        eval_every: 0,
        // Under --sync outer the replicas agree at the outer steps only.
        verify_every: sync.outer().map_or(1, |o| o.every),
        on_nonfinite,
        collective: cli.collective,
        elastic: match cli.elastic {
            true => Some(ElasticRules {
                quorum: Quorum::parse(&cli.quorum).map_err(anyhow::Error::msg)?,
                min_ranks: cli.min_ranks,
            }),
            false => None,
        },
        ..TrainOptions::for_model(&model).with_steps(cli.steps)
    };
    if cli.timing_only
        || cli.network.is_some()
        || cli.compute_ms.is_some()
        || cli.bucket_mb.is_some()
        || cli.allreduce_size.is_some()
    {
        return timing::run(&cli, &model, &options, &backends, speeds.as_deref());
    }
    if cli.collective == CollectiveChoice::Hierarchical {
        bail!("--collective hierarchical needs --timing-only: the workers of a sim run share one host");
    }
    let mut fault_specs = cli.fault.clone();
    fault_specs.extend(speeds.iter().flat_map(|s| speed_faults(s)));
    let faults = parse_faults(&fault_specs)?;
    let cfg = SimConfig {
        workers: cli.workers,
        backends,
        model,
        options,
        transport,
        faults,
        deadline: Duration::from_secs_f64(cli.timeout),
        split_replay: match &cli.replay_splits {
            Some(path) => Some(recorded_splits(path)?),
            None => None,
        },
    };
    let report = run(&cfg)?;
    for (i, single) in report.single_worker_losses.iter().enumerate() {
        let step = i as u64 + 1;
        // The first worker that recorded the step (in an elastic run, worker 0 may have left).
        let Some((loss, hash)) = report.ranks.iter().find_map(|r| r.at(step)) else {
            continue;
        };
        let world = report.ranks.iter().filter(|r| r.at(step).is_some()).count();
        println!(
            "step {step:>4} | loss {loss:.6} | single worker {single:.6} | replica hash {} | {world} worker(s)",
            &hash[..16]
        );
    }
    for trace in &report.ranks {
        for change in &trace.memberships {
            println!(
                "member {}: epoch {}: lost {:?}, joined {:?}, members {:?}, continued from step {}, recovered in \
                 {:.0} ms",
                trace.member,
                change.epoch,
                change.lost,
                change.joined,
                change.members,
                change.resumed_from_step,
                change.recovery_ms
            );
        }
        if let Some(why) = &trace.left {
            println!("member {} left the job: {why}", trace.member);
        }
    }
    for (rank, trace) in report.ranks.iter().enumerate() {
        if !trace.skipped.is_empty() {
            println!(
                "rank {rank} skipped step(s) {:?} (non-finite gradient norm or loss)",
                trace.skipped
            );
        }
        if let Some(hash) = &trace.hash_after_flip {
            println!(
                "rank {rank}: replica hash right after the injected flip {}",
                &hash[..16]
            );
        }
    }
    if !cli.fault.is_empty() || cli.worker_speed.is_some() {
        println!("(the single-worker reference runs without the injected faults)");
    }
    if !report.ranks[0].splits.is_empty() {
        let history: Vec<String> = report.ranks[0]
            .splits
            .iter()
            .map(|(step, shares)| {
                let shares: Vec<String> = shares.iter().map(usize::to_string).collect();
                format!("step {step}: {}", shares.join("+"))
            })
            .collect();
        println!("split history | {}", history.join(" | "));
    }
    match report.first_divergence() {
        None => {
            // Under --sync outer a worker's loss is its own inner loss, not comparable with one worker's.
            let agreement = match sync.outer() {
                Some(o) => format!("bit-identical after every outer step (every {} steps)", o.every),
                None => format!(
                    "bit-identical at every step; max |loss - single worker loss| = {:.2e}",
                    report.max_loss_gap()
                ),
            };
            println!(
                "{} workers ({} update, {:?} transport): replicas {agreement}",
                cli.workers, cli.update, transport
            );
            Ok(ExitCode::SUCCESS)
        }
        Some((step, rank)) => {
            eprintln!("replicas diverged: rank {rank} differs from rank 0 after step {step}");
            Ok(ExitCode::FAILURE)
        }
    }
}
