//! One training step of every rank in virtual time: compute from a [`ComputeProfile`], collectives from
//! [`super::ring::simulate`], in the order and with the overlap of `ringtrain::trainer`:
//!
//! - forward, then backward, per micro-batch; only the last micro-batch's backward hands buckets over;
//!   each rank runs its own micro-batches (uneven shares) at its own speed (`StepPlan::loads`);
//! - each bucket of the real `BucketPlan` goes to the rank's communication thread once backward has
//!   finished it, and the thread runs one collective at a time, in plan order (`CommThread`): an
//!   all-reduce (`replicated`) or a reduce-scatter (`sharded`);
//! - after backward the rank waits for every bucket, then all-gathers the loss and the norm (16 bytes per
//!   rank, as `all_reduce_scalars` does) and runs the update (a sharded rank updates its `1/N` share);
//! - `sharded`: the update is followed by one parameter all-gather per bucket in forward order, not waited
//!   for; the next step's forward waits at each layer for the buckets that layer reads.
//!
//! - shared cores (`Network::shared_cores`, a fluid model): with `R` ranks on a machine of `C < R` cores,
//!   each rank's kernels get `C / R` of a core, so every compute segment takes `R / C` times as long; and
//!   the machine cannot finish a step sooner than it can do the step's CPU work, `R × (compute + γ_rank ×
//!   bytes sent) / C` per rank (`γ_rank`: between hosts `rank-cpu-per-byte`, else γ; inside a host the
//!   intra link's CPU per byte; averaged over the machine's ranks), so no rank's step ends sooner than
//!   that after it began. Communication threads are not slowed beyond their own γ: that bound carries
//!   their share of the cores.
//!
//! Every rank is simulated (vectors of N times), so two-tier fabrics and uneven chunks need no symmetry
//! argument. The report is the last of a few steps, when the sharded gathers have reached their steady
//! state of overlapping the next forward.

use super::network::Network;
use super::profile::ComputeProfile;
use super::ring::{simulate_layout, Layout, RingKind, RingShape};
use ringtrain::collective::Wire;
use ringtrain::trainer::UpdateMode;
use std::ops::Range;

/// What the step's shape is, from the trainer's options.
#[derive(Clone, Debug)]
pub struct StepPlan {
    /// The trainer's `BucketPlan::buckets`: flat ranges in the order backward finishes them.
    pub buckets: Vec<Range<usize>>,
    pub update: UpdateMode,
    pub world: usize,
    /// Per rank, the time of each of its micro-batches in run order, as a multiple of the profile's
    /// micro-batch: its sequences over the profile's, divided by the rank's speed (uneven shares, slower
    /// workers).
    pub loads: Vec<Vec<f64>>,
    /// The transport's sub-chunk in f32 elements.
    pub sub_chunk: usize,
    /// Tokens of the whole job per step (the global batch × sequence length).
    pub tokens_per_step: usize,
    /// The flat ring or the two-level one.
    pub layout: Layout,
    /// What the gradients' reductions send (`--wire`); parameter gathers send f32.
    pub wire: Wire,
}

impl StepPlan {
    /// Every rank at the profile's speed on the flat ring, running `grad_accum` micro-batches of `tokens_per_micro_batch`
    /// tokens, the profiled size.
    pub fn equal(
        buckets: Vec<Range<usize>>,
        update: UpdateMode,
        world: usize,
        grad_accum: usize,
        sub_chunk: usize,
        tokens_per_micro_batch: usize,
    ) -> Self {
        StepPlan {
            buckets,
            update,
            world,
            loads: vec![vec![1.0; grad_accum.max(1)]; world],
            sub_chunk,
            tokens_per_step: world * grad_accum.max(1) * tokens_per_micro_batch,
            layout: Layout::Flat,
            wire: Wire::F32,
        }
    }
}

/// One rank's step, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPrediction {
    /// Forward, backward and update; with shared cores, also the time the machine's CPU bound adds (the
    /// trainer would see it as slower compute: it measures compute as the step less exposed communication).
    pub compute_s: f64,
    /// Time the communication thread spent in this step's collectives.
    pub comm_s: f64,
    /// Communication that overlap did not hide: what the step waits for after its compute.
    pub exposed_s: f64,
    pub step_s: f64,
    /// Tokens of the whole job per second.
    pub tokens_per_s: f64,
    /// With shared cores: the shortest step the machine's cores allow (its CPU work over its cores); 0
    /// without.
    pub cpu_floor_s: f64,
}

/// Steps simulated before the reported one (the first sharded step has no gathers to wait for).
const WARM_STEPS: usize = 2;

/// Simulates a few steps and returns rank 0's last one.
pub fn predict(net: &Network, plan: &StepPlan, profile: &ComputeProfile) -> StepPrediction {
    let mut cluster = Cluster::new(plan.world);
    let mut last = None;
    for _ in 0..=WARM_STEPS {
        last = Some(cluster.step(net, plan, profile));
    }
    last.expect("at least one step ran")
}

/// Per-rank clocks carried from one step to the next.
struct Cluster {
    /// When each rank's next step begins.
    now: Vec<f64>,
    /// When each rank's communication thread is free.
    comm_free: Vec<f64>,
    /// Sharded: parameter gathers in flight, in forward order: (bucket, when each rank has it).
    gathers: Vec<(Range<usize>, Vec<f64>)>,
    /// CPU seconds the first machine's mean rank has spent sending in this step's collectives (even chunks
    /// assumed).
    send_cpu_s: f64,
}

impl Cluster {
    fn new(world: usize) -> Self {
        Cluster {
            now: vec![0.0; world],
            comm_free: vec![0.0; world],
            gathers: Vec::new(),
            send_cpu_s: 0.0,
        }
    }

    /// Runs `kind` over `elems` f32 on every rank once its thread is free and `ready`; returns rank 0's
    /// busy time.
    fn collective(
        &mut self,
        net: &Network,
        plan: &StepPlan,
        kind: RingKind,
        elems: usize,
        elem_bytes: usize,
        ready: &[f64],
    ) -> f64 {
        let start: Vec<f64> = ready.iter().zip(&self.comm_free).map(|(r, f)| r.max(*f)).collect();
        let shape = RingShape {
            kind,
            elems,
            elem_bytes,
            wire: plan.wire,
            sub_chunk: plan.sub_chunk,
        };
        let world = ready.len();
        self.send_cpu_s += plan.layout.send_cpu_s(&shape, world, net);
        self.comm_free = simulate_layout(net, plan.layout, &shape, &start);
        self.comm_free[0] - start[0]
    }

    fn step(&mut self, net: &Network, plan: &StepPlan, profile: &ComputeProfile) -> StepPrediction {
        let world = plan.world;
        let starts = self.now.clone();
        self.send_cpu_s = 0.0;
        let machine_ranks = net.ranks_per_machine(world) as f64;
        // Shared cores: how much longer each compute segment takes (see the module doc).
        let stretch = net.compute_slowdown(world);
        let mut comm_s = 0.0;
        let mut t = self.now.clone();
        let gathers = std::mem::take(&mut self.gathers);
        // When each rank's last backward has finished each bucket: [bucket][rank].
        let mut ready = vec![vec![0.0; world]; plan.buckets.len()];
        for (rank, loads) in plan.loads.iter().enumerate() {
            for (micro, load) in loads.iter().enumerate() {
                // Forward: the first micro-batch waits at each layer for the gathers of what it reads.
                let mut waiting = gathers.iter().peekable();
                for seg in &profile.forward {
                    while let Some((_, done)) = waiting.next_if(|(range, _)| micro == 0 && range.start < seg.bound) {
                        t[rank] = t[rank].max(done[rank]);
                    }
                    t[rank] += seg.seconds * load * stretch;
                }
                // Backward: the last micro-batch hands each bucket over as it is finished.
                let mut next = 0;
                for seg in &profile.backward {
                    t[rank] += seg.seconds * load * stretch;
                    if micro + 1 < loads.len() {
                        continue;
                    }
                    while plan.buckets.get(next).is_some_and(|b| b.start >= seg.bound) {
                        ready[next][rank] = t[rank];
                        next += 1;
                    }
                }
            }
        }
        // Each bucket's collective, in plan order, once every rank has handed it over.
        if world > 1 {
            let kind = match plan.update {
                UpdateMode::Replicated => RingKind::AllReduce,
                UpdateMode::Sharded => RingKind::ReduceScatter,
            };
            for (bucket, ready) in plan.buckets.iter().zip(&ready) {
                comm_s += self.collective(net, plan, kind, bucket.len(), 4, ready);
            }
        }
        // Wait for every bucket, then the scalars (loss and norm: two f64 per rank, gathered).
        if world > 1 {
            t.iter_mut().zip(&self.comm_free).for_each(|(t, f)| *t = t.max(*f));
            comm_s += self.collective(net, plan, RingKind::AllGather, 2 * world, 8, &t);
            t.clone_from(&self.comm_free);
        }
        let share = match plan.update {
            UpdateMode::Sharded => 1.0 / world as f64,
            UpdateMode::Replicated => 1.0,
        };
        let update_cpu_s = profile.update_s * share;
        t.iter_mut().for_each(|t| *t += update_cpu_s * stretch);
        if plan.update == UpdateMode::Sharded && world > 1 {
            for bucket in plan.buckets.iter().rev() {
                comm_s += self.collective(net, plan, RingKind::AllGather, bucket.len(), 4, &t);
                self.gathers.push((bucket.clone(), self.comm_free.clone()));
            }
        }
        // Rank 0's compute, and the mean rank's for the machine's CPU work.
        let pass_s = profile.forward_s() + profile.backward_s();
        let compute_cpu_s = plan.loads[0].iter().sum::<f64>() * pass_s + update_cpu_s;
        let mean_cpu_s = plan.loads.iter().flatten().sum::<f64>() / world as f64 * pass_s + update_cpu_s;
        let cpu_floor_s = net.shared_cores.map_or(0.0, |cores| {
            // The first machine's mean rank's sends stand for every machine's.
            machine_ranks * (mean_cpu_s + self.send_cpu_s) / cores as f64
        });
        // Rank 0's step before the bound, less its compute: the communication it waited for.
        let exposed_s = (t[0] - starts[0] - compute_cpu_s * stretch).max(0.0);
        for (t, start) in t.iter_mut().zip(&starts) {
            *t = t.max(start + cpu_floor_s);
        }
        self.now = t;
        let step_s = self.now[0] - starts[0];
        StepPrediction {
            compute_s: step_s - exposed_s,
            comm_s,
            exposed_s,
            step_s,
            tokens_per_s: plan.tokens_per_step as f64 / step_s,
            cpu_floor_s,
        }
    }
}
