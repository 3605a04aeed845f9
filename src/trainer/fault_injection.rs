//! The trainer's part of a [`FaultPlan`]: the kinds that act on one rank's computation or state rather than
//! on its messages. The run's plan comes from the sim's `--fault`, the library API, or in a real process
//! from `RINGTRAIN_INJECT_FAULT` ([`crate::fault_plan::INJECT_FAULT_VAR`]), which the CLI reads; the
//! transports apply the message kinds of the same plan.
//!
//! - `nan`/`inf`: the element is the last one of the flat layout (`ln_f.bias`), which backward finishes
//!   first: it is written on the device as soon as backward reports it final and before its bucket is read
//!   back, so the bad value travels through the real synchronisation, while backward goes on (`--overlap
//!   on`) or after it (`off`), like any gradient. No honest input makes one rank's gradient non-finite
//!   while the others' stay finite, hence a hook.
//! - `compute`: the rank sleeps before each micro-batch's forward, so it is slow at computing (a slower
//!   GPU), not at handling messages.
//! - `freeze`: at the start of the step the rank's compute thread and its communication thread both sleep,
//!   so it neither computes nor takes part in collectives for that time.
//! - `flip`: applied by the run loop after the step's observer has seen it ([`super::Trainer::run`]).

use super::Trainer;
use crate::backend::{Backend, View};
use crate::fault_plan::{BadValue, FlipTarget, FLIP_BIT};
use anyhow::{bail, ensure, Result};

/// A fault due in the current step, not yet written.
#[derive(Debug)]
pub struct PendingInjection {
    /// The flat gradient element to overwrite.
    element: usize,
    value: BadValue,
}

impl PendingInjection {
    /// The injection of `value` into a gradient of `total` elements (its last element).
    pub fn new(value: BadValue, total: usize) -> PendingInjection {
        PendingInjection {
            element: total - 1,
            value,
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

/// The flat element a flip corrupts, and its offset in the buffer it lives in (the flat parameters, or the
/// moment of the owned ranges laid range after range).
pub fn flip_offset(
    rank: usize,
    target: FlipTarget,
    element: Option<usize>,
    total: usize,
    owned: &[std::ops::Range<usize>],
) -> Result<(usize, usize)> {
    let first = owned.first().map_or(0, |r| r.start);
    let element = element.unwrap_or(first);
    ensure!(
        element < total,
        "flip: element {element} is outside the model's {total} parameters"
    );
    match target {
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
                rank
            )
        }
    }
}

impl<B: Backend> Trainer<B> {
    /// Flips [`FLIP_BIT`] of `element` (default: the first of this rank's shard) of this rank's parameters
    /// or first moment (the `flip` fault); returns the flat element.
    pub(super) fn apply_flip(&mut self, target: FlipTarget, element: Option<usize>) -> Result<usize> {
        self.settle_params()?;
        let (element, offset) = flip_offset(self.rank, target, element, self.model.layout.total, &self.opt.owned)?;
        let view = match target {
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
    fn writes_only_once_its_element_is_final() {
        use crate::backend::cpu::CpuBackend;
        let mut be = CpuBackend::<f32>::new();
        let grads = be.alloc(4).unwrap();
        be.upload(grads, &[1.0; 4]).unwrap();
        let mut pending = Some(PendingInjection::new(BadValue::Inf, 4));
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
