//! Fault injection in real processes: `RINGTRAIN_INJECT_FAULT=nonfinite=RANK:STEP[:nan|inf]` makes one
//! element of rank RANK's local gradient NaN (the default) or +Inf at optimizer step STEP (counted from 1),
//! so that tests can check what every rank of a real job does when one rank's gradient goes bad. No honest
//! input makes one rank's gradient non-finite while the others' stay finite, hence a hook.
//!
//! The grammar follows the sim's `--fault KIND=VALUE` (`drop=RANK:AFTER`). The element is the last one of
//! the flat layout (`ln_f.bias`), which backward finishes first: it is written on the device as soon as
//! backward reports it final and before its bucket is read back, so the bad value travels through the
//! real synchronisation, while backward goes on (`--overlap on`) or after it (`off`), like any gradient.
//! The CLI reads the variable and arms the trainer ([`super::Trainer::arm_fault`]); the library never
//! reads the environment.

use super::Trainer;
use crate::backend::{Backend, View};
use anyhow::{bail, ensure, Context, Result};
use std::fmt;

/// The environment variable that arms a fault.
pub const INJECT_FAULT_VAR: &str = "RINGTRAIN_INJECT_FAULT";

/// The value written into the gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadValue {
    Nan,
    /// +Inf.
    Inf,
}

impl BadValue {
    fn value(self) -> f32 {
        match self {
            BadValue::Nan => f32::NAN,
            BadValue::Inf => f32::INFINITY,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            BadValue::Nan => "nan",
            BadValue::Inf => "inf",
        }
    }
}

/// One rank's gradient made non-finite at one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NonFiniteFault {
    pub rank: usize,
    /// Optimizer step, counted from 1 (as in the logs and the metrics).
    pub step: u64,
    pub value: BadValue,
}

impl fmt::Display for BadValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BadValue::Nan => "NaN",
            BadValue::Inf => "+Inf",
        })
    }
}

impl fmt::Display for NonFiniteFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nonfinite={}:{}:{}", self.rank, self.step, self.value.as_str())
    }
}

impl NonFiniteFault {
    /// Parses `nonfinite=RANK:STEP[:nan|inf]`; errors name the variable and the expected form.
    pub fn parse(spec: &str) -> Result<NonFiniteFault> {
        let form = "expected nonfinite=RANK:STEP[:nan|inf], e.g. nonfinite=1:3:inf";
        let fail = || format!("{INJECT_FAULT_VAR}={spec:?}: {form}");
        let Some((kind, value)) = spec.trim().split_once('=') else {
            bail!("{}", fail())
        };
        ensure!(
            kind == "nonfinite",
            "{INJECT_FAULT_VAR}={spec:?}: unknown fault kind {kind:?} ({form})"
        );
        let parts: Vec<&str> = value.split(':').collect();
        let (rank, step, bad) = match parts.as_slice() {
            [rank, step] => (rank, step, BadValue::Nan),
            [rank, step, "nan"] => (rank, step, BadValue::Nan),
            [rank, step, "inf"] => (rank, step, BadValue::Inf),
            [_, _, other] => bail!("{INJECT_FAULT_VAR}={spec:?}: value {other:?} is not nan or inf"),
            _ => bail!("{}", fail()),
        };
        let rank = rank.parse().with_context(|| format!("{}: bad RANK {rank:?}", fail()))?;
        let step: u64 = step.parse().with_context(|| format!("{}: bad STEP {step:?}", fail()))?;
        ensure!(step >= 1, "{INJECT_FAULT_VAR}={spec:?}: STEP counts from 1");
        Ok(NonFiniteFault { rank, step, value: bad })
    }

    /// The fault the variable's `value` arms in a job of `world` ranks and `steps` optimizer steps: none
    /// when unset, an error when it names a rank or a step the job does not have (it would never fire).
    pub fn from_env(value: Option<&str>, world: usize, steps: u64) -> Result<Option<NonFiniteFault>> {
        let Some(spec) = value else { return Ok(None) };
        let fault = NonFiniteFault::parse(spec)?;
        ensure!(
            fault.rank < world,
            "{INJECT_FAULT_VAR}={spec:?}: rank {} does not exist in a job of {world} rank(s)",
            fault.rank
        );
        ensure!(
            fault.step <= steps,
            "{INJECT_FAULT_VAR}={spec:?}: step {} is after the last step ({steps})",
            fault.step
        );
        Ok(Some(fault))
    }

    /// Whether rank `rank` injects in the step whose 0-based index is `step_index`.
    pub fn fires(&self, rank: usize, step_index: u64) -> bool {
        self.rank == rank && self.step == step_index + 1
    }
}

/// A fault due in the current step, not yet written.
#[derive(Debug)]
pub struct PendingInjection {
    /// The flat gradient element to overwrite.
    element: usize,
    value: BadValue,
}

impl PendingInjection {
    /// The injection of `fault` into a gradient of `total` elements (its last element).
    pub fn new(fault: NonFiniteFault, total: usize) -> PendingInjection {
        PendingInjection {
            element: total - 1,
            value: fault.value,
        }
    }
}

/// Backward has finished the gradient elements `from..`: writes the pending value if its element is among
/// them, and then forgets it.
pub fn write_if_final<B: Backend>(
    pending: &mut Option<PendingInjection>,
    be: &mut B,
    grads: View,
    from: usize,
) -> Result<()> {
    if let Some(p) = pending.take_if(|p| p.element >= from) {
        be.upload(grads.sub(p.element, 1), &[p.value.value()])?;
    }
    Ok(())
}

/// The bit [`BitFlip`] flips: the top mantissa bit, so the value changes by up to half its magnitude and
/// stays finite with its sign (a flip of the exponent would turn into the non-finite fault's path).
pub const FLIP_BIT: u32 = 22;

/// Which state of the rank a [`BitFlip`] corrupts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlipTarget {
    Param,
    /// AdamW's first moment (`exp_avg`).
    Moment,
}

/// One bit of one element of one rank's state flipped after one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitFlip {
    pub rank: usize,
    /// After this step (counted from 1).
    pub step: u64,
    pub target: FlipTarget,
    /// Flat-layout element; `None`: the first element of the rank's shard (0 in replicated mode).
    pub element: Option<usize>,
}

/// The flat element a flip corrupts, and its offset in the buffer it lives in (the flat parameters, or the
/// moment of the owned ranges laid range after range).
pub fn flip_offset(flip: &BitFlip, total: usize, owned: &[std::ops::Range<usize>]) -> Result<(usize, usize)> {
    let first = owned.first().map_or(0, |r| r.start);
    let element = flip.element.unwrap_or(first);
    ensure!(
        element < total,
        "flip: element {element} is outside the model's {total} parameters"
    );
    match flip.target {
        FlipTarget::Param => Ok((element, element)),
        FlipTarget::Moment => {
            let mut at = 0;
            for r in owned {
                if r.contains(&element) {
                    return Ok((element, at + element - r.start));
                }
                at += r.len();
            }
            bail!(
                "flip: rank {} keeps no moment of element {element} (sharded, it keeps those of its shard {owned:?})",
                flip.rank
            )
        }
    }
}

impl<B: Backend> Trainer<B> {
    /// Flips [`FLIP_BIT`] of the element `flip` names in this rank's state (the sim's `flip` fault);
    /// returns the flat element.
    pub fn apply_flip(&mut self, flip: &BitFlip) -> Result<usize> {
        self.settle_params()?;
        let (element, offset) = flip_offset(flip, self.model.layout.total, &self.opt.owned)?;
        let view = match flip.target {
            FlipTarget::Param => self.model.params,
            FlipTarget::Moment => self.opt.m,
        };
        let one = view.sub(offset, 1);
        let mut value = [0f32];
        self.be.download(one, &mut value)?;
        value[0] = f32::from_bits(value[0].to_bits() ^ (1 << FLIP_BIT));
        self.be.upload(one, &value)?;
        Ok(element)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        let f = NonFiniteFault::parse("nonfinite=1:3").unwrap();
        assert_eq!(
            f,
            NonFiniteFault {
                rank: 1,
                step: 3,
                value: BadValue::Nan
            }
        );
        assert_eq!(NonFiniteFault::parse("nonfinite=2:7:inf").unwrap().value, BadValue::Inf);
        assert_eq!(
            NonFiniteFault::parse("nonfinite=0:1:nan").unwrap().to_string(),
            "nonfinite=0:1:nan"
        );
        assert!(f.fires(1, 2) && !f.fires(1, 3) && !f.fires(0, 2));
    }

    #[test]
    fn bad_specs_name_the_variable() {
        for bad in [
            "",
            "nonfinite",
            "nan=1:3",
            "nonfinite=1",
            "nonfinite=x:3",
            "nonfinite=1:-3",
            "nonfinite=1:0",
            "nonfinite=1:3:zero",
            "nonfinite=1:3:inf:4",
        ] {
            let err = format!("{:#}", NonFiniteFault::parse(bad).unwrap_err());
            assert!(err.contains(INJECT_FAULT_VAR), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_fault_that_could_never_fire_is_refused() {
        assert_eq!(NonFiniteFault::from_env(None, 3, 5).unwrap(), None);
        assert!(NonFiniteFault::from_env(Some("nonfinite=2:5"), 3, 5).unwrap().is_some());
        let err = NonFiniteFault::from_env(Some("nonfinite=3:2"), 3, 5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 3 does not exist"), "{err}");
        let err = NonFiniteFault::from_env(Some("nonfinite=0:6"), 3, 5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("after the last step"), "{err}");
    }

    #[test]
    fn writes_only_once_its_element_is_final() {
        use crate::backend::cpu::CpuBackend;
        let mut be = CpuBackend::<f32>::new();
        let grads = be.alloc(4).unwrap();
        be.upload(grads, &[1.0; 4]).unwrap();
        let fault = NonFiniteFault::parse("nonfinite=0:1:inf").unwrap();
        let mut pending = Some(PendingInjection::new(fault, 4));
        // Backward has finished nothing yet.
        write_if_final(&mut pending, &mut be, grads, 4).unwrap();
        let mut host = [0.0; 4];
        be.download(grads, &mut host).unwrap();
        assert_eq!((host, pending.is_some()), ([1.0; 4], true));
        write_if_final(&mut pending, &mut be, grads, 2).unwrap();
        be.download(grads, &mut host).unwrap();
        assert_eq!((host, pending.is_some()), ([1.0, 1.0, 1.0, f32::INFINITY], false));
    }
}
