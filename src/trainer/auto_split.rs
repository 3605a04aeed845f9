//! `--batch-split auto`: each rank's share of the global batch follows its measured speed.
//!
//! Every rank times its own compute in each step: from the start of its local compute to the end of its
//! last backward (on the device), less the time it waited for parameters (a sharded run's all-gather), so
//! communication does not count. At the start of the next step it hands that time and its share to the
//! communication thread, which all-gathers them ahead of that step's gradient buckets (so the exchange
//! waits on nothing and exposes nothing); the trainer collects them after the step's update. Every rank
//! then holds the same numbers, folds them the same way into a time per sequence for every rank (a
//! smoothed mean that clips outliers and restarts when the rank's speed changes, [`Estimate`]),
//! and computes the same integer split: the one that minimises the predicted step, the largest over the
//! ranks of share × time per sequence ([`best_split`]). The ranks move to it only when it predicts a step
//! shorter than the current split does under the same estimates by more than [`HYSTERESIS`] and by more
//! than the estimates' own noise (each rank's clock jitter is measured too), so noise does not make the
//! split oscillate; the new split applies from the next step on every rank alike, and
//! the replicas stay bit-identical. A step's bits are a function of its split; the split history is in
//! the metrics and in checkpoints.
//!
//! Memory bounds a rank's micro-batch (its own `--batch-size`, which its memory plan checks), not its
//! share: a larger share runs as more micro-batches in the same activations. So a share is bounded only by
//! one sequence below, and by the global batch less one sequence for each other rank above.

use crate::collective::comm_thread::{CommThread, Pending};
use crate::data::BatchPlan;
use anyhow::{ensure, Context, Result};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

/// The weight of the newest measurement in a rank's estimate while its speed holds (after the plain mean
/// of the first few): small, so that measurement noise does not move the split.
pub const SMOOTHING: f64 = 0.2;

/// How far (relative) from a rank's estimate a measurement may pull it; beyond this, a measurement is
/// clipped (a stall of a shared CPU, a page fault), and when the median of the last [`RECENT`]
/// measurements lies beyond it, the rank's speed has changed and its estimate restarts from that median.
pub const SPEED_CHANGE: f64 = 0.25;

/// The raw measurements kept to tell a change of speed from one outlier.
pub const RECENT: usize = 3;

/// The measurements each rank's estimate needs before the split may change: one or two say little about
/// a clock's noise.
pub const MIN_SAMPLES: u32 = 3;

/// The least improvement of the predicted step for which the ranks change their split.
pub const HYSTERESIS: f64 = 0.03;

/// Above [`HYSTERESIS`], the improvement must also exceed this many standard errors of the difference of
/// two ranks' estimates, so that noisy clocks (a shared CPU) do not move the split back and forth.
pub const NOISE_MARGIN: f64 = 3.0;

/// The checkpoint's `extra` key for the estimates: per rank `mean/samples/noise/r1:r2:r3` (the fields of
/// [`Estimate`]), ranks comma-separated, in exact decimals.
pub const ESTIMATES_KEY: &str = "auto_split_estimates";

/// One rank's time per sequence, in milliseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    pub mean: f64,
    /// Measurements behind `mean` since it last (re)started.
    pub samples: u32,
    /// The smoothed square of a (clipped) measurement's relative deviation from the mean.
    pub noise: f64,
    /// The last [`RECENT`] raw measurements, oldest first.
    pub recent: Vec<f64>,
}

impl Estimate {
    fn new(ms_per_sequence: f64) -> Self {
        Estimate {
            mean: ms_per_sequence,
            samples: 1,
            noise: 0.0,
            recent: vec![ms_per_sequence],
        }
    }

    /// The plain mean of the first measurements, then an exponential average (weight [`SMOOTHING`]) of
    /// clipped ones; a change of speed restarts it from the recent median, keeping the noise (the
    /// clock's, not the speed's).
    fn fold(&mut self, new: f64) {
        if self.recent.len() == RECENT {
            self.recent.remove(0);
        }
        self.recent.push(new);
        let (low, high) = (self.mean * (1.0 - SPEED_CHANGE), self.mean * (1.0 + SPEED_CHANGE));
        let median = median(&self.recent);
        if self.recent.len() == RECENT && !(low..=high).contains(&median) {
            self.mean = median;
            self.samples = RECENT as u32;
            return;
        }
        let clipped = new.clamp(low, high);
        self.samples = self.samples.saturating_add(1);
        let weight = (1.0 / f64::from(self.samples)).max(SMOOTHING);
        let deviation = (clipped - self.mean) / self.mean;
        self.noise = weight * deviation * deviation + (1.0 - weight) * self.noise;
        self.mean = weight * clipped + (1.0 - weight) * self.mean;
    }

    /// The relative standard error of the mean: the noise of one measurement, shrunk by the averaging.
    fn relative_error(&self) -> f64 {
        let averaged = (1.0 / f64::from(self.samples)).max(SMOOTHING / (2.0 - SMOOTHING));
        (self.noise * averaged).sqrt()
    }
}

/// The median of a few values (the lower middle one of an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[(sorted.len() - 1) / 2]
}

/// The integer split of `global` sequences over ranks whose times per sequence are `costs` that minimises
/// the slowest rank's time (share × cost), each share at least one: one sequence at a time to the rank
/// that would finish it soonest (ties to the lower rank), which is optimal for equal jobs on machines of
/// different speeds. `costs` must be positive and finite; `global` at least their count.
pub fn best_split(costs: &[f64], global: usize) -> Vec<usize> {
    let mut shares = vec![1; costs.len()];
    // Min-heap of (finish time with one more sequence, rank); f64 ordered by its bits, valid for
    // non-negative finite values.
    let mut next: BinaryHeap<Reverse<(u64, usize)>> = costs
        .iter()
        .enumerate()
        .map(|(rank, c)| Reverse(((2.0 * c).to_bits(), rank)))
        .collect();
    for _ in costs.len()..global {
        let Reverse((_, rank)) = next.pop().expect("one entry per rank");
        shares[rank] += 1;
        next.push(Reverse((((shares[rank] + 1) as f64 * costs[rank]).to_bits(), rank)));
    }
    shares
}

/// The step a split predicts: the slowest rank's share × its time per sequence.
pub fn predicted_step(shares: &[usize], costs: &[f64]) -> f64 {
    shares.iter().zip(costs).map(|(&n, c)| n as f64 * c).fold(0.0, f64::max)
}

/// One rank's side of the automatic split: its own measurement, the exchange in flight, and the estimates
/// every rank holds alike.
#[derive(Default)]
pub struct AutoSplit {
    /// This rank's compute in the step just finished: (milliseconds, sequences), exchanged in the next.
    measured: Option<(f64, usize)>,
    /// The exchange in flight: every rank's 16-byte measurement, in rank order.
    exchange: Option<Pending<Vec<Vec<u8>>>>,
    /// Per rank, the smoothed time per sequence; `None` before the first exchange.
    estimates: Option<Vec<Estimate>>,
}

impl AutoSplit {
    /// This rank computed `sequences` sequences in `ms` milliseconds in the step that just ran.
    pub fn record(&mut self, ms: f64, sequences: usize) {
        self.measured = Some((ms, sequences));
    }

    /// Hands the last step's measurement to the communication thread (a step's start, before its
    /// gradients). Every rank measured the same steps, so every rank exchanges alike.
    pub fn start_exchange(&mut self, comm: &CommThread) {
        let Some((ms, sequences)) = self.measured.take() else {
            return;
        };
        let mut mine = ms.to_le_bytes().to_vec();
        mine.extend_from_slice(&(sequences as f64).to_le_bytes());
        self.exchange = Some(comm.submit(move |c| c.gather_bytes(mine)));
    }

    /// Collects the exchange of this step, if one ran, and returns the split the next step should use when
    /// it differs from `current`'s. Every rank gets the same bytes and so returns the same.
    pub fn finish_exchange(&mut self, current: &BatchPlan) -> Result<Option<Vec<usize>>> {
        let Some(pending) = self.exchange.take() else {
            return Ok(None);
        };
        let blobs = pending
            .wait()
            .context("exchanging the ranks' compute times (--batch-split auto)")?;
        let mut measured = Vec::with_capacity(blobs.len());
        for (rank, blob) in blobs.iter().enumerate() {
            ensure!(
                blob.len() == 16,
                "rank {rank} sent a compute time of {} bytes, not 16",
                blob.len()
            );
            let number = |at: usize| f64::from_le_bytes(blob[at..at + 8].try_into().expect("length checked"));
            let (ms, sequences) = (number(0), number(8));
            ensure!(
                ms.is_finite() && ms >= 0.0 && sequences >= 1.0,
                "rank {rank} sent a compute time of {ms} ms for {sequences} sequences"
            );
            measured.push(ms.max(1e-6) / sequences);
        }
        self.observe(&measured);
        Ok(self.decide(current))
    }

    /// Folds one exchange of times per sequence (one per rank) into the estimates.
    pub fn observe(&mut self, per_sequence_ms: &[f64]) {
        match &mut self.estimates {
            Some(estimates) if estimates.len() == per_sequence_ms.len() => {
                estimates
                    .iter_mut()
                    .zip(per_sequence_ms)
                    .for_each(|(e, &new)| e.fold(new));
            }
            _ => self.estimates = Some(per_sequence_ms.iter().map(|&c| Estimate::new(c)).collect()),
        }
    }

    /// The split to move to: the best one, when every rank's estimate rests on [`MIN_SAMPLES`] measurements and
    /// the best beats `current`'s predicted step by more than the hysteresis and the estimates' noise.
    pub fn decide(&self, current: &BatchPlan) -> Option<Vec<usize>> {
        let estimates = self.estimates.as_ref()?;
        if estimates.len() != current.shares.len() || estimates.iter().any(|e| e.samples < MIN_SAMPLES) {
            return None;
        }
        let costs: Vec<f64> = estimates.iter().map(|e| e.mean).collect();
        let best = best_split(&costs, current.global);
        let noise = estimates.iter().map(Estimate::relative_error).fold(0.0, f64::max);
        let margin = HYSTERESIS.max(NOISE_MARGIN * std::f64::consts::SQRT_2 * noise);
        let better = predicted_step(&best, &costs) < (1.0 - margin) * predicted_step(&current.shares, &costs);
        (better && best != current.shares).then_some(best)
    }

    /// The estimates, one per rank, once the ranks have exchanged their first measurements.
    pub fn estimates(&self) -> Option<&[Estimate]> {
        self.estimates.as_deref()
    }

    /// What a checkpoint keeps: the estimates, exactly (Rust's shortest round-trip decimals).
    pub fn checkpoint_extra(&self, extra: &mut BTreeMap<String, String>) {
        if let Some(estimates) = &self.estimates {
            let text: Vec<String> = estimates
                .iter()
                .map(|e| {
                    let recent: Vec<String> = e.recent.iter().map(|x| format!("{x:?}")).collect();
                    format!("{:?}/{}/{:?}/{}", e.mean, e.samples, e.noise, recent.join(":"))
                })
                .collect();
            extra.insert(ESTIMATES_KEY.to_string(), text.join(","));
        }
    }

    /// The state a checkpoint of a `world`-rank run kept; none when it kept none or ran on another world.
    pub fn restore(extra: &BTreeMap<String, String>, world: usize) -> Result<Self> {
        let Some(text) = extra.get(ESTIMATES_KEY) else {
            return Ok(AutoSplit::default());
        };
        let time = |x: &str| x.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0);
        let parse = |entry: &str| -> Option<Estimate> {
            let fields: Vec<&str> = entry.trim().split('/').collect();
            let [mean, samples, noise, recent] = fields.as_slice() else {
                return None;
            };
            let recent = recent.split(':').map(time).collect::<Option<Vec<f64>>>()?;
            Some(Estimate {
                mean: time(mean)?,
                samples: samples.parse().ok().filter(|&n| n >= 1)?,
                noise: noise.parse().ok().filter(|v: &f64| v.is_finite() && *v >= 0.0)?,
                recent: (recent.len() <= RECENT).then_some(recent)?,
            })
        };
        let estimates = text
            .split(',')
            .map(parse)
            .collect::<Option<Vec<Estimate>>>()
            .with_context(|| format!("--resume: {ESTIMATES_KEY} {text:?} is not a list of recent times per rank"))?;
        Ok(AutoSplit {
            estimates: (estimates.len() == world).then_some(estimates),
            ..AutoSplit::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The best split by trying every one (small cases only).
    fn brute_force(costs: &[f64], global: usize) -> f64 {
        fn go(costs: &[f64], left: usize, worst: f64) -> f64 {
            match costs {
                [last] => worst.max(left as f64 * last),
                [c, rest @ ..] => (1..=left - rest.len())
                    .map(|n| go(rest, left - n, worst.max(n as f64 * c)))
                    .fold(f64::INFINITY, f64::min),
                [] => unreachable!(),
            }
        }
        go(costs, global, 0.0)
    }

    proptest! {
        #[test]
        fn the_greedy_split_is_the_best_integer_split(
            costs in proptest::collection::vec(0.1f64..10.0, 1..4),
            extra in 0usize..12,
        ) {
            let global = costs.len() + extra;
            let split = best_split(&costs, global);
            prop_assert_eq!(split.iter().sum::<usize>(), global);
            prop_assert!(split.iter().all(|&n| n >= 1));
            prop_assert_eq!(predicted_step(&split, &costs), brute_force(&costs, global));
        }
    }

    fn plan(shares: Vec<usize>) -> BatchPlan {
        let global = shares.iter().sum();
        BatchPlan::with_shares(global, shares).unwrap()
    }

    /// Runs `steps` exchanges of ranks whose true times per sequence are `speeds(step)`, each measurement
    /// off by up to ±`noise` (a fixed pseudo-random sequence), and returns the split of each step.
    fn simulate(global: usize, steps: usize, noise: f64, speeds: impl Fn(usize) -> Vec<f64>) -> Vec<Vec<usize>> {
        let world = speeds(0).len();
        let mut split = plan(crate::data::split::shares(global, world, &crate::data::BatchSplit::Even).unwrap());
        let mut auto = AutoSplit::default();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut history = Vec::new();
        for step in 0..steps {
            history.push(split.shares.clone());
            let measured: Vec<f64> = speeds(step)
                .iter()
                .map(|c| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
                    c * (1.0 + noise * (2.0 * unit - 1.0))
                })
                .collect();
            auto.observe(&measured);
            if let Some(shares) = auto.decide(&split) {
                split = plan(shares);
            }
        }
        history
    }

    #[test]
    fn a_slower_rank_gets_less_within_ten_steps_and_the_split_then_holds() {
        // Rank 1 takes twice as long per sequence: the best split of 25 is 17, 8 (17 units), and 16, 9 is
        // 6% slower (18), close enough for noise to flip between them without the hysteresis.
        let history = simulate(25, 40, 0.05, |_| vec![1.0, 2.0]);
        let costs = [1.0, 2.0];
        let best = predicted_step(&best_split(&costs, 25), &costs);
        for (step, shares) in history.iter().enumerate().skip(10) {
            assert!(predicted_step(shares, &costs) <= 1.05 * best, "step {step}: {shares:?}");
        }
        let changes = history.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(changes <= 3, "the split kept moving: {history:?}");
    }

    #[test]
    fn equal_speeds_keep_the_even_split_despite_noise() {
        // 25 does not divide: the ranks with one sequence more could change places at every step.
        for world in [2, 3, 4] {
            let history = simulate(25, 60, 0.05, |_| vec![3.0; world]);
            assert!(history.iter().all(|s| *s == history[0]), "{world} ranks: {history:?}");
        }
    }

    #[test]
    fn a_change_of_speed_is_followed_within_ten_steps() {
        // Rank 2 slows to a third of its speed at step 20.
        let speeds = |step: usize| vec![1.0, 1.0, if step < 20 { 1.0 } else { 3.0 }];
        let history = simulate(21, 60, 0.05, speeds);
        for (step, shares) in history.iter().enumerate() {
            let costs = speeds(step);
            let best = predicted_step(&best_split(&costs, 21), &costs);
            if (10..20).contains(&step) || step >= 30 {
                assert!(predicted_step(shares, &costs) <= 1.05 * best, "step {step}: {shares:?}");
            }
        }
    }

    #[test]
    fn checkpointed_estimates_come_back_exactly() {
        let mut auto = AutoSplit::default();
        auto.observe(&[0.1 + 0.2, 1.0 / 3.0]);
        auto.observe(&[0.31, 0.3]);
        let mut extra = BTreeMap::new();
        auto.checkpoint_extra(&mut extra);
        let back = AutoSplit::restore(&extra, 2).unwrap();
        assert_eq!(back.estimates(), auto.estimates());
        assert_eq!(auto.estimates().unwrap()[1].recent, [1.0 / 3.0, 0.3]);
        assert_eq!(auto.estimates().unwrap()[1].samples, 2);
        assert_eq!(AutoSplit::restore(&extra, 3).unwrap().estimates(), None);
        for bad in [
            "1/1/0/1,-2/1/0/1",
            "1/1/0/1,2/0/0/2",
            "1/1/0/1,2/1/0",
            "1/1/0/1,2/1/0/1:2:3:4",
            "x",
            "1/1/0/1,2/1/0/inf",
        ] {
            extra.insert(ESTIMATES_KEY.into(), bad.into());
            assert!(AutoSplit::restore(&extra, 2).is_err(), "{bad}");
        }
    }
}
