//! Token and position embeddings: the encoder forward and its scatter-add backward.

use crate::backend::cpu::real::Real;
use rayon::prelude::*;

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
