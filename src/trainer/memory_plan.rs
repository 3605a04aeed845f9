//! The memory plan of one rank: what a run will allocate, term by term, computed before anything large is
//! allocated, and the check that refuses a run whose peak does not fit where it must live.
//!
//! Terms: parameters and gradients (`[P]` f32 each), the two AdamW moments (`[P]` each, or the rank's
//! chunk of about `P / N` in sharded mode), the activations and backward scratch of one micro-batch (counted
//! by the model's own carving code), the host staging of the flat gradient and parameters for the
//! collectives (`world > 1`), and the host copy of the initial parameters (and, on resume, the moments)
//! while they are uploaded. An elastic sharded run sizes its chunk for the smallest group it can shrink to
//! and adds the buddy mirror of a neighbour's chunk; `--sync outer` stages its anchor, the outer step's Δ
//! and its chunk of the outer momentum on the host instead of the gradient buckets; its re-form rebuilds the moments on the host (the two
//! full moments and the gathered pieces, counted with the initial copy, which it never meets). The corpus
//! is not counted: shards are memory-mapped, and text is small.

use super::buckets::optimizer_elems;
use super::{TrainOptions, UpdateMode};
use crate::backend::{AttentionSaving, BackendMemory};
use crate::model::{Gpt2, ModelConfig};
use std::fmt;

const F32: u64 = 4;
const TOKEN: u64 = 4;

/// Elements whose moments rank `rank` of `world` keeps: its chunk of every bucket (sharded) or all of them.
/// An elastic sharded run plans for the smallest group it can shrink to (the largest chunk there, rank 0's)
/// and the buddy mirror of a neighbour's chunk beside it.
fn planned_optimizer_elems(config: &ModelConfig, opts: &TrainOptions, world: usize, rank: usize) -> usize {
    if opts.sync.outer().is_some() {
        // Inner steps do not communicate: every rank keeps its whole inner optimizer.
        return config.param_count();
    }
    let Some(rules) = opts.elastic.as_ref().filter(|_| opts.update == UpdateMode::Sharded) else {
        return optimizer_elems(config, opts.update, opts.bucket_elems, world, rank);
    };
    let smallest = rules.smallest_group(world);
    let own = optimizer_elems(config, UpdateMode::Sharded, opts.bucket_elems, smallest, 0);
    if smallest > 1 {
        2 * own
    } else {
        own
    }
}

/// One rank's planned allocations, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub staging: u64,
    /// Host copies that live only while the model is built (initial parameters, resumed moments).
    pub init_copy: u64,
    /// What the plan was made for, so that a refusal can say what would fit.
    pub batch_size: usize,
    pub grad_accum: usize,
    shape: PlanShape,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct PlanShape {
    config: ModelConfig,
    seq_len: usize,
    world: usize,
    /// Elements whose AdamW moments this rank keeps: all, or its chunk when sharded (ZeRO-1).
    optimizer_elems: usize,
    /// Gradient bucket size in elements: sharded ranks own a chunk of every bucket.
    bucket_elems: usize,
    resume: bool,
    /// Elastic and sharded: a re-form rebuilds the full moments on the host.
    rebuilds: bool,
    /// `--sync outer`: the anchor and the outer step's buffer on the host instead of the gradient staging.
    outer: bool,
    /// `--outer-overlap on`: this rank's round start `[P]`, and at an outer step the finished step's
    /// parameters arrive while the round's Δ and the anchor are still held.
    outer_overlap: bool,
    /// `--update sharded`.
    sharded: bool,
    /// `--global-batch` given: a smaller micro-batch keeps the global batch by itself (more micro-batches
    /// per share), with no --grad-accum to adjust.
    global_batch: bool,
    /// What the backend's attention keeps for backward (probabilities on the CPU, row statistics on GPUs).
    attention: AttentionSaving,
}

/// Free memory where a plan must fit, and where that figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    pub bytes: u64,
    pub source: &'static str,
}

impl MemoryPlan {
    /// The plan of rank `rank` of `world` for a run of `config` with `opts` on a backend whose attention
    /// keeps what `attention` says; `resume` adds the resumed moments to the initial copy.
    pub fn new(
        config: &ModelConfig,
        opts: &TrainOptions,
        (world, rank): (usize, usize),
        resume: bool,
        attention: AttentionSaving,
    ) -> Self {
        let shape = PlanShape {
            config: config.clone(),
            seq_len: opts.seq_len,
            world,
            optimizer_elems: planned_optimizer_elems(config, opts, world, rank),
            bucket_elems: opts.bucket_elems,
            resume,
            rebuilds: opts.elastic.is_some() && opts.update == UpdateMode::Sharded,
            outer: opts.sync.outer().is_some(),
            outer_overlap: opts.sync.outer().is_some_and(|o| o.overlap),
            sharded: opts.update == UpdateMode::Sharded,
            global_batch: opts.global_batch.is_some(),
            attention,
        };
        Self::for_shape(shape, opts.batch_size, opts.grad_accum)
    }

    fn for_shape(shape: PlanShape, batch_size: usize, grad_accum: usize) -> Self {
        let p = shape.config.param_count() as u64;
        let (b, t) = (batch_size, shape.seq_len);
        let activations =
            Gpt2::activation_floats(&shape.config, b, t, shape.attention) as u64 * F32 + 2 * (b * t) as u64 * TOKEN;
        let staging = match (shape.outer, shape.world > 1) {
            // The anchor `[P]`, the outer step's Δ `[P]` and the outer momentum (this rank's chunk when
            // sharded).
            (true, _) if shape.sharded => (2 * p + p.div_ceil(shape.world as u64)) * F32,
            (true, _) => 3 * p * F32,
            (false, true) => 2 * p * F32,
            (false, false) => 0,
        } + u64::from(shape.outer_overlap) * 2 * p * F32;
        let init_copy = if shape.resume { 3 * p * F32 } else { p * F32 };
        // Both full moments and the gathered pieces (at most two chunks per rank over every rank).
        let init_copy = if shape.rebuilds {
            init_copy.max(4 * p * F32)
        } else {
            init_copy
        };
        MemoryPlan {
            params: p * F32,
            grads: p * F32,
            optimizer: 2 * shape.optimizer_elems as u64 * F32,
            activations,
            staging,
            init_copy,
            batch_size,
            grad_accum,
            shape,
        }
    }

    /// Peak bytes on the backend: the model state and the activations (the CPU backend adds the host terms,
    /// see [`MemoryPlan::peak`]).
    pub fn backend_peak(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations
    }

    /// Peak bytes in host memory beside the backend's: the staging buffers, plus the initial copy while
    /// the model is built.
    pub fn host_peak(&self) -> u64 {
        self.staging + self.init_copy
    }

    /// Peak when everything shares one memory (the CPU backend): every term at once. The initial copy is
    /// dropped before the first forward allocates the activations, but the allocator keeps freed pages for
    /// a while (mimalloc's purge delay), so both count: `gpt2` at 1 x 1024 peaked at the sum, 4.04 GB, and
    /// at the larger phase alone, 3.55 GB, only with `MIMALLOC_PURGE_DELAY=0`.
    pub fn peak(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.staging + self.init_copy + self.activations
    }

    /// The terms, largest first, with their names.
    fn terms(&self) -> [(&'static str, u64); 6] {
        let mut terms = [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer),
            ("activations", self.activations),
            ("staging buffers", self.staging),
            ("initial copy", self.init_copy),
        ];
        terms.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
        terms
    }

    /// Refuses a plan that does not fit: on the CPU backend everything must fit in `host`; on a device the
    /// backend's terms must fit in its free memory (where reported) and the rest in `host`.
    pub fn check(&self, memory: BackendMemory, host: Option<Available>) -> Result<(), String> {
        let fits = |plan: &MemoryPlan| match memory {
            BackendMemory::Host => host.is_none_or(|h| plan.peak() <= h.bytes),
            BackendMemory::Device { available } => {
                available.is_none_or(|a| plan.backend_peak() <= a) && host.is_none_or(|h| plan.host_peak() <= h.bytes)
            }
        };
        if fits(self) {
            return Ok(());
        }
        let (need, room) = match (memory, host) {
            (BackendMemory::Host, Some(h)) => (self.peak(), h),
            (BackendMemory::Device { available: Some(a) }, _) if self.backend_peak() > a => (
                self.backend_peak(),
                Available {
                    bytes: a,
                    source: "free device memory",
                },
            ),
            (_, Some(h)) => (self.host_peak(), h),
            _ => unreachable!("a plan with no limit always fits"),
        };
        let (largest, largest_bytes) = self.terms()[0];
        let mut msg = format!(
            "memory plan: this rank needs {} but {} has {} free; the largest term is {largest} ({})",
            gib(need),
            room.source,
            gib(room.bytes),
            gib(largest_bytes)
        );
        let smaller = smaller_divisors(self.batch_size)
            .into_iter()
            .map(|b| Self::for_shape(self.shape.clone(), b, self.grad_accum * (self.batch_size / b)))
            .find(|plan| fits(plan));
        let sharded = || {
            let p = self.shape.config.param_count();
            let replicated = self.shape.world > 1 && self.shape.optimizer_elems == p;
            let shape = PlanShape {
                optimizer_elems: optimizer_elems(
                    &self.shape.config,
                    UpdateMode::Sharded,
                    self.shape.bucket_elems,
                    self.shape.world,
                    0,
                ),
                ..self.shape.clone()
            };
            Some(Self::for_shape(shape, self.batch_size, self.grad_accum)).filter(|plan| replicated && fits(plan))
        };
        match smaller {
            Some(plan) if self.shape.global_batch => msg.push_str(&format!(
                "; --batch-size {} fits ({}): this rank then runs its share of --global-batch in more, smaller \
                 micro-batches",
                plan.batch_size,
                gib(if memory == BackendMemory::Host {
                    plan.peak()
                } else {
                    plan.backend_peak()
                })
            )),
            Some(plan) => msg.push_str(&format!(
                "; --batch-size {} --grad-accum {} keeps the global batch and needs {}",
                plan.batch_size,
                plan.grad_accum,
                gib(if memory == BackendMemory::Host {
                    plan.peak()
                } else {
                    plan.backend_peak()
                })
            )),
            None if sharded().is_some() => msg.push_str(&format!(
                "; --update sharded keeps 1/{} of the optimizer state per rank and fits",
                self.shape.world
            )),
            None => msg.push_str(
                "; no smaller --batch-size fits: choose a shorter --seq-len or a smaller model (the parameters, \
                 gradients and optimizer state alone do not fit)",
            ),
        }
        Err(msg)
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "memory plan: parameters {}, gradients {}, optimizer state {}, activations {} (batch {} x {}), \
             staging {}, initial copy {}; peak {}",
            gib(self.params),
            gib(self.grads),
            gib(self.optimizer),
            gib(self.activations),
            self.batch_size,
            self.shape.seq_len,
            gib(self.staging),
            gib(self.init_copy),
            gib(self.peak())
        )
    }
}

/// Bytes as GiB (or MiB below one GiB), for messages.
fn gib(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (MIB * 1024.0))
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

/// Free host memory for this process: the smaller of the kernel's `MemAvailable` and the room left under
/// the cgroup's `memory.max` (containers). `None` where neither can be read.
pub fn host_available() -> Option<Available> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let system = meminfo.as_deref().and_then(parse_mem_available).map(|bytes| Available {
        bytes,
        source: "the host (MemAvailable)",
    });
    let read = |name: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{name}")).ok();
    let cgroup = cgroup_room(read("memory.max").as_deref(), read("memory.current").as_deref()).map(|bytes| Available {
        bytes,
        source: "the cgroup (memory.max)",
    });
    match (system, cgroup) {
        (Some(s), Some(c)) => Some(if c.bytes < s.bytes { c } else { s }),
        (s, c) => s.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Bytes left under a cgroup v2 limit: `memory.max` (a number or `max`) minus `memory.current`.
fn cgroup_room(max: Option<&str>, current: Option<&str>) -> Option<u64> {
    let max: u64 = max?.trim().parse().ok()?;
    let current: u64 = current?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Peak resident memory of this process so far (`VmHWM`), in bytes; `None` off Linux.
pub fn measured_peak() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The divisors of `n` below `n`, largest first: the micro-batch sizes that split a batch of `n` evenly.
/// Found in O(sqrt n), since `n` comes from a flag.
fn smaller_divisors(n: usize) -> Vec<usize> {
    let mut divisors = Vec::new();
    let mut d = 1;
    while d <= n / d {
        if n % d == 0 {
            divisors.push(d);
            divisors.push(n / d);
        }
        d += 1;
    }
    divisors.sort_unstable_by(|a, b| b.cmp(a));
    divisors.dedup();
    divisors.retain(|&d| d < n);
    divisors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaller_divisors_are_listed_largest_first() {
        assert_eq!(smaller_divisors(12), vec![6, 4, 3, 2, 1]);
        assert_eq!(smaller_divisors(16), vec![8, 4, 2, 1]);
        assert_eq!(smaller_divisors(7), vec![1]);
        assert_eq!(smaller_divisors(1), Vec::<usize>::new());
        // A batch from a flag can be huge; this must not take a step per candidate.
        assert_eq!(smaller_divisors(1 << 40)[0], 1 << 39);
    }

    const GIB: u64 = 1 << 30;

    /// The plan of a fresh run on the CPU backend.
    fn cpu_plan(config: &ModelConfig, opts: &TrainOptions, (world, rank): (usize, usize)) -> MemoryPlan {
        MemoryPlan::new(config, opts, (world, rank), false, AttentionSaving::Probabilities)
    }

    fn plan_for(config: &ModelConfig, batch: usize, seq: usize, accum: usize, world: usize) -> MemoryPlan {
        let mut opts = TrainOptions::for_model(config);
        (opts.batch_size, opts.seq_len, opts.grad_accum) = (batch, seq, accum);
        cpu_plan(config, &opts, (world, 0))
    }

    fn host(bytes: u64) -> Option<Available> {
        Some(Available {
            bytes,
            source: "the host (MemAvailable)",
        })
    }

    #[test]
    fn terms_follow_the_model() {
        let cfg = ModelConfig::gpt2();
        let p = cfg.param_count() as u64;
        let mut opts = TrainOptions::for_model(&cfg);
        (opts.batch_size, opts.seq_len, opts.update) = (1, 1024, UpdateMode::Replicated);
        let plan = cpu_plan(&cfg, &opts, (2, 0));
        assert_eq!((plan.params, plan.grads, plan.optimizer), (4 * p, 4 * p, 8 * p));
        assert_eq!(plan.staging, 8 * p);
        assert_eq!(
            plan.activations,
            Gpt2::activation_floats(&cfg, 1, 1024, AttentionSaving::Probabilities) as u64 * 4 + 2 * 1024 * 4
        );
        // Activations grow with the batch; one rank needs no staging.
        let single = plan_for(&cfg, 4, 1024, 1, 1);
        assert!(single.activations > 3 * plan.activations && single.staging == 0);
    }

    /// ZeRO-1: each of N sharded ranks keeps the moments of its own chunk, 1/N of the replicated state.
    /// The GPU backends keep each attention row's log-sum-exp instead of its probabilities, and backward's
    /// scratch shrinks the same way: gpt2 at 8 x 1024 drops by 13 [8, 12, 1024, 1024] terms (one per
    /// layer and the scratch, 4.87 GiB) to under 7.3 GiB of activations.
    #[test]
    fn flash_attention_plans_row_statistics_instead_of_probabilities() {
        let cfg = ModelConfig::gpt2();
        let mut opts = TrainOptions::for_model(&cfg);
        (opts.batch_size, opts.seq_len) = (8, 1024);
        let cpu = cpu_plan(&cfg, &opts, (1, 0)).activations;
        let gpu = MemoryPlan::new(&cfg, &opts, (1, 0), false, AttentionSaving::RowLogSumExp).activations;
        let square = 8 * 12 * 1024 * 1024u64;
        let row = 8 * 12 * 1024u64;
        assert_eq!(cpu - gpu, 4 * ((12 + 1) * (square - row)));
        assert!(gpu <= 73 * GIB / 10, "{} GiB", gpu as f64 / GIB as f64);
    }

    #[test]
    fn sharded_ranks_plan_a_nth_of_the_optimizer_state() {
        let cfg = ModelConfig::small();
        let p = cfg.param_count();
        let mut opts = TrainOptions::for_model(&cfg);
        opts.update = UpdateMode::Replicated;
        let replicated = cpu_plan(&cfg, &opts, (3, 0)).optimizer;
        assert_eq!(replicated, 8 * p as u64);
        opts.update = UpdateMode::Sharded;
        let per_rank: Vec<u64> = (0..3).map(|r| cpu_plan(&cfg, &opts, (3, r)).optimizer).collect();
        assert_eq!(per_rank.iter().sum::<u64>(), replicated);
        assert!(
            per_rank.iter().all(|&o| o.abs_diff(replicated / 3) <= 8),
            "{per_rank:?}"
        );
        // One rank owns everything.
        assert_eq!(cpu_plan(&cfg, &opts, (1, 0)).optimizer, replicated);
    }

    /// Elastic and sharded: the chunk of the smallest group the job can shrink to, and a neighbour's beside
    /// it; the re-form's host copies count where the initial copy does.
    #[test]
    fn an_elastic_sharded_rank_plans_for_its_smallest_group_and_a_mirror() {
        use crate::elastic::{ElasticRules, Quorum};
        let cfg = ModelConfig::small();
        let p = cfg.param_count() as u64;
        let mut opts = TrainOptions::for_model(&cfg);
        opts.update = UpdateMode::Sharded;
        let plain = cpu_plan(&cfg, &opts, (8, 0));
        let two_of = cpu_plan(&cfg, &opts, (2, 0)).optimizer;
        opts.elastic = Some(ElasticRules::default());
        // A majority quorum can shrink 8 ranks to 2: each keeps up to half, twice (its own and a mirror).
        let elastic = cpu_plan(&cfg, &opts, (8, 0));
        assert_eq!(elastic.optimizer, 2 * two_of);
        assert!(elastic.optimizer > 7 * plain.optimizer);
        assert_eq!(elastic.init_copy, 4 * p * F32);
        opts.elastic = Some(ElasticRules {
            quorum: Quorum::Majority,
            min_ranks: 4,
        });
        let four_of = cpu_plan(
            &cfg,
            &TrainOptions {
                elastic: None,
                ..opts.clone()
            },
            (4, 0),
        )
        .optimizer;
        assert_eq!(cpu_plan(&cfg, &opts, (8, 3)).optimizer, 2 * four_of);
        // Down to one rank, which owns everything and mirrors nothing.
        opts.elastic = Some(ElasticRules {
            quorum: Quorum::Any,
            min_ranks: 1,
        });
        assert_eq!(cpu_plan(&cfg, &opts, (8, 0)).optimizer, 8 * p);
    }

    /// `--sync outer`: the anchor, Δ and a chunk of the momentum on the host, on one rank too.
    #[test]
    fn an_outer_run_stages_its_anchor_delta_and_momentum_chunk() {
        use crate::trainer::{OuterOptions, SyncMode};
        let cfg = ModelConfig::small();
        let p = cfg.param_count() as u64;
        let mut opts = TrainOptions::for_model(&cfg);
        opts.sync = SyncMode::Outer(OuterOptions {
            every: 10,
            lr: 0.7,
            momentum: 0.9,
            overlap: false,
        });
        let sharded = cpu_plan(&cfg, &opts, (4, 0));
        assert_eq!(sharded.staging, (2 * p + p.div_ceil(4)) * F32);
        // The whole inner optimizer on every rank, sharded or not.
        assert_eq!(sharded.optimizer, 2 * p * F32);
        assert_eq!(cpu_plan(&cfg, &opts, (1, 0)).staging, 3 * p * F32);
        opts.update = UpdateMode::Replicated;
        assert_eq!(cpu_plan(&cfg, &opts, (4, 0)).staging, 3 * p * F32);
        // Overlapped, the rank's round start, and the finished outer step's parameters arriving beside Δ
        // and the anchor.
        if let SyncMode::Outer(o) = &mut opts.sync {
            o.overlap = true;
        }
        assert_eq!(cpu_plan(&cfg, &opts, (4, 0)).staging, 5 * p * F32);
    }

    /// The case from the issue tracker: gpt2 at batch 64 x 1024 needs about 24e9 floats of activations.
    #[test]
    fn a_plan_that_cannot_fit_names_its_largest_term_and_what_would_fit() {
        let plan = plan_for(&ModelConfig::gpt2(), 64, 1024, 1, 1);
        let err = plan.check(BackendMemory::Host, host(24 * GIB)).unwrap_err();
        assert!(err.contains("the largest term is activations"), "{err}");
        assert!(err.contains("--grad-accum"), "{err}");
        // The largest divisor of 64 whose plan fits, with the accumulation that keeps the global batch.
        let fits = |b: usize| plan_for(&ModelConfig::gpt2(), b, 1024, 64 / b, 1).peak() <= 24 * GIB;
        let b = [32, 16, 8, 4, 2, 1]
            .into_iter()
            .find(|&b| fits(b))
            .expect("batch 1 fits in 24 GiB");
        assert!(b < 64 && fits(b) && (b == 32 || !fits(2 * b)));
        let want = format!("--batch-size {b} --grad-accum {} keeps the global batch", 64 / b);
        assert!(err.contains(&want), "expected {want:?} in {err}");
        assert!(plan.check(BackendMemory::Host, host(1 << 50)).is_ok());
        assert!(plan.check(BackendMemory::Host, None).is_ok(), "no reading, no refusal");
    }

    #[test]
    fn device_plans_check_device_and_host_apart() {
        let plan = plan_for(&ModelConfig::gpt2(), 8, 1024, 1, 2);
        let device = |gib| BackendMemory::Device {
            available: Some(gib * GIB),
        };
        let err = plan.check(device(1), host(64 * GIB)).unwrap_err();
        assert!(err.contains("free device memory"), "{err}");
        assert!(plan.check(device(64), host(64 * GIB)).is_ok());
        let err = plan.check(device(64), host(GIB / 2)).unwrap_err();
        assert!(err.contains("MemAvailable"), "{err}");
        assert!(plan
            .check(BackendMemory::Device { available: None }, host(64 * GIB))
            .is_ok());
    }

    #[test]
    fn when_nothing_smaller_fits_it_says_so() {
        let plan = plan_for(&ModelConfig::gpt2(), 4, 1024, 1, 1);
        let err = plan.check(BackendMemory::Host, host(GIB)).unwrap_err();
        assert!(err.contains("no smaller --batch-size fits"), "{err}");
        assert!(err.contains("the largest term is"), "{err}");
    }

    /// With --global-batch a smaller micro-batch keeps the global batch by itself: no --grad-accum advice.
    #[test]
    fn with_a_global_batch_a_smaller_micro_batch_is_the_advice() {
        let cfg = ModelConfig::gpt2();
        let mut opts = TrainOptions::for_model(&cfg);
        (opts.batch_size, opts.seq_len, opts.global_batch) = (64, 1024, Some(96));
        let plan = cpu_plan(&cfg, &opts, (2, 1));
        let err = plan.check(BackendMemory::Host, host(24 * GIB)).unwrap_err();
        assert!(!err.contains("--grad-accum"), "{err}");
        assert!(err.contains("in more, smaller micro-batches"), "{err}");
    }

    /// A replicated multi-rank run that only fits with sharded moments is told so.
    #[test]
    fn a_replicated_run_is_pointed_to_the_sharded_update() {
        let cfg = ModelConfig::gpt2();
        let mut opts = TrainOptions::for_model(&cfg);
        (opts.batch_size, opts.seq_len, opts.update) = (1, 1024, UpdateMode::Replicated);
        let replicated = cpu_plan(&cfg, &opts, (4, 0));
        opts.update = UpdateMode::Sharded;
        let sharded = cpu_plan(&cfg, &opts, (4, 0));
        assert!(sharded.peak() < replicated.peak());
        let room = (sharded.peak() + replicated.peak()) / 2;
        let err = replicated.check(BackendMemory::Host, host(room)).unwrap_err();
        assert!(
            err.contains("--update sharded keeps 1/4 of the optimizer state"),
            "{err}"
        );
        assert!(sharded.check(BackendMemory::Host, host(room)).is_ok());
    }

    #[test]
    fn host_readings_parse() {
        assert_eq!(
            parse_mem_available("MemTotal: 100 kB\nMemAvailable:   2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(parse_mem_available("MemTotal: 100 kB\n"), None);
        assert_eq!(cgroup_room(Some("max\n"), Some("5")), None);
        assert_eq!(cgroup_room(Some("1000\n"), Some("300\n")), Some(700));
        assert_eq!(cgroup_room(Some("100"), Some("300")), Some(0));
        assert!(measured_peak().is_some_and(|b| b > 0));
    }
}
