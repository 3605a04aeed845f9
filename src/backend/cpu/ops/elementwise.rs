//! Element-wise ops: GELU and its derivative, residual adds, scaling.

use super::{c, ELEMENTWISE_GRAIN};
use crate::backend::cpu::real::Real;
use rayon::prelude::*;

fn gelu_scale<F: Real>() -> F {
    c::<F>((2.0 / std::f64::consts::PI).sqrt())
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_forward<F: Real>(out: &mut [F], inp: &[F]) {
    let k = gelu_scale::<F>();
    out.par_iter_mut()
        .zip(inp.par_iter())
        .with_min_len(ELEMENTWISE_GRAIN)
        .for_each(|(o, &x)| {
            let cube = c::<F>(0.044715) * x * x * x;
            *o = c::<F>(0.5) * x * (F::one() + (k * (x + cube)).tanh());
        });
}

/// Overwrites `dinp` with `dout * gelu'(inp)`.
pub fn gelu_backward<F: Real>(dinp: &mut [F], inp: &[F], dout: &[F]) {
    let k = gelu_scale::<F>();
    dinp.par_iter_mut()
        .zip(inp.par_iter().zip(dout.par_iter()))
        .with_min_len(ELEMENTWISE_GRAIN)
        .for_each(|(d, (&x, &g))| {
            let cube = c::<F>(0.044715) * x * x * x;
            let tanh_arg = k * (x + cube);
            let tanh_out = tanh_arg.tanh();
            // sech^2 = 1 - tanh^2: the same derivative without a second transcendental call.
            let sech2 = F::one() - tanh_out * tanh_out;
            let local = c::<F>(0.5) * (F::one() + tanh_out)
                + x * c::<F>(0.5) * sech2 * k * (F::one() + c::<F>(3.0 * 0.044715) * x * x);
            *d = local * g;
        });
}

/// `out = a + b`.
pub fn residual_forward<F: Real>(out: &mut [F], a: &[F], b: &[F]) {
    out.par_iter_mut()
        .zip(a.par_iter().zip(b.par_iter()))
        .with_min_len(ELEMENTWISE_GRAIN)
        .for_each(|(o, (&x, &y))| *o = x + y);
}

/// `dst += src`.
pub fn add_inplace<F: Real>(dst: &mut [F], src: &[F]) {
    dst.par_iter_mut()
        .zip(src.par_iter())
        .with_min_len(ELEMENTWISE_GRAIN)
        .for_each(|(d, &s)| *d = *d + s);
}

/// `x *= s`.
pub fn scale<F: Real>(x: &mut [F], s: F) {
    x.par_iter_mut()
        .with_min_len(ELEMENTWISE_GRAIN)
        .for_each(|v| *v = *v * s);
}
