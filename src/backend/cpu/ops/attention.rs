//! Causal multi-head self-attention forward and backward.

use crate::backend::cpu::real::Real;
use crate::backend::AttentionShape;
use rayon::prelude::*;

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
