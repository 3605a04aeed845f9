//! `--loss-spike X`: a warning when a step's loss exceeds X times a running average of the earlier steps'
//! losses. It only reports; training goes on unchanged.
//!
//! The reference is an exponential moving average (weight [`EMA_WEIGHT`] on the newest loss), not the
//! previous step's loss: one step's loss on a small batch is noisy, and a single low step would make the
//! next ordinary one look like a spike. While the loss falls the average lags above it, which only makes
//! the check more conservative. A spike step still enters the average, so a loss that stays high is reported
//! for a few steps and then becomes the new reference. Non-finite losses are left out: `--on-nonfinite`
//! handles them. The average starts afresh in every process (it is not in checkpoints), so the first step
//! of a run or a resume is never a spike.

/// Weight of the newest loss in the running average: it spans about the last ten steps.
pub const EMA_WEIGHT: f64 = 0.1;

/// The default factor: a loss three times its recent average is a divergence, not noise, for a
/// cross-entropy loss.
pub const DEFAULT_LOSS_SPIKE: f64 = 3.0;

/// Compares each step's loss with the running average of the earlier ones.
#[derive(Clone, Debug)]
pub struct LossSpikeDetector {
    /// The factor; 0 turns the check off.
    factor: f64,
    average: Option<f64>,
}

impl LossSpikeDetector {
    /// A detector reporting losses over `factor` times the average (0: never).
    pub fn new(factor: f64) -> LossSpikeDetector {
        LossSpikeDetector { factor, average: None }
    }

    /// Takes a step's loss; returns the reference it exceeded by more than the factor, if it did.
    pub fn observe(&mut self, loss: f64) -> Option<f64> {
        if !loss.is_finite() {
            return None;
        }
        let reference = self.average;
        self.average = Some(match reference {
            None => loss,
            Some(avg) => avg + EMA_WEIGHT * (loss - avg),
        });
        let reference = reference?;
        (self.factor > 0.0 && loss > self.factor * reference).then_some(reference)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_over_the_factor_times_the_average_is_reported_with_its_reference() {
        let mut d = LossSpikeDetector::new(3.0);
        // The first loss only sets the reference.
        assert_eq!(d.observe(2.0), None);
        assert_eq!(d.observe(2.0), None);
        // Exactly three times is not over.
        assert_eq!(d.observe(6.0), None);
        // The average is now 2.0 + 0.1 * 4.0 = 2.4.
        let reference = d.observe(7.3).expect("7.3 > 3 * 2.4");
        assert!((reference - 2.4).abs() < 1e-12, "{reference}");
    }

    #[test]
    fn the_reference_is_a_running_average_not_the_last_step() {
        let mut d = LossSpikeDetector::new(3.0);
        for _ in 0..20 {
            d.observe(3.0);
        }
        // One unusually low step does not make the next ordinary one a spike...
        assert_eq!(d.observe(0.5), None);
        assert_eq!(d.observe(3.0), None);
        // ...and a loss that stays high stops being reported once the average has caught up.
        let reported: Vec<bool> = (0..30).map(|_| d.observe(30.0).is_some()).collect();
        assert!(reported[0] && reported[1]);
        assert!(!reported[29]);
        let first_quiet = reported.iter().position(|r| !r).unwrap();
        assert!(reported[first_quiet..].iter().all(|r| !r));
    }

    #[test]
    fn non_finite_losses_and_a_zero_factor_report_nothing() {
        let mut d = LossSpikeDetector::new(3.0);
        assert_eq!(d.observe(f64::NAN), None);
        assert_eq!(d.observe(1.0), None);
        assert_eq!(d.observe(f64::INFINITY), None);
        // The NaN and the Inf left the average alone.
        assert_eq!(d.observe(3.5), Some(1.0));
        let mut off = LossSpikeDetector::new(0.0);
        off.observe(1.0);
        assert_eq!(off.observe(1e9), None);
    }
}
