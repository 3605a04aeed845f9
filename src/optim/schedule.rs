//! Learning-rate schedules: constant (with optional warmup) and linear warmup then cosine decay to `min_lr`.

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScheduleKind {
    Constant,
    Cosine,
}

impl std::str::FromStr for ScheduleKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "constant" => Ok(ScheduleKind::Constant),
            "cosine" => Ok(ScheduleKind::Cosine),
            other => bail!("unknown --lr-schedule {other:?}: expected constant or cosine"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    /// Peak learning rate (after any batch-size scaling).
    pub lr: f64,
    /// Steps of linear warmup from lr/warmup to lr.
    pub warmup: u64,
    /// Floor of the cosine decay.
    pub min_lr: f64,
    /// Total optimizer steps of the run (the cosine reaches `min_lr` at the last step).
    pub total_steps: u64,
}

impl LrSchedule {
    /// The learning rate of the 0-based optimizer step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.lr,
            ScheduleKind::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup).max(1) as f64;
                let progress = ((step - self.warmup) as f64 / span).min(1.0);
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                self.min_lr + coeff * (self.lr - self.min_lr)
            }
        }
    }
}

/// How the learning rate follows the global batch (relative to `--base-batch`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrScaling {
    None,
    Linear,
    Sqrt,
}

impl std::str::FromStr for LrScaling {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(LrScaling::None),
            "linear" => Ok(LrScaling::Linear),
            "sqrt" => Ok(LrScaling::Sqrt),
            other => bail!("unknown --lr-scaling {other:?}: expected none, linear or sqrt"),
        }
    }
}

impl LrScaling {
    /// The factor applied to `--lr` for a global batch of `global` sequences against `base` sequences.
    pub fn factor(&self, global: usize, base: usize) -> f64 {
        let ratio = global as f64 / base.max(1) as f64;
        match self {
            LrScaling::None => 1.0,
            LrScaling::Linear => ratio,
            LrScaling::Sqrt => ratio.sqrt(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_warms_up_then_decays_to_min() {
        let s = LrSchedule {
            kind: ScheduleKind::Cosine,
            lr: 1.0,
            warmup: 10,
            min_lr: 0.1,
            total_steps: 110,
        };
        assert!((s.lr_at(0) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(9) - 1.0).abs() < 1e-12);
        assert!((s.lr_at(10) - 1.0).abs() < 1e-12);
        assert!((s.lr_at(60) - 0.55).abs() < 1e-12);
        assert!((s.lr_at(110) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(500) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn constant_with_warmup() {
        let s = LrSchedule {
            kind: ScheduleKind::Constant,
            lr: 2.0,
            warmup: 4,
            min_lr: 0.0,
            total_steps: 10,
        };
        assert_eq!(s.lr_at(1), 1.0);
        assert_eq!(s.lr_at(7), 2.0);
    }

    #[test]
    fn scaling_rules() {
        assert_eq!(LrScaling::Linear.factor(64, 16), 4.0);
        assert_eq!(LrScaling::Sqrt.factor(64, 16), 2.0);
        assert_eq!(LrScaling::None.factor(64, 16), 1.0);
    }
}
