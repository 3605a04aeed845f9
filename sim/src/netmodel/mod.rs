//! Timing-only prediction: how long a data-parallel step of N ranks would take on a given fabric, without
//! computing anyone's gradients.
//!
//! - [`network`]: links (latency α, bandwidth β, CPU per byte γ), two-tier fabrics and named presets;
//! - [`ring`]: one ring collective in virtual time, message by message, with sub-chunk pipelining;
//! - [`profile`]: per-layer forward/backward and update times, measured on a backend or given;
//! - [`schedule`]: the trainer's step (bucket hand-over during backward, one collective at a time,
//!   sharded gathers overlapping the next forward) on every rank.
//!
//! The communication pattern comes from the real trainer: its `BucketPlan`, its update mode and the
//! transport's sub-chunk size. Predictions are not yet validated against measured multi-host runs.

pub mod network;
pub mod profile;
pub mod ring;
pub mod schedule;

use anyhow::{bail, Result};
pub use network::Network;
pub use profile::ComputeProfile;
pub use ring::Layout;
use ringtrain::collective::Wire;
use ringtrain::data::BatchPlan;
use ringtrain::model::{ModelConfig, ParamLayout};
use ringtrain::trainer::auto_split::best_split;
use ringtrain::trainer::buckets::BucketPlan;
use ringtrain::trainer::TrainOptions;
pub use schedule::StepPrediction;

/// Seconds one all-reduce of `elems` f32 values sent in `wire` takes over `world` ranks arranged as
/// `layout` that all start it together, as `ringtrain bench allreduce` times it: the rings' messages in
/// virtual time, and with `shared-cores` no sooner than the machine's CPU work (every rank's CPU per byte
/// sent) over its cores.
pub fn predict_all_reduce(
    net: &Network,
    layout: Layout,
    world: usize,
    elems: usize,
    sub_chunk: usize,
    wire: Wire,
) -> f64 {
    let shape = ring::RingShape {
        kind: ring::RingKind::AllReduce,
        elems,
        elem_bytes: 4,
        wire,
        sub_chunk,
    };
    let done = ring::simulate_layout(net, layout, &shape, &vec![0.0; world]);
    let ring_s = done.iter().copied().fold(0.0, f64::max);
    let cpu_floor_s = net.shared_cores.map_or(0.0, |cores| {
        let per_machine = net.ranks_per_machine(world).max(1);
        let rank_cpu = |r: usize| {
            let sent: usize = shape.sends(world, r).iter().map(|m| m.bytes).sum();
            sent as f64 * net.rank_cpu_per_byte(r, world)
        };
        // The busiest machine's CPU work: the sum over its ranks (at a host's edge a rank sends between
        // hosts, inside it over shared memory).
        let busiest = match layout {
            ring::Layout::Flat => (0..world.div_ceil(per_machine))
                .map(|m| {
                    (m * per_machine..((m + 1) * per_machine).min(world))
                        .map(rank_cpu)
                        .sum::<f64>()
                })
                .fold(0.0, f64::max),
            two => per_machine as f64 * two.send_cpu_s(&shape, world, net),
        };
        busiest / cores as f64
    });
    ring_s.max(cpu_floor_s)
}

/// The largest world the model is meant for (the ring simulation is `O(N²)` per collective).
pub const MAX_WORKERS: usize = 4096;

/// Predicts one steady-state step of `workers` ranks training `model` with `options` on `net`, every rank
/// at the profile's speed.
pub fn predict_step(
    model: &ModelConfig,
    options: &TrainOptions,
    workers: usize,
    net: &Network,
    profile: &ComputeProfile,
    sub_chunk: usize,
) -> Result<StepPrediction> {
    predict_split(model, options, net, profile, sub_chunk, &vec![1.0; workers], None)
}

/// Predicts one steady-state step of ranks running at `speeds` (relative to the profile; one per rank),
/// each taking its share of the global batch: `shares` when given, else the split of `options`
/// (`auto` starts even; [`auto_shares`] gives where it settles).
pub fn predict_split(
    model: &ModelConfig,
    options: &TrainOptions,
    net: &Network,
    profile: &ComputeProfile,
    sub_chunk: usize,
    speeds: &[f64],
    shares: Option<&[usize]>,
) -> Result<StepPrediction> {
    let workers = speeds.len();
    if workers == 0 || workers > MAX_WORKERS {
        bail!("--workers {workers} must be between 1 and {MAX_WORKERS} with --timing-only");
    }
    if sub_chunk == 0 {
        bail!("the sub-chunk size must be at least one element");
    }
    if let Some(bad) = speeds.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
        bail!("--worker-speed {bad} is not a positive number");
    }
    let mut batch = options.batch_plan(workers)?;
    if let Some(shares) = shares {
        batch = BatchPlan::with_shares(batch.global, shares.to_vec())?;
    }
    let windows: Vec<u64> = (0..batch.global as u64).collect();
    let b = options.batch_size;
    let loads = (0..workers)
        .map(|rank| {
            let micro = batch.micro_batches(&windows, rank, b)?;
            Ok(micro.iter().map(|m| m.len() as f64 / b as f64 / speeds[rank]).collect())
        })
        .collect::<Result<Vec<Vec<f64>>>>()?;
    let plan = schedule::StepPlan {
        buckets: BucketPlan::new(&ParamLayout::new(model), options.bucket_elems).buckets,
        update: options.update,
        world: workers,
        loads,
        sub_chunk,
        tokens_per_step: batch.global * options.seq_len,
        layout: Layout::resolve(options.collective, net, workers).map_err(anyhow::Error::msg)?,
        wire: options.wire,
    };
    Ok(schedule::predict(net, &plan, profile))
}

/// The shares `--batch-split auto` settles on for ranks at `speeds`: the trainer's best integer split
/// for times per sequence of the profile's forward and backward over its batch, divided by each speed.
pub fn auto_shares(options: &TrainOptions, profile: &ComputeProfile, speeds: &[f64]) -> Vec<usize> {
    let per_sequence = (profile.forward_s() + profile.backward_s()) / options.batch_size as f64;
    let costs: Vec<f64> = speeds.iter().map(|s| per_sequence / s).collect();
    best_split(&costs, options.global_batch_for(speeds.len()))
}
