//! Softmax cross-entropy over the vocabulary and its gradient.

use crate::backend::cpu::real::Real;
use rayon::prelude::*;

/// Row-wise log-sum-exp, max-shifted for stability.
fn logsumexp<F: Real>(row: &[F]) -> F {
    let max = row.iter().copied().fold(F::neg_infinity(), F::max);
    let sum = row.iter().fold(F::zero(), |a, &x| a + (x - max).exp());
    max + sum.ln()
}

/// `losses[i] = logsumexp(logits[i,:]) - logits[i, targets[i]]`.
pub fn crossentropy_forward<F: Real>(losses: &mut [F], logits: &[F], targets: &[u32], v: usize) {
    losses.par_iter_mut().enumerate().for_each(|(i, loss)| {
        let row = &logits[i * v..][..v];
        *loss = logsumexp(row) - row[targets[i] as usize];
    });
}

/// In place over `[n, v]`: logits become `dloss * (softmax(logits) - onehot(targets))`.
pub fn crossentropy_backward_inplace<F: Real>(logits: &mut [F], targets: &[u32], v: usize, dloss: F) {
    logits
        .par_chunks_mut(v)
        .zip(targets.par_iter())
        .for_each(|(row, &target)| {
            let lse = logsumexp(row);
            gradient_row(row, lse, target, dloss);
        });
}

/// [`crossentropy_forward`] then [`crossentropy_backward_inplace`], with one log-sum-exp per row instead of
/// two: the same bits.
pub fn crossentropy_forward_backward<F: Real>(losses: &mut [F], logits: &mut [F], targets: &[u32], v: usize, dloss: F) {
    logits
        .par_chunks_mut(v)
        .zip(losses.par_iter_mut().zip(targets.par_iter()))
        .for_each(|(row, (loss, &target))| {
            let lse = logsumexp(row);
            *loss = lse - row[target as usize];
            gradient_row(row, lse, target, dloss);
        });
}

/// One row of logits, whose log-sum-exp is `lse`, replaced by its gradient.
fn gradient_row<F: Real>(row: &mut [F], lse: F, target: u32, dloss: F) {
    for (j, x) in row.iter_mut().enumerate() {
        let p = (*x - lse).exp();
        let indicator = if j == target as usize { F::one() } else { F::zero() };
        *x = dloss * (p - indicator);
    }
}
