//! A boxed backend is a backend: every method, the provided ones included, forwards to the box's content, so
//! code generic over `B: Backend` (the trainer, the model) runs on the `Box<dyn Backend>` the
//! [factory](super::factory) returns.

use super::{AdamWStep, AttentionShape, Backend, BackendMemory, Download, MatmulShape, TokenView, View};
use anyhow::Result;

impl<B: Backend + ?Sized> Backend for Box<B> {
    fn name(&self) -> String {
        (**self).name()
    }

    fn alloc(&mut self, len: usize) -> Result<View> {
        (**self).alloc(len)
    }

    fn alloc_tokens(&mut self, len: usize) -> Result<TokenView> {
        (**self).alloc_tokens(len)
    }

    fn free(&mut self, view: View) {
        (**self).free(view)
    }

    fn free_tokens(&mut self, view: TokenView) {
        (**self).free_tokens(view)
    }

    fn upload(&mut self, dst: View, src: &[f32]) -> Result<()> {
        (**self).upload(dst, src)
    }

    fn upload_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()> {
        (**self).upload_tokens(dst, src)
    }

    fn download(&mut self, src: View, dst: &mut [f32]) -> Result<()> {
        (**self).download(src, dst)
    }

    fn fill(&mut self, dst: View, value: f32) {
        (**self).fill(dst, value)
    }

    fn copy(&mut self, dst: View, src: View) {
        (**self).copy(dst, src)
    }

    fn encoder_forward(&mut self, out: View, tokens: TokenView, wte: View, wpe: View, b: usize, t: usize, c: usize) {
        (**self).encoder_forward(out, tokens, wte, wpe, b, t, c)
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
        (**self).encoder_backward(dwte, dwpe, dout, tokens, b, t, c)
    }

    fn layernorm_forward(
        &mut self,
        out: View,
        mean: View,
        rstd: View,
        inp: View,
        weight: View,
        bias: View,
        n: usize,
        c: usize,
    ) {
        (**self).layernorm_forward(out, mean, rstd, inp, weight, bias, n, c)
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
        (**self).layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, n, c)
    }

    fn matmul_forward(&mut self, out: View, inp: View, weight: View, bias: Option<View>, shape: MatmulShape) {
        (**self).matmul_forward(out, inp, weight, bias, shape)
    }

    fn matmul_backward(
        &mut self,
        dinp: View,
        dweight: View,
        dbias: Option<View>,
        dout: View,
        inp: View,
        weight: View,
        shape: MatmulShape,
    ) {
        (**self).matmul_backward(dinp, dweight, dbias, dout, inp, weight, shape)
    }

    fn attention_forward(&mut self, out: View, att: View, qkv: View, shape: AttentionShape) {
        (**self).attention_forward(out, att, qkv, shape)
    }

    fn attention_backward(&mut self, dqkv: View, datt: View, dout: View, qkv: View, att: View, shape: AttentionShape) {
        (**self).attention_backward(dqkv, datt, dout, qkv, att, shape)
    }

    fn gelu_forward(&mut self, out: View, inp: View) {
        (**self).gelu_forward(out, inp)
    }

    fn gelu_backward(&mut self, dinp: View, inp: View, dout: View) {
        (**self).gelu_backward(dinp, inp, dout)
    }

    fn residual_forward(&mut self, out: View, a: View, b: View) {
        (**self).residual_forward(out, a, b)
    }

    fn add_inplace(&mut self, dst: View, src: View) {
        (**self).add_inplace(dst, src)
    }

    fn crossentropy_forward(&mut self, losses: View, logits: View, targets: TokenView, n: usize, v: usize) {
        (**self).crossentropy_forward(losses, logits, targets, n, v)
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
        (**self).crossentropy_backward(dlogits, logits, targets, n, v, dloss)
    }

    fn sum_squares(&mut self, x: View) -> Result<f64> {
        (**self).sum_squares(x)
    }

    fn scale(&mut self, x: View, s: f32) {
        (**self).scale(x, s)
    }

    fn adamw(&mut self, params: View, grads: View, m: View, v: View, step: &AdamWStep) {
        (**self).adamw(params, grads, m, v, step)
    }

    fn check_step_shape(&self, b: usize, t: usize, c: usize, nh: usize) -> Result<()> {
        (**self).check_step_shape(b, t, c, nh)
    }

    fn matmul_gelu_forward(&mut self, pre: View, out: View, inp: View, weight: View, bias: View, shape: MatmulShape) {
        (**self).matmul_gelu_forward(pre, out, inp, weight, bias, shape)
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
        (**self).add_layernorm_forward(residual, skip, out, mean, rstd, w, b, n, c)
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
        (**self).crossentropy_forward_backward(losses, logits, targets, n, v, dloss)
    }

    fn begin_download(&mut self, src: View, host: Vec<f32>) -> Result<Download> {
        (**self).begin_download(src, host)
    }

    fn download_ready(&mut self, download: &Download) -> Result<bool> {
        (**self).download_ready(download)
    }

    fn finish_download(&mut self, download: Download) -> Result<Vec<f32>> {
        (**self).finish_download(download)
    }

    fn memory(&self) -> BackendMemory {
        (**self).memory()
    }

    fn synchronize(&mut self) -> Result<()> {
        (**self).synchronize()
    }
}
