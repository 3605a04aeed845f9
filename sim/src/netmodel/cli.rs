//! `ringtrain-sim --timing-only --network NET [--compute-ms ...]`: translates the flags into the network
//! model's inputs and prints the prediction. Part of the binary, not of the library.

use super::Cli;
use anyhow::{bail, Context, Result};
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::ring::DEFAULT_SUB_CHUNK;
use ringtrain::collective::Wire;
use ringtrain::data::BatchSplit;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{bucket_elems, TrainOptions};
use ringtrain_sim::netmodel::{
    auto_shares, predict_all_reduce, predict_split, ComputeProfile, Layout, Network, StepPrediction,
};
use std::process::ExitCode;

/// `--allreduce-size`: one predicted all-reduce of f32 values sent in `wire` per size, in `bench
/// allreduce`'s units.
fn predict_all_reduces(net: &Network, layout: Layout, workers: usize, sizes: &str, wire: Wire) -> Result<ExitCode> {
    let sizes = ringtrain::collective::bench::parse_sizes(sizes).map_err(anyhow::Error::msg)?;
    let ring = match layout {
        Layout::Flat => "flat ring".to_string(),
        Layout::TwoLevel { per_host } => format!("two-level ring ({} hosts x {per_host} ranks)", workers / per_host),
    };
    println!(
        "network {} | {workers} ranks, {ring} | all-reduce (f32 sent as {wire}), predicted",
        net.name
    );
    println!("{:>12} {:>12} {:>12}", "bytes", "time(us)", "busbw(GB/s)");
    for bytes in sizes {
        let secs = predict_all_reduce(net, layout, workers, bytes / 4, DEFAULT_SUB_CHUNK, wire);
        let busbw = match workers {
            1 => 0.0,
            n => (bytes / 4 * 4) as f64 / secs / 1e9 * 2.0 * (n - 1) as f64 / n as f64,
        };
        println!("{bytes:>12} {:>12.1} {busbw:>12.3}", secs * 1e6);
    }
    Ok(ExitCode::SUCCESS)
}

/// Forward and backward passes timed per layer when no `--compute-ms` is given.
const MEASURED_PASSES: usize = 2;

pub fn run(
    cli: &Cli,
    model: &ModelConfig,
    options: &TrainOptions,
    backends: &[BackendChoice],
    speeds: Option<&[f64]>,
) -> Result<ExitCode> {
    if !cli.timing_only {
        bail!("--network, --compute-ms and --bucket-mb only apply with --timing-only");
    }
    let Some(spec) = &cli.network else {
        bail!("--timing-only needs --network (a preset or latency=..,bandwidth=..)")
    };
    if !cli.fault.is_empty() || cli.transport != "mem" {
        bail!("--timing-only models the fabric given by --network: --fault and --transport do not apply");
    }
    let net = Network::parse(spec)?;
    if let Some(sizes) = &cli.allreduce_size {
        let layout = Layout::resolve(options.collective, &net, cli.workers).map_err(anyhow::Error::msg)?;
        return predict_all_reduces(&net, layout, cli.workers, sizes, options.wire);
    }
    let mut options = options.clone();
    if let Some(mb) = cli.bucket_mb {
        if !(mb.is_finite() && mb > 0.0) {
            bail!("--bucket-mb must be a positive number of MiB");
        }
        options.bucket_elems = bucket_elems(mb);
    }
    let profile = match &cli.compute_ms {
        Some(given) => given_profile(model, given)?,
        None => {
            let choice = backends.first().copied().unwrap_or(BackendChoice::Cpu);
            let (mut be, _) = factory::open(choice, 0).with_context(|| format!("{choice}"))?;
            eprintln!("measuring per-layer compute on {choice} ({MEASURED_PASSES} passes after a warm-up)...");
            ComputeProfile::measure(
                &mut be,
                &choice.to_string(),
                model,
                options.batch_size,
                options.seq_len,
                MEASURED_PASSES,
            )?
        }
    };
    let speeds = speeds.map_or_else(|| vec![1.0; cli.workers], <[f64]>::to_vec);
    let p = predict_split(model, &options, &net, &profile, DEFAULT_SUB_CHUNK, &speeds, None)?;
    println!("network {} | compute {}", net.name, profile.source);
    println!(
        "compute profile | forward {:.1} ms | backward {:.1} ms | update {:.1} ms (all parameters) per micro-batch",
        profile.forward_s() * 1e3,
        profile.backward_s() * 1e3,
        profile.update_s * 1e3
    );
    println!(
        "predicted step | workers {} | {} update | compute {:.1} ms | communication {:.1} ms | exposed communication {:.1} ms | step {:.1} ms | {:.0} tokens/s",
        cli.workers,
        options.update.as_str(),
        p.compute_s * 1e3,
        p.comm_s * 1e3,
        p.exposed_s * 1e3,
        p.step_s * 1e3,
        p.tokens_per_s
    );
    if let Some(outer) = options.sync.outer() {
        let o = predict_outer(&net, &options, cli.workers, model.param_count(), outer.every, &p)?;
        println!(
            "predicted --sync outer | every {} steps | inner step {:.1} ms | outer exchange {:.1} ms | mean step {:.1} ms | {:.0} tokens/s ({:.2}x every-step)",
            outer.every,
            o.inner_s * 1e3,
            o.exchange_s * 1e3,
            o.mean_step_s * 1e3,
            o.tokens_per_s,
            o.tokens_per_s / p.tokens_per_s
        );
    }
    if cli.worker_speed.is_some() || options.batch_split == BatchSplit::Auto {
        let shares = auto_shares(&options, &profile, &speeds);
        let with_shares = |shares: &[usize]| {
            predict_split(
                model,
                &options,
                &net,
                &profile,
                DEFAULT_SUB_CHUNK,
                &speeds,
                Some(shares),
            )
        };
        let auto = with_shares(&shares)?;
        let even = with_shares(&options.batch_plan(cli.workers)?.shares)?;
        let speeds: Vec<String> = speeds.iter().map(|s| format!("{s:.2}")).collect();
        let shares: Vec<String> = shares.iter().map(usize::to_string).collect();
        let fixed = match &options.batch_split {
            BatchSplit::Auto => "even".to_string(),
            split => split.to_string(),
        };
        println!(
            "worker speeds {} | {fixed} split: step {:.1} ms, {:.0} tokens/s | auto split {}: step {:.1} ms, {:.0} tokens/s ({:.2}x)",
            speeds.join(","),
            even.step_s * 1e3,
            even.tokens_per_s,
            shares.join("+"),
            auto.step_s * 1e3,
            auto.tokens_per_s,
            even.step_s / auto.step_s
        );
    }
    if let Some(cores) = net.shared_cores {
        println!(
            "shared cores | {} ranks per machine of {cores} cores | compute slowed {:.2}x | the machine's CPU work allows a step of at least {:.1} ms",
            net.ranks_per_machine(cli.workers),
            net.compute_slowdown(cli.workers),
            p.cpu_floor_s * 1e3
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A step of `--sync outer`, averaged over a round.
struct OuterPrediction {
    /// An inner step: the every-step prediction's compute, with no communication.
    inner_s: f64,
    /// The outer step's exchange: one all-reduce of the parameters (the sharded update's reduce-scatter and
    /// all-gather move the same bytes), exposed at the end of its step. The host's element-wise work on Δ
    /// is left out.
    exchange_s: f64,
    mean_step_s: f64,
    tokens_per_s: f64,
}

/// `--sync outer` every `every` steps: inner steps of `every_step`'s compute, and one exchange of the
/// `params` parameters per round, exposed, or beside the next round with `--outer-overlap on`.
fn predict_outer(
    net: &Network,
    options: &TrainOptions,
    workers: usize,
    params: usize,
    every: u64,
    every_step: &StepPrediction,
) -> Result<OuterPrediction> {
    let layout = Layout::resolve(options.collective, net, workers).map_err(anyhow::Error::msg)?;
    let exchange_s = match workers {
        1 => 0.0,
        _ => predict_all_reduce(net, layout, workers, params, DEFAULT_SUB_CHUNK, options.wire),
    };
    let inner_s = every_step.compute_s;
    // With --outer-overlap on, a round's exchange runs beside the next round's inner steps: a round takes
    // the longer of the two.
    let round_s = match options.sync.outer().is_some_and(|o| o.overlap) {
        true => (inner_s * every as f64).max(exchange_s),
        false => inner_s * every as f64 + exchange_s,
    };
    let mean_step_s = round_s / every as f64;
    let tokens = every_step.tokens_per_s * every_step.step_s;
    Ok(OuterPrediction {
        inner_s,
        exchange_s,
        mean_step_s,
        tokens_per_s: tokens / mean_step_s,
    })
}

/// `forward=MS,backward=MS[,update=MS]`.
fn given_profile(model: &ModelConfig, spec: &str) -> Result<ComputeProfile> {
    let (mut forward, mut backward, mut update) = (None, None, 0.0);
    for field in spec.split(',') {
        let Some((key, value)) = field.split_once('=') else {
            bail!("--compute-ms {spec:?}: field {field:?} is not KEY=MS")
        };
        let ms: f64 = value
            .trim()
            .parse()
            .with_context(|| format!("--compute-ms {key}={value}: not a number of milliseconds"))?;
        match key.trim() {
            "forward" => forward = Some(ms / 1e3),
            "backward" => backward = Some(ms / 1e3),
            "update" => update = ms / 1e3,
            other => bail!("--compute-ms: unknown field {other:?} (expected forward, backward, update)"),
        }
    }
    let (Some(f), Some(b)) = (forward, backward) else {
        bail!("--compute-ms {spec:?}: forward= and backward= are both required")
    };
    ComputeProfile::given(model, f, b, update)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round of H steps pays one exchange: the mean step falls from compute + exchange (H = 1) towards
    /// the compute alone, and tokens/s rise with it.
    #[test]
    fn outer_mode_spreads_one_exchange_over_a_round() {
        let net = Network::parse("latency=50us,bandwidth=6.25MB").unwrap();
        let options = TrainOptions::for_model(&ModelConfig::small());
        let every_step = StepPrediction {
            compute_s: 0.1,
            comm_s: 0.5,
            exposed_s: 0.5,
            step_s: 0.6,
            tokens_per_s: 2048.0 / 0.6,
            cpu_floor_s: 0.0,
        };
        let params = ModelConfig::small().param_count();
        let one = predict_outer(&net, &options, 2, params, 1, &every_step).unwrap();
        let fifty = predict_outer(&net, &options, 2, params, 50, &every_step).unwrap();
        // One all-reduce of 4 bytes per parameter over 2 ranks at 6.25 MB/s.
        let wire = 4.0 * params as f64 / 6.25e6;
        assert!(
            (one.exchange_s - wire).abs() < 0.05 * wire,
            "{} against {wire}",
            one.exchange_s
        );
        assert!((one.mean_step_s - (0.1 + one.exchange_s)).abs() < 1e-12);
        assert!((fifty.mean_step_s - (0.1 + one.exchange_s / 50.0)).abs() < 1e-12);
        assert!((fifty.tokens_per_s * fifty.mean_step_s - 2048.0).abs() < 1e-6);
        assert_eq!(
            predict_outer(&net, &options, 1, params, 50, &every_step)
                .unwrap()
                .exchange_s,
            0.0
        );
        // Overlapped, the exchange hides behind a round long enough to hold it, and bounds a shorter one.
        let overlapped = TrainOptions {
            sync: ringtrain::trainer::SyncMode::Outer(ringtrain::trainer::OuterOptions {
                every: 50,
                lr: 0.7,
                momentum: 0.9,
                overlap: true,
            }),
            ..options.clone()
        };
        let hidden = predict_outer(&net, &overlapped, 2, params, 50, &every_step).unwrap();
        assert!((hidden.mean_step_s - 0.1).abs() < 1e-12);
        let bound = predict_outer(&net, &overlapped, 2, params, 1, &every_step).unwrap();
        assert!((bound.mean_step_s - bound.exchange_s).abs() < 1e-12);
    }
}
