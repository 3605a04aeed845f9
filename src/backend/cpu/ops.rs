//! The reference ops: plain, readable Rust that specifies what every backend computes. Generic over the
//! float type so that gradient checks can run the very same code in f64.
//!
//! Parallelism (rayon) is only over independent outputs — rows, columns or sequences — and every sum runs in a
//! fixed order, so results are bit-identical run to run whatever the thread count.

use super::real::{Real, Strided, StridedMut};
use crate::backend::{AdamWStep, AttentionShape, MatmulShape, WeightLayout};
use rayon::prelude::*;

pub const LAYERNORM_EPS: f64 = 1e-5;

/// Elements per rayon task in elementwise ops: enough work to amortise scheduling, small enough to split.
const ELEMENTWISE_GRAIN: usize = 4096;

fn c<F: Real>(x: f64) -> F {
    F::from_f64(x)
}

/// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]`.
/// out `[b*t, c]`, tokens `[b*t]`, wte `[v, c]`, wpe `[>=t, c]`.
pub fn encoder_forward<F: Real>(out: &mut [F], tokens: &[u32], wte: &[F], wpe: &[F], t: usize, ch: usize) {
    out.par_chunks_mut(ch)
        .zip(tokens.par_iter())
        .enumerate()
        .for_each(|(bt, (row, &tok))| {
            let pos = bt % t;
            let tok_row = &wte[tok as usize * ch..][..ch];
            let pos_row = &wpe[pos * ch..][..ch];
            for i in 0..ch {
                row[i] = tok_row[i] + pos_row[i];
            }
        });
}

/// `dwte[tokens[b,t],:] += dout[b,t,:]`, `dwpe[t,:] += dout[b,t,:]`, summed in (b, t) order.
pub fn encoder_backward<F: Real>(dwte: &mut [F], dwpe: &mut [F], dout: &[F], tokens: &[u32], t: usize, ch: usize) {
    for (bt, &tok) in tokens.iter().enumerate() {
        let pos = bt % t;
        let d = &dout[bt * ch..][..ch];
        let wte_row = &mut dwte[tok as usize * ch..][..ch];
        for i in 0..ch {
            wte_row[i] = wte_row[i] + d[i];
        }
        let wpe_row = &mut dwpe[pos * ch..][..ch];
        for i in 0..ch {
            wpe_row[i] = wpe_row[i] + d[i];
        }
    }
}

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
            let x = &inp[row * ch..][..ch];
            let n = F::from_f64(ch as f64);
            let mu = x.iter().copied().fold(F::zero(), |a, b| a + b) / n;
            let var = x.iter().fold(F::zero(), |a, &v| a + (v - mu) * (v - mu)) / n;
            let r = F::one() / (var + c(LAYERNORM_EPS)).sqrt();
            for i in 0..ch {
                o[i] = (x[i] - mu) * r * weight[i] + bias[i];
            }
            *m = mu;
            *s = r;
        });
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
    // Parameter gradients: one column per task, rows summed in order.
    let rows = mean.len();
    dweight
        .par_iter_mut()
        .zip(dbias.par_iter_mut())
        .enumerate()
        .for_each(|(i, (dw, db))| {
            let (mut sw, mut sb) = (F::zero(), F::zero());
            for row in 0..rows {
                let norm = (inp[row * ch + i] - mean[row]) * rstd[row];
                let d = dout[row * ch + i];
                sw = sw + norm * d;
                sb = sb + d;
            }
            *dw = *dw + sw;
            *db = *db + sb;
        });
}

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
        dbias.par_iter_mut().enumerate().for_each(|(o, db)| {
            let mut sum = F::zero();
            for row in 0..s.n {
                sum = sum + dout[row * s.oc + o];
            }
            *db = *db + sum;
        });
    }
}

/// Causal multi-head attention. qkv `[b, t, 3c]` = q | k | v; att `[b, nh, t, t]` gets the softmax
/// probabilities (0 above the diagonal); out `[b, t, c]`.
pub fn attention_forward<F: Real>(out: &mut [F], att: &mut [F], qkv: &[F], s: AttentionShape) {
    let AttentionShape { t, c: ch, nh, .. } = s;
    let hs = ch / nh;
    let sqrt_hs = F::from_f64(hs as f64).sqrt();
    // Pass 1: one (b, h, t) row of probabilities per task.
    att.par_chunks_mut(t).enumerate().for_each(|(idx, row)| {
        let tq = idx % t;
        let h = (idx / t) % nh;
        let b = idx / (t * nh);
        let q = &qkv[(b * t + tq) * 3 * ch + h * hs..][..hs];
        let mut max = F::neg_infinity();
        for (t2, slot) in row.iter_mut().enumerate().take(tq + 1) {
            let k = &qkv[(b * t + t2) * 3 * ch + ch + h * hs..][..hs];
            let dot = q.iter().zip(k).fold(F::zero(), |a, (&x, &y)| a + x * y) / sqrt_hs;
            *slot = dot;
            max = max.max(dot);
        }
        let mut sum = F::zero();
        for slot in row.iter_mut().take(tq + 1) {
            *slot = (*slot - max).exp();
            sum = sum + *slot;
        }
        let inv = F::one() / sum;
        for (t2, slot) in row.iter_mut().enumerate() {
            *slot = if t2 <= tq { *slot * inv } else { F::zero() };
        }
    });
    // Pass 2: one (b, t) output row per task, each head a slice of it.
    let att = &*att;
    out.par_chunks_mut(ch).enumerate().for_each(|(bt, o)| {
        let (b, tq) = (bt / t, bt % t);
        for h in 0..nh {
            let probs = &att[((b * nh + h) * t + tq) * t..][..t];
            let oh = &mut o[h * hs..][..hs];
            oh.iter_mut().for_each(|x| *x = F::zero());
            for (t2, &p) in probs.iter().enumerate().take(tq + 1) {
                let v = &qkv[(b * t + t2) * 3 * ch + 2 * ch + h * hs..][..hs];
                for (out, &x) in oh.iter_mut().zip(v) {
                    *out = *out + p * x;
                }
            }
        }
    });
}

/// Backward of [`attention_forward`]: overwrites `dqkv`; `datt` is scratch of att's shape.
pub fn attention_backward<F: Real>(
    dqkv: &mut [F],
    datt: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    s: AttentionShape,
) {
    let AttentionShape { t, c: ch, nh, .. } = s;
    let hs = ch / nh;
    let sqrt_hs = F::from_f64(hs as f64).sqrt();
    // One sequence per task: all of its dq, dk, dv live in its own [t, 3c] slice.
    dqkv.par_chunks_mut(t * 3 * ch)
        .zip(datt.par_chunks_mut(nh * t * t))
        .enumerate()
        .for_each(|(b, (dq, da))| {
            dq.iter_mut().for_each(|x| *x = F::zero());
            // [hs]: one query's dq, accumulated locally (only (h, tq) ever writes it).
            let mut dq_row = vec![F::zero(); hs];
            let qkv_b = &qkv[b * t * 3 * ch..][..t * 3 * ch];
            let dout_b = &dout[b * t * ch..][..t * ch];
            for h in 0..nh {
                for tq in 0..t {
                    let probs = &att[((b * nh + h) * t + tq) * t..][..t];
                    let drow = &mut da[(h * t + tq) * t..][..t];
                    let d_o = &dout_b[tq * ch + h * hs..][..hs];
                    // dv and d(probabilities)
                    for t2 in 0..=tq {
                        let v = &qkv_b[t2 * 3 * ch + 2 * ch + h * hs..][..hs];
                        drow[t2] = d_o.iter().zip(v).fold(F::zero(), |a, (&x, &y)| a + x * y);
                        let dv = &mut dq[t2 * 3 * ch + 2 * ch + h * hs..][..hs];
                        for (d, &g) in dv.iter_mut().zip(d_o) {
                            *d = *d + probs[t2] * g;
                        }
                    }
                    // softmax backward: dpre = p * (dp - sum(p * dp))
                    let dot = (0..=tq).fold(F::zero(), |a, t2| a + probs[t2] * drow[t2]);
                    for t2 in 0..=tq {
                        drow[t2] = probs[t2] * (drow[t2] - dot);
                    }
                    for x in drow.iter_mut().skip(tq + 1) {
                        *x = F::zero();
                    }
                    // dq (this query's row, summed over t2 in order) and dk (each key's row)
                    let q = &qkv_b[tq * 3 * ch + h * hs..][..hs];
                    dq_row.iter_mut().for_each(|x| *x = F::zero());
                    for t2 in 0..=tq {
                        let g = drow[t2] / sqrt_hs;
                        let k = &qkv_b[t2 * 3 * ch + ch + h * hs..][..hs];
                        for (acc, &kv) in dq_row.iter_mut().zip(k) {
                            *acc = *acc + g * kv;
                        }
                        let dk = &mut dq[t2 * 3 * ch + ch + h * hs..][..hs];
                        for (d, &qv) in dk.iter_mut().zip(q) {
                            *d = *d + g * qv;
                        }
                    }
                    dq[tq * 3 * ch + h * hs..][..hs].copy_from_slice(&dq_row);
                }
            }
        });
}

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
            for (j, x) in row.iter_mut().enumerate() {
                let p = (*x - lse).exp();
                let indicator = if j == target as usize { F::one() } else { F::zero() };
                *x = dloss * (p - indicator);
            }
        });
}

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

/// `x *= s`.
pub fn scale<F: Real>(x: &mut [F], s: F) {
    x.par_iter_mut()
        .with_min_len(ELEMENTWISE_GRAIN)
        .for_each(|v| *v = *v * s);
}

/// torch.optim.AdamW (single-tensor path), element by element:
/// `p *= 1 - lr*wd; m = lerp(m, g, 1-b1); v = b2 v + (1-b2) g^2; p -= step_size * m / (sqrt(v)/bc2_sqrt + eps)`.
pub fn adamw<F: Real>(params: &mut [F], grads: &[F], m: &mut [F], v: &mut [F], h: &AdamWStep) {
    let f = |x: f32| F::from_f32(x);
    let (lr, wd, b1, b2, eps) = (f(h.lr), f(h.weight_decay), f(h.beta1), f(h.beta2), f(h.eps));
    let (step_size, bc2_sqrt, gs) = (f(h.step_size), f(h.bias_correction2_sqrt), f(h.grad_scale));
    let decay = F::one() - lr * wd;
    params
        .par_iter_mut()
        .zip(grads.par_iter())
        .zip(m.par_iter_mut().zip(v.par_iter_mut()))
        .with_min_len(ELEMENTWISE_GRAIN)
        .for_each(|((p, &g), (m, v))| {
            let g = g * gs;
            *p = *p * decay;
            *m = *m + (g - *m) * (F::one() - b1);
            *v = *v * b2 + g * g * (F::one() - b2);
            let denom = v.sqrt() / bc2_sqrt + eps;
            *p = *p - step_size * (*m / denom);
        });
}
