//! The CPU reference backend: owns its buffers in host memory and runs the readable ops of [`ops`].
//! Generic over the float type: `CpuBackend<f32>` trains, `CpuBackend<f64>` backs the gradient checks.

pub mod ops;
pub mod real;
pub mod transcendental;

pub use real::Real;

use super::error::ensure_view;
use super::op_args::*;
use super::{Backend, BackendError, BackendMemory, TokenView, View};
use anyhow::Result;
use std::collections::HashSet;

#[derive(Default)]
pub struct CpuBackend<F: Real = f32> {
    /// f32 (or f64) buffers, indexed by `View::buf`; a freed one is empty, so its views fail their bounds
    /// checks.
    bufs: Vec<Vec<F>>,
    /// Token buffers, indexed by `TokenView::buf`; a freed one is empty.
    tokens: Vec<Vec<u32>>,
    /// Which buffers of `bufs` and `tokens` were freed (an empty buffer may also be a live one of length 0).
    freed: Freed,
}

/// Buffer ids freed so far, per kind.
#[derive(Default)]
struct Freed {
    bufs: HashSet<usize>,
    tokens: HashSet<usize>,
}

/// Borrows `N` writable and `M` read-only views of `bufs` at once. Panics (a programming error, not an input
/// error) if a view is out of bounds, if two writable views overlap, or if a writable view overlaps a
/// read-only one.
fn borrow_views<F, const N: usize, const M: usize>(
    bufs: &mut [Vec<F>],
    outs: [View; N],
    ins: [View; M],
) -> ([&mut [F]; N], [&[F]; M]) {
    for v in outs.iter().chain(ins.iter()) {
        assert!(
            v.buf < bufs.len() && v.end() <= bufs[v.buf].len(),
            "view {v:?} out of bounds"
        );
    }
    for (i, o) in outs.iter().enumerate() {
        for o2 in &outs[i + 1..] {
            assert!(!o.overlaps(o2), "output views {o:?} and {o2:?} overlap");
        }
        for input in &ins {
            assert!(!o.overlaps(input), "output view {o:?} overlaps input {input:?}");
        }
    }
    let base: Vec<*mut F> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
    // SAFETY: every view was checked to lie inside its buffer, and no writable view overlaps any other view,
    // so the mutable slices are disjoint from each other and from the shared ones. All of them borrow `bufs`
    // mutably for the returned lifetime, so nothing else can touch the buffers (or reallocate them) while they live.
    let outs = outs.map(|v| unsafe { std::slice::from_raw_parts_mut(base[v.buf].add(v.offset), v.len) });
    // SAFETY: as above; shared slices may overlap each other, which is fine for reads.
    let ins = ins.map(|v| unsafe { std::slice::from_raw_parts(base[v.buf].add(v.offset) as *const F, v.len) });
    (outs, ins)
}

/// The tokens of `v`, each checked to be below `vocab` (ids come from validated data; this guards bugs).
fn tokens_below(tokens: &[Vec<u32>], v: TokenView, vocab: usize) -> &[u32] {
    let toks = &tokens[v.buf][v.offset..v.offset + v.len];
    assert!(
        toks.iter().all(|&x| (x as usize) < vocab),
        "token id out of the vocabulary of {vocab}"
    );
    toks
}

/// A zero-length view standing in for an absent optional operand.
fn empty_view() -> View {
    View {
        buf: 0,
        offset: 0,
        len: 0,
    }
}

impl<F: Real> CpuBackend<F> {
    pub fn new() -> Self {
        CpuBackend {
            bufs: Vec::new(),
            tokens: Vec::new(),
            freed: Freed::default(),
        }
    }

    /// Direct read access to a view (CPU-only; used by tests and the f64 gradient checks).
    pub fn slice(&self, v: View) -> &[F] {
        &self.bufs[v.buf][v.offset..v.end()]
    }

    /// Direct write access to a view (CPU-only).
    pub fn slice_mut(&mut self, v: View) -> &mut [F] {
        &mut self.bufs[v.buf][v.offset..v.end()]
    }
}

impl<F: Real> Backend for CpuBackend<F> {
    fn name(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            std::any::type_name::<F>(),
            rayon::current_num_threads()
        )
    }

    fn alloc(&mut self, len: usize) -> Result<View> {
        let mut buf = Vec::new();
        buf.try_reserve_exact(len).map_err(|_| BackendError::OutOfMemory {
            what: format!("a buffer of {len} {}", std::any::type_name::<F>()),
            bytes: Some((len * size_of::<F>()) as u64),
        })?;
        buf.resize(len, F::zero());
        self.bufs.push(buf);
        Ok(View {
            buf: self.bufs.len() - 1,
            offset: 0,
            len,
        })
    }

    fn alloc_tokens(&mut self, len: usize) -> Result<TokenView> {
        let mut buf = Vec::new();
        buf.try_reserve_exact(len).map_err(|_| BackendError::OutOfMemory {
            what: format!("a buffer of {len} tokens"),
            bytes: Some(len as u64 * 4),
        })?;
        buf.resize(len, 0);
        self.tokens.push(buf);
        Ok(TokenView {
            buf: self.tokens.len() - 1,
            offset: 0,
            len,
        })
    }

    fn free(&mut self, view: View) {
        assert!(self.freed.bufs.insert(view.buf), "buffer {} freed twice", view.buf);
        self.bufs[view.buf] = Vec::new();
    }

    fn free_tokens(&mut self, view: TokenView) {
        assert!(
            self.freed.tokens.insert(view.buf),
            "token buffer {} freed twice",
            view.buf
        );
        self.tokens[view.buf] = Vec::new();
    }

    fn upload(&mut self, dst: View, src: &[f32]) -> Result<()> {
        ensure_view!(
            src.len() == dst.len,
            "upload of {} floats into a view of {}",
            src.len(),
            dst.len
        );
        for (d, &s) in self.slice_mut(dst).iter_mut().zip(src) {
            *d = F::from_f32(s);
        }
        Ok(())
    }

    fn upload_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()> {
        ensure_view!(
            src.len() == dst.len,
            "upload of {} tokens into a view of {}",
            src.len(),
            dst.len
        );
        self.tokens[dst.buf][dst.offset..dst.offset + dst.len].copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: View, dst: &mut [f32]) -> Result<()> {
        ensure_view!(
            src.len == dst.len(),
            "download of a view of {} into {} floats",
            src.len,
            dst.len()
        );
        for (d, &s) in dst.iter_mut().zip(self.slice(src)) {
            *d = s.to_f32();
        }
        Ok(())
    }

    fn fill(&mut self, dst: View, value: f32) {
        self.slice_mut(dst).fill(F::from_f32(value));
    }

    fn copy(&mut self, op: Checked<CopyInto>) {
        let ([d], [s]) = borrow_views(&mut self.bufs, [op.dst], [op.src]);
        d.copy_from_slice(s);
    }

    fn encoder_forward(&mut self, op: Checked<EncoderForward>) {
        let EncoderForward {
            out,
            tokens,
            wte,
            wpe,
            shape,
        } = *op;
        let toks = tokens_below(&self.tokens, tokens, wte.len / shape.c);
        let ([o], [wte, wpe]) = borrow_views(&mut self.bufs, [out], [wte, wpe]);
        ops::encoder_forward(o, toks, wte, wpe, shape.t, shape.c);
    }

    fn encoder_backward(&mut self, op: Checked<EncoderBackward>) {
        let EncoderBackward {
            dwte,
            dwpe,
            dout,
            tokens,
            shape,
        } = *op;
        let toks = tokens_below(&self.tokens, tokens, dwte.len / shape.c);
        let ([dwte, dwpe], [dout]) = borrow_views(&mut self.bufs, [dwte, dwpe], [dout]);
        ops::encoder_backward(dwte, dwpe, dout, toks, shape.t, shape.c);
    }

    fn layernorm_forward(&mut self, op: Checked<LayerNormForward>) {
        let LayerNormForward {
            out,
            mean,
            rstd,
            inp,
            weight,
            bias,
            shape,
        } = *op;
        let ([out, mean, rstd], [inp, w, b]) = borrow_views(&mut self.bufs, [out, mean, rstd], [inp, weight, bias]);
        ops::layernorm_forward(out, mean, rstd, inp, w, b, shape.c);
    }

    fn layernorm_backward(&mut self, op: Checked<LayerNormBackward>) {
        let LayerNormBackward {
            dinp,
            dweight,
            dbias,
            dout,
            inp,
            weight,
            mean,
            rstd,
            shape,
        } = *op;
        let ([di, dw, db], [d, x, w, m, r]) =
            borrow_views(&mut self.bufs, [dinp, dweight, dbias], [dout, inp, weight, mean, rstd]);
        ops::layernorm_backward(di, dw, db, d, x, w, m, r, shape.c);
    }

    fn matmul_forward(&mut self, op: Checked<MatmulForward>) {
        let MatmulForward {
            out,
            inp,
            weight,
            bias,
            shape,
        } = *op;
        let ([o], [x, w, b]) = borrow_views(&mut self.bufs, [out], [inp, weight, bias.unwrap_or_else(empty_view)]);
        ops::matmul_forward(o, x, w, bias.map(|_| b), shape);
    }

    fn matmul_backward(&mut self, op: Checked<MatmulBackward>) {
        let MatmulBackward {
            dinp,
            dweight,
            dbias,
            dout,
            inp,
            weight,
            shape,
        } = *op;
        let ([di, dw, db], [d, x, w]) = borrow_views(
            &mut self.bufs,
            [dinp, dweight, dbias.unwrap_or_else(empty_view)],
            [dout, inp, weight],
        );
        ops::matmul_backward(di, dw, dbias.map(|_| db), d, x, w, shape);
    }

    /// The CPU keeps the probabilities: its attention is the specification, in today's bits.
    fn attention_saving(&self) -> AttentionSaving {
        AttentionSaving::Probabilities
    }

    fn attention_forward(&mut self, op: Checked<AttentionForward>) {
        assert_eq!(
            op.saving,
            AttentionSaving::Probabilities,
            "the CPU attention keeps the probabilities"
        );
        let ([o, a], [q]) = borrow_views(&mut self.bufs, [op.out, op.saved], [op.qkv]);
        ops::attention_forward(o, a, q, op.shape);
    }

    fn attention_backward(&mut self, op: Checked<AttentionBackward>) {
        let AttentionBackward {
            dqkv,
            scratch,
            dout,
            qkv,
            saved,
            saving,
            shape,
            ..
        } = *op;
        assert_eq!(
            saving,
            AttentionSaving::Probabilities,
            "the CPU attention keeps the probabilities"
        );
        let ([dq, da], [d, q, a]) = borrow_views(&mut self.bufs, [dqkv, scratch], [dout, qkv, saved]);
        ops::attention_backward(dq, da, d, q, a, shape);
    }

    fn gelu_forward(&mut self, op: Checked<GeluForward>) {
        let ([o], [x]) = borrow_views(&mut self.bufs, [op.out], [op.inp]);
        ops::gelu_forward(o, x);
    }

    fn gelu_backward(&mut self, op: Checked<GeluBackward>) {
        let ([di], [x, d]) = borrow_views(&mut self.bufs, [op.dinp], [op.inp, op.dout]);
        ops::gelu_backward(di, x, d);
    }

    fn residual_forward(&mut self, op: Checked<ResidualForward>) {
        let ([o], [a, b]) = borrow_views(&mut self.bufs, [op.out], [op.a, op.b]);
        ops::residual_forward(o, a, b);
    }

    fn add_inplace(&mut self, op: Checked<AddInplace>) {
        let ([d], [s]) = borrow_views(&mut self.bufs, [op.dst], [op.src]);
        ops::add_inplace(d, s);
    }

    fn matmul_gelu_forward(&mut self, op: Checked<MatmulGeluForward>) {
        let MatmulGeluForward {
            pre,
            out,
            inp,
            weight,
            bias,
            shape,
        } = *op;
        let ([p, o], [x, w, b]) = borrow_views(&mut self.bufs, [pre, out], [inp, weight, bias]);
        ops::matmul_gelu_forward(p, o, x, w, b, shape);
    }

    fn add_layernorm_forward(&mut self, op: Checked<AddLayerNormForward>) {
        let AddLayerNormForward {
            residual,
            skip,
            out,
            mean,
            rstd,
            weight,
            bias,
            shape,
        } = *op;
        let ([x, o, m, r], [k, w, b]) = borrow_views(&mut self.bufs, [residual, out, mean, rstd], [skip, weight, bias]);
        ops::add_layernorm_forward(x, k, o, m, r, w, b, shape.c);
    }

    fn crossentropy_forward_backward(&mut self, op: Checked<CrossEntropyForwardBackward>) {
        let CrossEntropyForwardBackward {
            losses,
            logits,
            targets,
            shape,
            dloss,
        } = *op;
        let tgt = tokens_below(&self.tokens, targets, shape.v);
        let ([l, x], []) = borrow_views(&mut self.bufs, [losses, logits], []);
        ops::crossentropy_forward_backward(l, x, tgt, shape.v, F::from_f32(dloss));
    }

    fn crossentropy_forward(&mut self, op: Checked<CrossEntropyForward>) {
        let CrossEntropyForward {
            losses,
            logits,
            targets,
            shape,
        } = *op;
        let tgt = tokens_below(&self.tokens, targets, shape.v);
        let ([l], [x]) = borrow_views(&mut self.bufs, [losses], [logits]);
        ops::crossentropy_forward(l, x, tgt, shape.v);
    }

    fn crossentropy_backward(&mut self, op: Checked<CrossEntropyBackward>) {
        let CrossEntropyBackward {
            dlogits,
            logits,
            targets,
            shape,
            dloss,
        } = *op;
        if dlogits != logits {
            self.copy(
                CopyInto {
                    dst: dlogits,
                    src: logits,
                }
                .checked(),
            );
        }
        let tgt = tokens_below(&self.tokens, targets, shape.v);
        let ([d], []) = borrow_views(&mut self.bufs, [dlogits], []);
        ops::crossentropy_backward_inplace(d, tgt, shape.v, F::from_f32(dloss));
    }

    fn memory(&self) -> BackendMemory {
        BackendMemory::Host
    }

    fn sum_squares(&mut self, x: View) -> Result<f64> {
        Ok(ops::sum_squares(self.slice(x)))
    }

    fn scale(&mut self, x: View, s: f32) {
        ops::scale(self.slice_mut(x), F::from_f32(s));
    }

    fn adamw(&mut self, op: Checked<AdamWUpdate>) {
        let runs = op
            .decay_runs
            .map(|t| self.tokens[t.buf][t.offset..t.offset + t.len].to_vec());
        let ([p, m, v], [g]) = borrow_views(&mut self.bufs, [op.params, op.m, op.v], [op.grads]);
        match runs {
            None => ops::adamw(p, g, m, v, &op.step),
            Some(runs) => ops::adamw_runs(p, g, m, v, &op.step, &runs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Freeing drops the memory and keeps ids stable: the next buffer gets a new id, a view into the freed
    /// buffer panics instead of reaching another one, and so does a second free.
    #[test]
    fn free_keeps_ids_stable() {
        let mut be = CpuBackend::<f32>::new();
        let (old, keep) = (be.alloc(4).unwrap(), be.alloc(3).unwrap());
        let tokens = be.alloc_tokens(2).unwrap();
        be.fill(keep, 7.0);
        be.free(old);
        be.free_tokens(tokens);
        assert!(be.bufs[old.buf].capacity() == 0 && be.tokens[tokens.buf].capacity() == 0);
        let new = be.alloc(4).unwrap();
        assert_ne!(new.buf, old.buf);
        be.fill(new, 1.0);
        assert_eq!(be.slice(new), &[1.0; 4]);
        assert_eq!(be.slice(keep), &[7.0; 3]);
        let stale = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.fill(old, 2.0)));
        assert!(stale.is_err(), "a view into a freed buffer");
        let twice = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.free(old)));
        assert!(twice.is_err(), "a second free");
    }

    /// Transfer errors are typed.
    #[test]
    fn transfer_errors_are_backend_errors() {
        let mut be = CpuBackend::<f32>::new();
        let v = be.alloc(4).unwrap();
        let err = be.upload(v, &[1.0; 3]).unwrap_err();
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::InvalidView(_))),
            "{err:#}"
        );
    }
}
