//! Element-wise ops: GELU and its derivative, residual adds, scaling.
//!
//! Each rayon task takes a chunk of [`ELEMENTWISE_GRAIN`] elements and runs plain loops over it, which
//! the compiler turns into vector instructions; a per-element closure (`par_iter().for_each`) would not.

use super::{c, ELEMENTWISE_GRAIN};
use crate::backend::cpu::real::Real;
use rayon::prelude::*;

fn gelu_scale<F: Real>() -> F {
    c::<F>((2.0 / std::f64::consts::PI).sqrt())
}

/// The argument of GELU's tanh, `sqrt(2/pi) (x + 0.044715 x^3)`, of each `x` into `arg`.
fn gelu_tanh_arg<F: Real>(arg: &mut [F], inp: &[F]) {
    let k = gelu_scale::<F>();
    for (a, &x) in arg.iter_mut().zip(inp) {
        let cube = c::<F>(0.044715) * x * x * x;
        *a = k * (x + cube);
    }
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_forward<F: Real>(out: &mut [F], inp: &[F]) {
    out.par_chunks_mut(ELEMENTWISE_GRAIN)
        .zip(inp.par_chunks(ELEMENTWISE_GRAIN))
        .for_each(|(out, inp)| gelu_chunk(out, inp));
}

/// [`gelu_forward`] of one chunk, on the calling thread. Each element's result depends on that element
/// alone, so any chunking gives the same bits.
pub fn gelu_chunk<F: Real>(out: &mut [F], inp: &[F]) {
    // `out` holds the tanh argument, then its tanh, then the result: three passes over a chunk that stays
    // in cache.
    gelu_tanh_arg(out, inp);
    F::tanh_in_place(out);
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = c::<F>(0.5) * x * (F::one() + *o);
    }
}

/// Overwrites `dinp` with `dout * gelu'(inp)`.
pub fn gelu_backward<F: Real>(dinp: &mut [F], inp: &[F], dout: &[F]) {
    let k = gelu_scale::<F>();
    dinp.par_chunks_mut(ELEMENTWISE_GRAIN)
        .zip(
            inp.par_chunks(ELEMENTWISE_GRAIN)
                .zip(dout.par_chunks(ELEMENTWISE_GRAIN)),
        )
        .for_each(|(dinp, (inp, dout))| {
            // `dinp` holds tanh(arg) until the last pass overwrites it with the gradient.
            gelu_tanh_arg(dinp, inp);
            F::tanh_in_place(dinp);
            for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
                let tanh_out = *d;
                // sech^2 = 1 - tanh^2: the same derivative without a second transcendental call.
                let sech2 = F::one() - tanh_out * tanh_out;
                let local = c::<F>(0.5) * (F::one() + tanh_out)
                    + x * c::<F>(0.5) * sech2 * k * (F::one() + c::<F>(3.0 * 0.044715) * x * x);
                *d = local * g;
            }
        });
}

/// `out = a + b`.
pub fn residual_forward<F: Real>(out: &mut [F], a: &[F], b: &[F]) {
    out.par_chunks_mut(ELEMENTWISE_GRAIN)
        .zip(a.par_chunks(ELEMENTWISE_GRAIN).zip(b.par_chunks(ELEMENTWISE_GRAIN)))
        .for_each(|(out, (a, b))| {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = x + y;
            }
        });
}

/// `dst += src`.
pub fn add_inplace<F: Real>(dst: &mut [F], src: &[F]) {
    dst.par_chunks_mut(ELEMENTWISE_GRAIN)
        .zip(src.par_chunks(ELEMENTWISE_GRAIN))
        .for_each(|(dst, src)| {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = *d + s;
            }
        });
}

/// `x *= s`.
pub fn scale<F: Real>(x: &mut [F], s: F) {
    x.par_chunks_mut(ELEMENTWISE_GRAIN).for_each(|x| {
        for v in x {
            *v = *v * s;
        }
    });
}
