//! Causal multi-head self-attention forward and backward, as matrix products per (sequence, head).
//!
//! For sequence b and head h, Q, K and V are `[t, hs]` column slices of qkv `[t, 3c]` (row stride 3c,
//! column offsets h*hs, c + h*hs and 2c + h*hs), so every product below is a strided GEMM with no copy:
//!
//! - forward:  S = Q Kᵀ / sqrt(hs);  P = softmax of row i of S over keys 0..=i (0 above the diagonal);
//!   O = P V.
//! - backward: dP = dO Vᵀ;  dV = Pᵀ dO;  dS = P ∘ (dP - rowsum(P ∘ dP));  dQ = dS K / sqrt(hs);
//!   dK = dSᵀ Q / sqrt(hs).
//!
//! The causal mask skips work in blocks of [`BLOCK`] rows: queries [i0, i1) attend only to keys [0, i1),
//! and keys [j0, j1) receive gradient only from queries [j0, t). The few entries above the diagonal that
//! a block computes anyway are overwritten with 0 by the softmax (and its backward) before any product
//! reads them, so they add exact zeros.
//!
//! Determinism: one task per sequence (its out, att, dqkv and datt are disjoint slices); inside it every
//! product is one serial GEMM call whose shape depends only on (t, c, nh), so the bits do not depend on
//! the thread count.

use crate::backend::cpu::real::{Real, Strided, StridedMut};
use crate::backend::AttentionShape;
use rayon::prelude::*;

/// Rows per causal block. With `tests::time_blocks` on small (t = 128, hs = 32) and tiny (t = 64, hs = 16),
/// blocks of 16 to 64 rows time about the same, the full square (one block of t) about 10% slower at
/// t = 128, and blocks of 8 rows up to twice as slow (per-call packing overhead).
const BLOCK: usize = 32;

/// The dimensions every per-sequence helper needs.
#[derive(Clone, Copy)]
struct Dims<F> {
    t: usize,
    c: usize,
    nh: usize,
    hs: usize,
    sqrt_hs: F,
}

impl<F: Real> Dims<F> {
    fn of(s: AttentionShape) -> Self {
        let hs = s.c / s.nh;
        Dims {
            t: s.t,
            c: s.c,
            nh: s.nh,
            hs,
            sqrt_hs: F::from_f64(hs as f64).sqrt(),
        }
    }
}

/// Causal multi-head attention. qkv `[b, t, 3c]` = q | k | v; att `[b, nh, t, t]` gets the softmax
/// probabilities (0 above the diagonal); out `[b, t, c]`.
pub fn attention_forward<F: Real>(out: &mut [F], att: &mut [F], qkv: &[F], s: AttentionShape) {
    let d = Dims::of(s);
    let (t, c, nh) = (d.t, d.c, d.nh);
    out.par_chunks_mut(t * c)
        .zip(att.par_chunks_mut(nh * t * t))
        .zip(qkv.par_chunks(t * 3 * c))
        .for_each(|((out, att), qkv)| sequence_forward(out, att, qkv, d, BLOCK));
}

/// One sequence: out `[t, c]`, att `[nh, t, t]`, qkv `[t, 3c]`.
fn sequence_forward<F: Real>(out: &mut [F], att: &mut [F], qkv: &[F], d: Dims<F>, block: usize) {
    let (t, c, hs) = (d.t, d.c, d.hs);
    for (h, p) in att.chunks_mut(t * t).enumerate() {
        // p: [t, t] this head's scores, then probabilities.
        let (q, k, v) = head_views(qkv, h, d);
        for (i0, i1) in blocks(t, block) {
            // S[i0..i1, 0..i1] = Q[i0..i1] Kᵀ[.., 0..i1]
            let p_rows = &mut p[i0 * t..];
            gemm(i1 - i0, hs, i1, row_block(q, i0), transposed(k), rows_mut(p_rows, t));
            for (i, row) in (i0..i1).zip(p_rows.chunks_mut(t)) {
                softmax_row(row, i, d.sqrt_hs);
            }
            // O[i0..i1] = P[i0..i1, 0..i1] V[0..i1]
            let o = rows_mut(&mut out[i0 * c + h * hs..], c);
            gemm(i1 - i0, i1, hs, rows(&p[i0 * t..], t), v, o);
        }
    }
}

/// Backward of [`attention_forward`]: overwrites `dqkv`; `datt` is scratch of att's shape (it ends up
/// holding dS, the gradient of the scaled scores, 0 above the diagonal).
pub fn attention_backward<F: Real>(
    dqkv: &mut [F],
    datt: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttentionShape,
) {
    let d = Dims::of(s);
    let (t, c, nh) = (d.t, d.c, d.nh);
    dqkv.par_chunks_mut(t * 3 * c)
        .zip(datt.par_chunks_mut(nh * t * t))
        .zip(dout.par_chunks(t * c))
        .zip(qkv.par_chunks(t * 3 * c))
        .zip(att.par_chunks(nh * t * t))
        .for_each(|((((dqkv, datt), dout), qkv), att)| sequence_backward(dqkv, datt, dout, qkv, att, d, BLOCK));
}

/// One sequence: dqkv `[t, 3c]`, datt `[nh, t, t]`, dout `[t, c]`, qkv `[t, 3c]`, att `[nh, t, t]`.
fn sequence_backward<F: Real>(
    dqkv: &mut [F],
    datt: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    d: Dims<F>,
    block: usize,
) {
    let (t, c, hs) = (d.t, d.c, d.hs);
    for (h, (ds, p)) in datt.chunks_mut(t * t).zip(att.chunks(t * t)).enumerate() {
        // ds: [t, t] dP, then dS; p: [t, t] probabilities; d_o: [t, hs] this head's slice of dout.
        let (q, k, v) = head_views(qkv, h, d);
        let d_o = rows(&dout[h * hs..], c);
        for (i0, i1) in blocks(t, block) {
            // dP[i0..i1, 0..i1] = dO[i0..i1] Vᵀ[.., 0..i1]
            let ds_rows = &mut ds[i0 * t..];
            gemm(i1 - i0, hs, i1, row_block(d_o, i0), transposed(v), rows_mut(ds_rows, t));
            for (i, (drow, prow)) in (i0..i1).zip(ds_rows.chunks_mut(t).zip(p[i0 * t..].chunks(t))) {
                softmax_backward_row(drow, prow, i);
            }
        }
        let ds = &*ds;
        let (dq_col, dk_col, dv_col) = (h * hs, c + h * hs, 2 * c + h * hs);
        for (j0, j1) in blocks(t, block) {
            // dV[j0..j1] = Pᵀ[j0..j1, j0..t] dO[j0..t]
            let dv = rows_mut(&mut dqkv[j0 * 3 * c + dv_col..], 3 * c);
            gemm(j1 - j0, t - j0, hs, transposed_from(p, t, j0), row_block(d_o, j0), dv);
            // dK[j0..j1] = dSᵀ[j0..j1, j0..t] Q[j0..t]   (scaled below)
            let dk = rows_mut(&mut dqkv[j0 * 3 * c + dk_col..], 3 * c);
            gemm(j1 - j0, t - j0, hs, transposed_from(ds, t, j0), row_block(q, j0), dk);
        }
        for (i0, i1) in blocks(t, block) {
            // dQ[i0..i1] = dS[i0..i1, 0..i1] K[0..i1]   (scaled below)
            let dq = rows_mut(&mut dqkv[i0 * 3 * c + dq_col..], 3 * c);
            gemm(i1 - i0, i1, hs, rows(&ds[i0 * t..], t), k, dq);
        }
        for row in dqkv.chunks_mut(3 * c) {
            for col in [dq_col, dk_col] {
                row[col..col + hs].iter_mut().for_each(|x| *x = *x / d.sqrt_hs);
            }
        }
    }
}

/// Turns row i of the raw scores `[t]` into probabilities over keys 0..=i, 0 above the diagonal.
fn softmax_row<F: Real>(row: &mut [F], i: usize, sqrt_hs: F) {
    let (causal, masked) = row.split_at_mut(i + 1);
    let mut max = F::neg_infinity();
    for x in causal.iter_mut() {
        *x = *x / sqrt_hs;
        max = max.max(*x);
    }
    let mut sum = F::zero();
    for x in causal.iter_mut() {
        *x = (*x - max).exp();
        sum = sum + *x;
    }
    let inv = F::one() / sum;
    causal.iter_mut().for_each(|x| *x = *x * inv);
    masked.fill(F::zero());
}

/// Softmax backward of row i: dp `[t]` becomes p * (dp - sum(p * dp)) over keys 0..=i, 0 above.
fn softmax_backward_row<F: Real>(dp: &mut [F], p: &[F], i: usize) {
    let (causal, masked) = dp.split_at_mut(i + 1);
    let dot = causal.iter().zip(p).fold(F::zero(), |a, (&g, &pr)| a + pr * g);
    for (g, &pr) in causal.iter_mut().zip(p) {
        *g = pr * (*g - dot);
    }
    masked.fill(F::zero());
}

/// Q, K, V of head h: `[t, hs]` views of one sequence's qkv `[t, 3c]`.
fn head_views<F: Real>(qkv: &[F], h: usize, d: Dims<F>) -> (Strided<'_, F>, Strided<'_, F>, Strided<'_, F>) {
    let (c, hs) = (d.c, d.hs);
    let view = |col: usize| rows(&qkv[col + h * hs..], 3 * c);
    (view(0), view(c), view(2 * c))
}

/// `[i0, i1)` row blocks of `block` rows covering `[0, t)`.
fn blocks(t: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(block).map(move |i0| (i0, (i0 + block).min(t)))
}

/// `c = a @ b`, `m x k` times `k x n`, one serial call.
fn gemm<F: Real>(m: usize, k: usize, n: usize, a: Strided<F>, b: Strided<F>, c: StridedMut<F>) {
    F::gemm_serial(m, k, n, a, b, F::zero(), c);
}

/// A row-major view with row stride `rs`.
fn rows<F>(data: &[F], rs: usize) -> Strided<'_, F> {
    Strided { data, rs, cs: 1 }
}

/// A writable row-major view with row stride `rs`.
fn rows_mut<F>(data: &mut [F], rs: usize) -> StridedMut<'_, F> {
    StridedMut { data, rs, cs: 1 }
}

/// The view from row `i0` on.
fn row_block<F>(a: Strided<'_, F>, i0: usize) -> Strided<'_, F> {
    Strided {
        data: &a.data[i0 * a.rs..],
        rs: a.rs,
        cs: a.cs,
    }
}

/// The transpose of a view (strides swapped).
fn transposed<F>(a: Strided<'_, F>) -> Strided<'_, F> {
    Strided {
        data: a.data,
        rs: a.cs,
        cs: a.rs,
    }
}

/// Of a `[t, t]` matrix x, the transpose's block starting at row j0, column j0: `xᵀ[j0.., j0..]`.
fn transposed_from<F>(x: &[F], t: usize, j0: usize) -> Strided<'_, F> {
    Strided {
        data: &x[j0 * t + j0..],
        rs: 1,
        cs: t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
        (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
    }

    /// The direct definition of one sequence's forward: out `[t, c]`, att `[nh, t, t]`, qkv `[t, 3c]`.
    fn naive_forward(out: &mut [f64], att: &mut [f64], qkv: &[f64], d: Dims<f64>) {
        let (t, c, hs) = (d.t, d.c, d.hs);
        for h in 0..d.nh {
            for i in 0..t {
                let p = &mut att[(h * t + i) * t..][..t];
                for (j, s) in p.iter_mut().enumerate().take(i + 1) {
                    *s = (0..hs)
                        .map(|x| qkv[i * 3 * c + h * hs + x] * qkv[j * 3 * c + c + h * hs + x])
                        .sum();
                }
                softmax_row(p, i, d.sqrt_hs);
                for x in 0..hs {
                    out[i * c + h * hs + x] = (0..=i).map(|j| p[j] * qkv[j * 3 * c + 2 * c + h * hs + x]).sum();
                }
            }
        }
    }

    fn assert_close(what: &str, got: &[f64], want: &[f64]) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
        }
    }

    /// Every block size, including ones that do not divide t, gives the direct forward and the same
    /// backward as one full-square block (whose gradient tests/gradcheck.rs checks).
    #[test]
    fn causal_blocks_match_the_full_square() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let s = AttentionShape {
            b: 1,
            t: 11,
            c: 6,
            nh: 2,
        };
        let d = Dims::<f64>::of(s);
        let (t, c, nh) = (s.t, s.c, s.nh);
        let qkv = random(&mut rng, t * 3 * c);
        let dout = random(&mut rng, t * c);
        let (mut out0, mut att0) = (vec![0.0; t * c], vec![0.0; nh * t * t]);
        naive_forward(&mut out0, &mut att0, &qkv, d);
        let (mut dqkv0, mut datt0) = (vec![0.0; t * 3 * c], vec![0.0; nh * t * t]);
        sequence_backward(&mut dqkv0, &mut datt0, &dout, &qkv, &att0, d, t);
        for block in [1, 3, 4, 10] {
            // Outputs start as NaN: every element must be written.
            let (mut out, mut att) = (vec![f64::NAN; t * c], vec![f64::NAN; nh * t * t]);
            sequence_forward(&mut out, &mut att, &qkv, d, block);
            assert_close(&format!("out block {block}"), &out, &out0);
            assert_close(&format!("att block {block}"), &att, &att0);
            let (mut dqkv, mut datt) = (vec![f64::NAN; t * 3 * c], vec![f64::NAN; nh * t * t]);
            sequence_backward(&mut dqkv, &mut datt, &dout, &qkv, &att0, d, block);
            assert_close(&format!("dqkv block {block}"), &dqkv, &dqkv0);
            assert_close(&format!("datt block {block}"), &datt, &datt0);
        }
    }

    /// Forward + backward time of one sequence per block size, for choosing [`BLOCK`]:
    /// `cargo test --release --lib attention::tests::time_blocks -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing"]
    fn time_blocks() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for (t, c, nh) in [(64, 64, 4), (128, 128, 4)] {
            let d = Dims::<f32>::of(AttentionShape { b: 1, t, c, nh });
            let qkv: Vec<f32> = random(&mut rng, t * 3 * c).into_iter().map(|x| x as f32).collect();
            let dout = qkv[..t * c].to_vec();
            let (mut out, mut att) = (vec![0.0; t * c], vec![0.0; nh * t * t]);
            let (mut dqkv, mut datt) = (vec![0.0; t * 3 * c], vec![0.0; nh * t * t]);
            for round in 0..5 {
                let mut line = format!("t {t} c {c} round {round}:");
                for block in [8, 16, 32, 64, t] {
                    let reps = 200;
                    let start = std::time::Instant::now();
                    for _ in 0..reps {
                        sequence_forward(&mut out, &mut att, &qkv, d, block);
                        sequence_backward(&mut dqkv, &mut datt, &dout, &qkv, &att, d, block);
                    }
                    let us = start.elapsed().as_secs_f64() * 1e6 / reps as f64;
                    line += &format!("  block {block}: {us:.1} us");
                }
                println!("{line}");
            }
        }
    }
}
