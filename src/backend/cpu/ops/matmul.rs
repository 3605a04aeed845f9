//! The linear layers: `inp @ W (+ bias)` and its backward, through the strided gemm of [`Real`].

use crate::backend::cpu::real::{Real, Strided, StridedMut};
use crate::backend::{MatmulShape, WeightLayout};
use rayon::prelude::*;

/// The weight as a `c x oc` matrix (what the forward multiplies by).
fn weight_as_in_out<F>(w: &[F], s: MatmulShape) -> Strided<'_, F> {
    match s.layout {
        WeightLayout::InOut => Strided {
            data: w,
            rs: s.oc,
            cs: 1,
        },
        WeightLayout::OutIn => Strided {
            data: w,
            rs: 1,
            cs: s.c,
        },
    }
}

/// `out [n, oc] = inp [n, c] @ W (+ bias [oc])`.
pub fn matmul_forward<F: Real>(out: &mut [F], inp: &[F], weight: &[F], bias: Option<&[F]>, s: MatmulShape) {
    F::gemm(
        s.n,
        s.c,
        s.oc,
        Strided {
            data: inp,
            rs: s.c,
            cs: 1,
        },
        weight_as_in_out(weight, s),
        F::zero(),
        StridedMut {
            data: out,
            rs: s.oc,
            cs: 1,
        },
    );
    if let Some(bias) = bias {
        out.par_chunks_mut(s.oc).for_each(|row| {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o = *o + b;
            }
        });
    }
}

/// `pre [n, oc] = inp [n, c] @ W + bias [oc]`, then `out = gelu(pre)`, bias and GELU in one pass over each
/// block of rows while it is in cache: the same bits as [`matmul_forward`] then
/// [`gelu_forward`](super::gelu_forward).
pub fn matmul_gelu_forward<F: Real>(pre: &mut [F], out: &mut [F], inp: &[F], weight: &[F], bias: &[F], s: MatmulShape) {
    matmul_forward(pre, inp, weight, None, s);
    let rows = (super::ELEMENTWISE_GRAIN / s.oc.max(1)).max(1);
    pre.par_chunks_mut(rows * s.oc)
        .zip(out.par_chunks_mut(rows * s.oc))
        .for_each(|(pre, out)| {
            for row in pre.chunks_mut(s.oc) {
                for (o, &b) in row.iter_mut().zip(bias) {
                    *o = *o + b;
                }
            }
            super::elementwise::gelu_chunk(out, pre);
        });
}

/// `dinp = dout @ W^T`; `dW += inp^T @ dout` (in W's layout); `dbias += sum over rows of dout`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<F: Real>(
    dinp: &mut [F],
    dweight: &mut [F],
    dbias: Option<&mut [F]>,
    dout: &[F],
    inp: &[F],
    weight: &[F],
    s: MatmulShape,
) {
    // W as an `oc x c` matrix is the transpose of the forward view.
    let w = weight_as_in_out(weight, s);
    let w_t = Strided {
        data: w.data,
        rs: w.cs,
        cs: w.rs,
    };
    F::gemm(
        s.n,
        s.oc,
        s.c,
        Strided {
            data: dout,
            rs: s.oc,
            cs: 1,
        },
        w_t,
        F::zero(),
        StridedMut {
            data: dinp,
            rs: s.c,
            cs: 1,
        },
    );
    match s.layout {
        // dW [c, oc] += inp^T [c, n] @ dout [n, oc]
        WeightLayout::InOut => F::gemm(
            s.c,
            s.n,
            s.oc,
            Strided {
                data: inp,
                rs: 1,
                cs: s.c,
            },
            Strided {
                data: dout,
                rs: s.oc,
                cs: 1,
            },
            F::one(),
            StridedMut {
                data: dweight,
                rs: s.oc,
                cs: 1,
            },
        ),
        // dW [oc, c] += dout^T [oc, n] @ inp [n, c]
        WeightLayout::OutIn => F::gemm(
            s.oc,
            s.n,
            s.c,
            Strided {
                data: dout,
                rs: 1,
                cs: s.oc,
            },
            Strided {
                data: inp,
                rs: s.c,
                cs: 1,
            },
            F::one(),
            StridedMut {
                data: dweight,
                rs: s.c,
                cs: 1,
            },
        ),
    }
    if let Some(dbias) = dbias {
        add_column_sums(dbias, dout, s.oc);
    }
}

/// `sums[j] += sum over the rows of m [rows, sums.len()] of m[row, j]`, rows added in order. Each task owns
/// a block of columns and sweeps the rows, so the inner loop runs along contiguous memory.
fn add_column_sums<F: Real>(sums: &mut [F], m: &[F], width: usize) {
    const COLUMNS_PER_TASK: usize = 64;
    sums.par_chunks_mut(COLUMNS_PER_TASK)
        .enumerate()
        .for_each(|(block, out)| {
            let first = block * COLUMNS_PER_TASK;
            // [out.len()]: the running sums of this block's columns.
            let mut acc = vec![F::zero(); out.len()];
            for row in m.chunks_exact(width) {
                for (a, &x) in acc.iter_mut().zip(&row[first..first + out.len()]) {
                    *a = *a + x;
                }
            }
            for (o, a) in out.iter_mut().zip(acc) {
                *o = *o + a;
            }
        });
}
