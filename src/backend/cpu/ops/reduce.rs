//! Reductions whose order is fixed whatever the thread count.

use crate::backend::cpu::real::Real;
use rayon::prelude::*;

/// Block size of the fixed two-level reduction tree in [`sum_squares`].
pub const SUM_BLOCK: usize = 4096;

/// `sum(x^2)` in f64: per-block sums, then the block sums in order. Independent of thread count.
pub fn sum_squares<F: Real>(x: &[F]) -> f64 {
    let partial: Vec<f64> = x
        .par_chunks(SUM_BLOCK)
        .map(|blk| blk.iter().fold(0.0f64, |a, &v| a + v.to_f64() * v.to_f64()))
        .collect();
    partial.iter().sum()
}
