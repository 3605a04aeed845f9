//! What a step's communication cost it, measured so that the two figures cannot contradict each other:
//! - busy: the time the communication thread spent in the collectives the step waited for;
//! - exposed: the part of that time during which the compute thread was waiting for them.
//!
//! Both come from intervals: each waited job's run on the communication thread, and each wait of the compute
//! thread. The thread runs one job at a time and the compute thread waits for one at a time, so each set is
//! disjoint, and the sum of their pairwise overlaps is the measure of the compute thread's waits that fell
//! in collectives: never more than the collectives' own time. What the step spends around the collectives
//! (read-backs, uploads, the gradient norm) is the rank's own work, not communication.

use crate::collective::comm_thread::{JobTimes, Pending};
use crate::collective::Result;
use std::time::{Duration, Instant};

/// The intervals of one step's waited collectives and of the waits for them.
#[derive(Debug, Default)]
pub struct CommLedger {
    /// When each waited job ran on the communication thread: (start, end).
    jobs: Vec<(Instant, Instant)>,
    /// When the compute thread waited: (start, end).
    waits: Vec<(Instant, Instant)>,
}

/// One step's communication, as [`CommLedger::take`] sums it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommTime {
    pub busy: Duration,
    /// At most `busy`.
    pub exposed: Duration,
}

impl CommLedger {
    /// Waits for `pending`, recording when its job ran and how long this thread waited.
    pub fn wait<T>(&mut self, pending: Pending<T>) -> Result<(T, JobTimes)> {
        let from = Instant::now();
        let (value, times) = pending.wait_timed()?;
        self.record(times, (from, Instant::now()));
        Ok((value, times))
    }

    fn record(&mut self, job: JobTimes, wait: (Instant, Instant)) {
        self.jobs.push((job.started, job.started + job.took));
        self.waits.push(wait);
    }

    /// Forgets what was recorded (waits outside a step, such as a save settling the parameters, belong to
    /// no step).
    pub fn clear(&mut self) {
        self.jobs.clear();
        self.waits.clear();
    }

    /// The step's busy and exposed time; clears the ledger.
    pub fn take(&mut self) -> CommTime {
        let busy = self.jobs.iter().map(|&(a, b)| b.saturating_duration_since(a)).sum();
        let mut exposed = Duration::ZERO;
        for &(wa, wb) in &self.waits {
            for &(ja, jb) in &self.jobs {
                exposed += wb.min(jb).saturating_duration_since(wa.max(ja));
            }
        }
        self.clear();
        CommTime { busy, exposed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    fn job(base: Instant, from: u64, to: u64) -> JobTimes {
        JobTimes {
            started: at(base, from),
            took: Duration::from_millis(to - from),
        }
    }

    #[test]
    fn exposed_is_the_waits_within_the_collectives() {
        let t = Instant::now();
        let mut ledger = CommLedger::default();
        // Bucket 1 ran 0-10 ms while backward computed; the wait for it began at 12 (nothing exposed).
        ledger.record(job(t, 0, 10), (at(t, 12), at(t, 12)));
        // Bucket 2 ran 10-30; the compute thread waited from 12 to 31 (1 ms of wake-up after it).
        ledger.record(job(t, 10, 30), (at(t, 12), at(t, 31)));
        // The scalars ran 35-37 and were waited for from 34 to 38.
        ledger.record(job(t, 35, 37), (at(t, 34), at(t, 38)));
        let got = ledger.take();
        assert_eq!(got.busy, Duration::from_millis(32));
        assert_eq!(got.exposed, Duration::from_millis(18 + 2));
        assert_eq!(ledger.take(), CommTime::default());
    }

    #[test]
    fn a_wait_spanning_earlier_jobs_counts_them() {
        let t = Instant::now();
        let mut ledger = CommLedger::default();
        // The compute thread waits for bucket 2 from 0 while bucket 1 (waited for earlier, instantly) runs.
        ledger.record(job(t, 0, 5), (at(t, 0), at(t, 0)));
        ledger.record(job(t, 5, 9), (at(t, 0), at(t, 9)));
        let got = ledger.take();
        assert_eq!(
            (got.busy, got.exposed),
            (Duration::from_millis(9), Duration::from_millis(9))
        );
    }

    #[test]
    fn exposed_never_exceeds_busy() {
        let t = Instant::now();
        let mut ledger = CommLedger::default();
        // Waits far longer than the jobs, in every arrangement.
        for k in 0..20u64 {
            ledger.record(job(t, 10 * k, 10 * k + 3), (at(t, 10 * k), at(t, 10 * k + 10)));
        }
        let got = ledger.take();
        assert!(got.exposed <= got.busy, "{got:?}");
        assert_eq!(got.exposed, Duration::from_millis(60));
    }
}
