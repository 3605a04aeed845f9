//! The AdamW update, element by element.

use super::ELEMENTWISE_GRAIN;
use crate::backend::cpu::real::Real;
use crate::backend::AdamWStep;
use rayon::prelude::*;

/// torch.optim.AdamW (single-tensor path), element by element:
/// `p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2 v + (1-b2) g^2; p -= step_size * m / (sqrt(v)/bc2_sqrt + eps)`.
pub fn adamw<F: Real>(params: &mut [F], grads: &[F], m: &mut [F], v: &mut [F], h: &AdamWStep) {
    let f = |x: f32| F::from_f32(x);
    let (lr, wd, b1, b2, eps) = (f(h.lr), f(h.weight_decay), f(h.beta1), f(h.beta2), f(h.eps));
    let (step_size, bc2_sqrt, gs) = (f(h.step_size), f(h.bias_correction2_sqrt), f(h.grad_scale));
    let decay = F::one() - lr * wd;
    let chunks = params
        .par_chunks_mut(ELEMENTWISE_GRAIN)
        .zip(grads.par_chunks(ELEMENTWISE_GRAIN))
        .zip(
            m.par_chunks_mut(ELEMENTWISE_GRAIN)
                .zip(v.par_chunks_mut(ELEMENTWISE_GRAIN)),
        );
    chunks.for_each(|((params, grads), (m, v))| {
        for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = g * gs;
            *p = *p * decay;
            *m = *m + (g - *m) * (F::one() - b1);
            *v = *v * b2 + g * g * (F::one() - b2);
            let denom = v.sqrt() / bc2_sqrt + eps;
            *p = *p - step_size * (*m / denom);
        }
    });
}

/// [`adamw`] with `h.weight_decay` inside the runs `[s0, e0, s1, e1, ...]` (ascending offsets) only: each
/// stretch between two boundaries as one call, with the decay or with none.
pub fn adamw_runs<F: Real>(params: &mut [F], grads: &[F], m: &mut [F], v: &mut [F], h: &AdamWStep, runs: &[u32]) {
    let n = params.len();
    let mut at = 0;
    let bounds = runs.iter().map(|&b| (b as usize).min(n)).chain(std::iter::once(n));
    for (k, end) in bounds.enumerate() {
        if end > at {
            let step = AdamWStep {
                weight_decay: if k % 2 == 1 { h.weight_decay } else { 0.0 },
                ..*h
            };
            let r = at..end;
            adamw(
                &mut params[r.clone()],
                &grads[r.clone()],
                &mut m[r.clone()],
                &mut v[r],
                &step,
            );
        }
        at = at.max(end);
    }
}
