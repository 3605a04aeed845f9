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
use ringtrain::model::{ModelConfig, ParamLayout};
use ringtrain::trainer::buckets::BucketPlan;
use ringtrain::trainer::TrainOptions;
pub use schedule::StepPrediction;

/// The largest world the model is meant for (the ring simulation is `O(N²)` per collective).
pub const MAX_WORKERS: usize = 4096;

/// Predicts one steady-state step of `workers` ranks training `model` with `options` on `net`.
pub fn predict_step(
    model: &ModelConfig,
    options: &TrainOptions,
    workers: usize,
    net: &Network,
    profile: &ComputeProfile,
    sub_chunk: usize,
) -> Result<StepPrediction> {
    if workers == 0 || workers > MAX_WORKERS {
        bail!("--workers {workers} must be between 1 and {MAX_WORKERS} with --timing-only");
    }
    if sub_chunk == 0 {
        bail!("the sub-chunk size must be at least one element");
    }
    let plan = schedule::StepPlan {
        buckets: BucketPlan::new(&ParamLayout::new(model), options.bucket_elems).buckets,
        update: options.update,
        world: workers,
        grad_accum: options.grad_accum.max(1),
        sub_chunk,
        tokens_per_micro_batch: options.batch_size * options.seq_len,
    };
    Ok(schedule::predict(net, &plan, profile))
}
