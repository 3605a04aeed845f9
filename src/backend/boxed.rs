//! A boxed backend is a backend: every method, the provided ones included, forwards to the box's content, so
//! code generic over `B: Backend` (the trainer, the model) runs on the `Box<dyn Backend>` the
//! [factory](super::factory) returns.

use super::op_args::*;
use super::{Backend, BackendMemory, Download, MatmulPrecision, StepShape, TokenView, View};
use anyhow::Result;

/// Forwards each op, which takes its checked arguments only, to the box's content.
macro_rules! forward_ops {
    ($($op:ident($args:ty)),* $(,)?) => {
        $(fn $op(&mut self, op: Checked<$args>) {
            (**self).$op(op)
        })*
    };
}

impl<B: Backend + ?Sized> Backend for Box<B> {
    every_op!(forward_ops);

    fn name(&self) -> String {
        (**self).name()
    }

    fn attention_saving(&self) -> AttentionSaving {
        (**self).attention_saving()
    }

    fn set_matmul_precision(&mut self, precision: MatmulPrecision) -> Result<()> {
        (**self).set_matmul_precision(precision)
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

    fn sum_squares(&mut self, x: View) -> Result<f64> {
        (**self).sum_squares(x)
    }

    fn scale(&mut self, x: View, s: f32) {
        (**self).scale(x, s)
    }

    fn check_step_shape(&self, shape: StepShape) -> Result<()> {
        (**self).check_step_shape(shape)
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
