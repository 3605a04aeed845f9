//! The CPU reference backend: owns its buffers in host memory and runs the readable ops of [`ops`].
//! Generic over the float type: `CpuBackend<f32>` trains, `CpuBackend<f64>` backs the gradient checks.

pub mod ops;
pub mod real;
pub mod transcendental;

pub use real::Real;

use super::error::ensure_view;
use super::{AdamWStep, AttentionShape, Backend, BackendError, BackendMemory, MatmulShape, TokenView, View};
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

    fn copy(&mut self, dst: View, src: View) {
        assert_eq!(dst.len, src.len, "copy between views of different lengths");
        let ([d], [s]) = borrow_views(&mut self.bufs, [dst], [src]);
        d.copy_from_slice(s);
    }

    fn encoder_forward(&mut self, out: View, tokens: TokenView, wte: View, wpe: View, b: usize, t: usize, c: usize) {
        assert!(out.len == b * t * c && tokens.len == b * t && wpe.len >= t * c);
        let toks = tokens_below(&self.tokens, tokens, wte.len / c);
        let ([o], [wte, wpe]) = borrow_views(&mut self.bufs, [out], [wte, wpe]);
        ops::encoder_forward(o, toks, wte, wpe, t, c);
    }

    fn encoder_backward(
        &mut self,
        dwte: View,
        dwpe: View,
        dout: View,
        tokens: TokenView,
        b: usize,
        t: usize,
        c: usize,
    ) {
        assert!(dout.len == b * t * c && tokens.len == b * t && dwpe.len >= t * c);
        let toks = tokens_below(&self.tokens, tokens, dwte.len / c);
        let ([dwte, dwpe], [dout]) = borrow_views(&mut self.bufs, [dwte, dwpe], [dout]);
        ops::encoder_backward(dwte, dwpe, dout, toks, t, c);
    }

    fn layernorm_forward(
        &mut self,
        out: View,
        mean: View,
        rstd: View,
        inp: View,
        w: View,
        b: View,
        n: usize,
        c: usize,
    ) {
        assert!(out.len == n * c && inp.len == n * c && mean.len == n && rstd.len == n && w.len == c && b.len == c);
        let ([out, mean, rstd], [inp, w, b]) = borrow_views(&mut self.bufs, [out, mean, rstd], [inp, w, b]);
        ops::layernorm_forward(out, mean, rstd, inp, w, b, c);
    }

    fn layernorm_backward(
        &mut self,
        dinp: View,
        dweight: View,
        dbias: View,
        dout: View,
        inp: View,
        weight: View,
        mean: View,
        rstd: View,
        n: usize,
        c: usize,
    ) {
        assert!(dinp.len == n * c && dout.len == n * c && inp.len == n * c && mean.len == n && rstd.len == n);
        assert!(dweight.len == c && dbias.len == c && weight.len == c);
        let ([di, dw, db], [d, x, w, m, r]) =
            borrow_views(&mut self.bufs, [dinp, dweight, dbias], [dout, inp, weight, mean, rstd]);
        ops::layernorm_backward(di, dw, db, d, x, w, m, r, c);
    }

    fn matmul_forward(&mut self, out: View, inp: View, weight: View, bias: Option<View>, s: MatmulShape) {
        assert!(out.len == s.n * s.oc && inp.len == s.n * s.c && weight.len == s.c * s.oc);
        assert!(bias.is_none_or(|b| b.len == s.oc));
        let ([o], [x, w, b]) = borrow_views(&mut self.bufs, [out], [inp, weight, bias.unwrap_or_else(empty_view)]);
        ops::matmul_forward(o, x, w, bias.map(|_| b), s);
    }

    fn matmul_backward(
        &mut self,
        dinp: View,
        dweight: View,
        dbias: Option<View>,
        dout: View,
        inp: View,
        weight: View,
        s: MatmulShape,
    ) {
        assert!(dinp.len == s.n * s.c && dout.len == s.n * s.oc && inp.len == s.n * s.c);
        assert!(dweight.len == s.c * s.oc && weight.len == s.c * s.oc);
        assert!(dbias.is_none_or(|b| b.len == s.oc));
        let ([di, dw, db], [d, x, w]) = borrow_views(
            &mut self.bufs,
            [dinp, dweight, dbias.unwrap_or_else(empty_view)],
            [dout, inp, weight],
        );
        ops::matmul_backward(di, dw, dbias.map(|_| db), d, x, w, s);
    }

    fn attention_forward(&mut self, out: View, att: View, qkv: View, s: AttentionShape) {
        assert!(s.c % s.nh == 0);
        assert!(out.len == s.b * s.t * s.c && qkv.len == 3 * out.len && att.len == s.b * s.nh * s.t * s.t);
        let ([o, a], [q]) = borrow_views(&mut self.bufs, [out, att], [qkv]);
        ops::attention_forward(o, a, q, s);
    }

    fn attention_backward(&mut self, dqkv: View, datt: View, dout: View, qkv: View, att: View, s: AttentionShape) {
        assert!(s.c % s.nh == 0);
        assert!(dout.len == s.b * s.t * s.c && qkv.len == 3 * dout.len && dqkv.len == qkv.len);
        assert!(att.len == s.b * s.nh * s.t * s.t && datt.len == att.len);
        let ([dq, da], [d, q, a]) = borrow_views(&mut self.bufs, [dqkv, datt], [dout, qkv, att]);
        ops::attention_backward(dq, da, d, q, a, s);
    }

    fn gelu_forward(&mut self, out: View, inp: View) {
        assert_eq!(out.len, inp.len);
        let ([o], [x]) = borrow_views(&mut self.bufs, [out], [inp]);
        ops::gelu_forward(o, x);
    }

    fn gelu_backward(&mut self, dinp: View, inp: View, dout: View) {
        assert!(dinp.len == inp.len && dout.len == inp.len);
        let ([di], [x, d]) = borrow_views(&mut self.bufs, [dinp], [inp, dout]);
        ops::gelu_backward(di, x, d);
    }

    fn residual_forward(&mut self, out: View, a: View, b: View) {
        assert!(out.len == a.len && out.len == b.len);
        let ([o], [a, b]) = borrow_views(&mut self.bufs, [out], [a, b]);
        ops::residual_forward(o, a, b);
    }

    fn add_inplace(&mut self, dst: View, src: View) {
        assert_eq!(dst.len, src.len);
        let ([d], [s]) = borrow_views(&mut self.bufs, [dst], [src]);
        ops::add_inplace(d, s);
    }

    fn matmul_gelu_forward(&mut self, pre: View, out: View, inp: View, weight: View, bias: View, s: MatmulShape) {
        assert!(pre.len == s.n * s.oc && out.len == pre.len && inp.len == s.n * s.c && weight.len == s.c * s.oc);
        assert_eq!(bias.len, s.oc);
        let ([p, o], [x, w, b]) = borrow_views(&mut self.bufs, [pre, out], [inp, weight, bias]);
        ops::matmul_gelu_forward(p, o, x, w, b, s);
    }

    fn add_layernorm_forward(
        &mut self,
        residual: View,
        skip: View,
        out: View,
        mean: View,
        rstd: View,
        w: View,
        b: View,
        n: usize,
        c: usize,
    ) {
        assert!(residual.len == n * c && skip.len == n * c && out.len == n * c);
        assert!(mean.len == n && rstd.len == n && w.len == c && b.len == c);
        let ([x, o, m, r], [k, w, b]) = borrow_views(&mut self.bufs, [residual, out, mean, rstd], [skip, w, b]);
        ops::add_layernorm_forward(x, k, o, m, r, w, b, c);
    }

    fn crossentropy_forward_backward(
        &mut self,
        losses: View,
        logits: View,
        targets: TokenView,
        n: usize,
        v: usize,
        dloss: f32,
    ) {
        assert!(losses.len == n && logits.len == n * v && targets.len == n);
        let tgt = tokens_below(&self.tokens, targets, v);
        let ([l, x], []) = borrow_views(&mut self.bufs, [losses, logits], []);
        ops::crossentropy_forward_backward(l, x, tgt, v, F::from_f32(dloss));
    }

    fn crossentropy_forward(&mut self, losses: View, logits: View, targets: TokenView, n: usize, v: usize) {
        assert!(losses.len == n && logits.len == n * v && targets.len == n);
        let tgt = tokens_below(&self.tokens, targets, v);
        let ([l], [x]) = borrow_views(&mut self.bufs, [losses], [logits]);
        ops::crossentropy_forward(l, x, tgt, v);
    }

    fn crossentropy_backward(
        &mut self,
        dlogits: View,
        logits: View,
        targets: TokenView,
        n: usize,
        v: usize,
        dloss: f32,
    ) {
        assert!(dlogits.len == n * v && logits.len == n * v && targets.len == n);
        if dlogits != logits {
            self.copy(dlogits, logits);
        }
        let tgt = tokens_below(&self.tokens, targets, v);
        let ([d], []) = borrow_views(&mut self.bufs, [dlogits], []);
        ops::crossentropy_backward_inplace(d, tgt, v, F::from_f32(dloss));
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

    fn adamw(&mut self, params: View, grads: View, m: View, v: View, step: &AdamWStep) {
        assert!(grads.len == params.len && m.len == params.len && v.len == params.len);
        let ([p, m, v], [g]) = borrow_views(&mut self.bufs, [params, m, v], [grads]);
        ops::adamw(p, g, m, v, step);
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
