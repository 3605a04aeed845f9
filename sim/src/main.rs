//! `ringtrain-sim --workers N [--update sharded|replicated] [--steps S] [--transport mem|quic] [--fault ...]
//! [--on-nonfinite skip|abort]`

use anyhow::{bail, Result};
use clap::Parser;
use ringtrain::backend::factory::BackendChoice;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{OnNonFinite, TrainOptions, UpdateMode};
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
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// Per-collective deadline, seconds
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Predict step times on a modelled fabric instead of training (needs --network)
    #[arg(long)]
    timing_only: bool,
    /// Fabric for --timing-only: a preset (10gbe, 100gbe-quic, ib-hdr100, wan, dgx) or
    /// latency=..,bandwidth=..[,cpu-per-byte=..][,hosts-of=..,intra-latency=..,intra-bandwidth=..]
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
        other => bail!("--transport {other:?}: expected mem or quic"),
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
    let options = TrainOptions {
        batch_size: cli.batch_size,
        seq_len: cli.seq_len,
        grad_accum: cli.grad_accum,
        update,
        seed: cli.seed,
        eval_every: 0,
        verify_every: 1,
        on_nonfinite,
        ..TrainOptions::for_model(&model).with_steps(cli.steps)
    };
    if cli.timing_only || cli.network.is_some() || cli.compute_ms.is_some() || cli.bucket_mb.is_some() {
        return timing::run(&cli, &model, &options, &backends);
    }
    let faults = parse_faults(&cli.fault)?;
    let cfg = SimConfig {
        workers: cli.workers,
        backends,
        model,
        options,
        transport,
        faults,
        deadline: Duration::from_secs_f64(cli.timeout),
    };
    let report = run(&cfg)?;
    for (step, loss) in report.ranks[0].losses.iter().enumerate() {
        println!(
            "step {:>4} | loss {loss:.6} | single worker {:.6} | replica hash {}",
            step + 1,
            report.single_worker_losses[step],
            &report.ranks[0].hashes[step][..16]
        );
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
    if !cli.fault.is_empty() {
        println!("(the single-worker reference runs without the injected faults)");
    }
    match report.first_divergence() {
        None => {
            println!(
                "{} workers ({} update, {:?} transport): replicas bit-identical at every step; max |loss - single worker loss| = {:.2e}",
                cli.workers,
                cli.update,
                transport,
                report.max_loss_gap()
            );
            Ok(ExitCode::SUCCESS)
        }
        Some((step, rank)) => {
            eprintln!("replicas diverged: rank {rank} differs from rank 0 after step {step}");
            Ok(ExitCode::FAILURE)
        }
    }
}
