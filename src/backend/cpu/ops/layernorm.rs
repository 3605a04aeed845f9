//! Layer norm over the channel dimension, saving mean and 1/std for backward.

use super::c;
use crate::backend::cpu::real::Real;
use rayon::prelude::*;

pub const LAYERNORM_EPS: f64 = 1e-5;

/// Columns per task in the parameter-gradient sweep.
const COLUMNS_PER_TASK: usize = 64;

/// Layer norm of each row of `inp [n, c]`; saves the row mean and 1/std for backward.
pub fn layernorm_forward<F: Real>(
    out: &mut [F],
    mean: &mut [F],
    rstd: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: &[F],
    ch: usize,
) {
    out.par_chunks_mut(ch)
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .enumerate()
        .for_each(|(row, (o, (m, s)))| {
            (*m, *s) = layernorm_row(o, &inp[row * ch..][..ch], weight, bias);
        });
}

/// `residual += skip` row by row, then [`layernorm_forward`] of that row while it is in cache: the same
/// bits as the two passes.
#[allow(clippy::too_many_arguments)]
pub fn add_layernorm_forward<F: Real>(
    residual: &mut [F],
    skip: &[F],
    out: &mut [F],
    mean: &mut [F],
    rstd: &mut [F],
    weight: &[F],
    bias: &[F],
    ch: usize,
) {
    residual
        .par_chunks_mut(ch)
        .zip(out.par_chunks_mut(ch))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .enumerate()
        .for_each(|(row, ((x, o), (m, s)))| {
            for (v, &k) in x.iter_mut().zip(&skip[row * ch..][..ch]) {
                *v = *v + k;
            }
            (*m, *s) = layernorm_row(o, x, weight, bias);
        });
}

/// The layer norm of one row `x [c]` into `o`; returns its mean and 1/std.
fn layernorm_row<F: Real>(o: &mut [F], x: &[F], weight: &[F], bias: &[F]) -> (F, F) {
    let n = F::from_f64(x.len() as f64);
    let mu = x.iter().copied().fold(F::zero(), |a, b| a + b) / n;
    let var = x.iter().fold(F::zero(), |a, &v| a + (v - mu) * (v - mu)) / n;
    let r = F::one() / (var + c(LAYERNORM_EPS)).sqrt();
    for i in 0..x.len() {
        o[i] = (x[i] - mu) * r * weight[i] + bias[i];
    }
    (mu, r)
}

/// Accumulates the layer-norm gradients: `dinp += ...`, `dweight += ...`, `dbias += ...`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<F: Real>(
    dinp: &mut [F],
    dweight: &mut [F],
    dbias: &mut [F],
    dout: &[F],
    inp: &[F],
    weight: &[F],
    mean: &[F],
    rstd: &[F],
    ch: usize,
) {
    let n = F::from_f64(ch as f64);
    // Input gradient, one row per task.
    dinp.par_chunks_mut(ch).enumerate().for_each(|(row, di)| {
        let x = &inp[row * ch..][..ch];
        let d = &dout[row * ch..][..ch];
        let (mu, r) = (mean[row], rstd[row]);
        let mut dnorm_mean = F::zero();
        let mut dnorm_norm_mean = F::zero();
        for i in 0..ch {
            let norm = (x[i] - mu) * r;
            let dnorm = weight[i] * d[i];
            dnorm_mean = dnorm_mean + dnorm;
            dnorm_norm_mean = dnorm_norm_mean + dnorm * norm;
        }
        dnorm_mean = dnorm_mean / n;
        dnorm_norm_mean = dnorm_norm_mean / n;
        for i in 0..ch {
            let norm = (x[i] - mu) * r;
            let dnorm = weight[i] * d[i];
            di[i] = di[i] + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
        }
    });
    // Parameter gradients: each task owns a block of columns and sweeps the rows in order, so every
    // column is summed row after row (the same order as one column at a time) while the inner loop runs
    // along contiguous memory.
    let rows = mean.len();
    dweight
        .par_chunks_mut(COLUMNS_PER_TASK)
        .zip(dbias.par_chunks_mut(COLUMNS_PER_TASK))
        .enumerate()
        .for_each(|(block, (dw, db))| {
            let (first, width) = (block * COLUMNS_PER_TASK, dw.len());
            // [width] each: this block's running sums over the rows seen so far.
            let (mut sum_w, mut sum_b) = (vec![F::zero(); width], vec![F::zero(); width]);
            for row in 0..rows {
                let (mu, r) = (mean[row], rstd[row]);
                let x = &inp[row * ch + first..][..width];
                let d = &dout[row * ch + first..][..width];
                for i in 0..width {
                    let norm = (x[i] - mu) * r;
                    sum_w[i] = sum_w[i] + norm * d[i];
                    sum_b[i] = sum_b[i] + d[i];
                }
            }
            for i in 0..width {
                dw[i] = dw[i] + sum_w[i];
                db[i] = db[i] + sum_b[i];
            }
        });
}
