//! The ops of [`Backend`] on CUDA: each a launch of a `kernels/*.cu` kernel or a cuBLAS call, in the order
//! of kernels/README.md's table.

use super::super::error::ensure_view;
use super::super::op_args::*;
use super::super::{Backend, BackendError, BackendMemory, Download, MatmulPrecision, StepShape, TokenView, View};
use super::blas;
use super::device::{CudaBackend, DeviceBuffer, Scratch, TokenBuffer};
use super::gpu::{Addr, Gemm, Gpu, Param};
use crate::backend::flash::{flash_groups, head_width_error, FLASH_ROWS};
use crate::backend::token_index::token_index;
use anyhow::Result;

/// Threads per block of every kernel but the flash attention ones (`WG` in kernels/common.cuh).
const WG: usize = 256;

/// `sum_squares`' block: the CPU specification's `SUM_BLOCK` (kernels/reduce.cu).
const SUM_BLOCK: usize = 4096;

/// Columns per block of the column-tree kernels (`column_lanes_sum`).
const COLUMNS_PER_BLOCK: usize = 16;

/// One kernel argument, before it is checked and lowered to a [`Param`].
#[derive(Clone, Copy)]
enum Arg {
    /// A view's device address; its length must fit the kernels' 32-bit indices.
    F(View),
    /// A token view's device address.
    Tok(TokenView),
    /// A device address of scratch memory (already bounded by the caller).
    Ptr(Addr),
    /// A size, passed as the kernels' `u32`.
    U(usize),
    /// A float scalar.
    S(f32),
}

impl<G: Gpu> CudaBackend<G> {
    /// Launches `kernel` on `blocks` blocks of [`WG`] threads with `args` in its parameter order. A size or
    /// view past 32-bit indexing is recorded as [`BackendError::ShapeUnsupported`] and nothing runs.
    fn launch(&mut self, kernel: &'static str, blocks: usize, args: &[Arg]) {
        self.launch_blocks_of(kernel, (blocks, WG), args)
    }

    /// [`Self::launch`] on blocks of `threads` threads.
    fn launch_blocks_of(&mut self, kernel: &'static str, (blocks, threads): (usize, usize), args: &[Arg]) {
        if blocks == 0 {
            return;
        }
        // The grid's threads and every view's or size's extent must fit the kernels' 32-bit indices.
        let extents = args.iter().map(|arg| match *arg {
            Arg::F(v) => v.len,
            Arg::Tok(t) => t.len,
            Arg::U(n) => n,
            Arg::Ptr(_) | Arg::S(_) => 0,
        });
        if let Some(extent) = std::iter::once(blocks * threads)
            .chain(extents)
            .find(|&n| n > u32::MAX as usize)
        {
            self.record(Err(BackendError::ShapeUnsupported {
                op: kernel.into(),
                detail: format!(
                    "needs sizes below 2^32 elements for its 32-bit indices, got {extent} ({blocks} blocks)"
                ),
            }));
            return;
        }
        let params: Vec<Param> = args
            .iter()
            .map(|arg| match *arg {
                Arg::F(v) => Param::Ptr(self.addr(v)),
                Arg::Tok(t) => Param::Ptr(self.token_addr(t)),
                Arg::Ptr(p) => Param::Ptr(p),
                Arg::U(n) => Param::U32(n as u32),
                Arg::S(s) => Param::F32(s),
            })
            .collect();
        let launched = self.gpu.launch(kernel, blocks as u32, threads as u32, &params);
        self.record(launched);
    }

    /// Records why the attention kernels cannot take `shape`'s heads, if they cannot.
    fn refuse_heads(&mut self, op: &str, shape: AttentionShape) -> bool {
        match head_width_error(op, shape) {
            Some(refusal) => {
                self.record(Err(refusal));
                true
            }
            None => false,
        }
    }

    /// Blocks for one thread per element.
    fn per_element(n: usize) -> usize {
        n.div_ceil(WG)
    }

    fn gemm(&mut self, gemm: Gemm) {
        let result = self.gpu.gemm(&gemm);
        self.record(result);
    }

    /// Copies `src` into device words at `dst`, in queue order.
    fn copy_in<T: bytemuck::Pod>(&mut self, dst: Addr, src: &[T]) -> Result<(), BackendError> {
        self.gpu.write(dst, bytemuck::cast_slice(src))
    }

    /// Reads floats at `src` into `dst` after all queued work, then returns the first failure.
    fn copy_out(&mut self, src: Addr, dst: &mut [f32]) -> Result<()> {
        let read = self.gpu.read(src, bytemuck::cast_slice_mut(dst));
        self.record(read);
        self.take_error()
    }

    /// Frees an allocation in queue order.
    fn release(&mut self, addr: Addr) {
        let freed = self.gpu.free(addr);
        self.record(freed);
    }
}

impl<G: Gpu> Backend for CudaBackend<G> {
    fn name(&self) -> String {
        format!("cuda ({})", self.gpu.describe())
    }

    fn alloc(&mut self, len: usize) -> Result<View> {
        let addr = self.gpu.alloc(len, &format!("a tensor of {len} floats"))?;
        self.bufs.push(Some(DeviceBuffer { addr, len }));
        Ok(View {
            buf: self.bufs.len() - 1,
            offset: 0,
            len,
        })
    }

    fn alloc_tokens(&mut self, len: usize) -> Result<TokenView> {
        let addr = self.gpu.alloc(len, &format!("a token buffer of {len}"))?;
        self.tok_bufs.push(Some(TokenBuffer {
            addr,
            host: vec![0; len],
        }));
        Ok(TokenView {
            buf: self.tok_bufs.len() - 1,
            offset: 0,
            len,
        })
    }

    fn free(&mut self, view: View) {
        let buffer = self
            .bufs
            .get_mut(view.buf)
            .and_then(Option::take)
            .unwrap_or_else(|| panic!("freeing freed or unknown CUDA buffer {}", view.buf));
        self.release(buffer.addr);
    }

    fn free_tokens(&mut self, view: TokenView) {
        let buffer = self
            .tok_bufs
            .get_mut(view.buf)
            .and_then(Option::take)
            .unwrap_or_else(|| panic!("freeing freed or unknown CUDA token buffer {}", view.buf));
        self.release(buffer.addr);
    }

    fn upload(&mut self, dst: View, src: &[f32]) -> Result<()> {
        ensure_view!(
            src.len() == dst.len,
            "upload of {} floats into a view of {}",
            src.len(),
            dst.len
        );
        let addr = self.addr(dst);
        self.copy_in(addr, src)?;
        Ok(())
    }

    fn upload_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()> {
        ensure_view!(
            src.len() == dst.len,
            "upload of {} tokens into a view of {}",
            src.len(),
            dst.len
        );
        let addr = self.token_addr(dst);
        self.copy_in(addr, src)?;
        let host = &mut self.tok_bufs[dst.buf].as_mut().expect("checked by token_ptr").host;
        host[dst.offset..dst.offset + dst.len].copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: View, dst: &mut [f32]) -> Result<()> {
        ensure_view!(
            dst.len() == src.len,
            "download of a view of {} into {} floats",
            src.len,
            dst.len()
        );
        let addr = self.addr(src);
        self.copy_out(addr, dst)
    }

    fn fill(&mut self, dst: View, value: f32) {
        if dst.len == 0 {
            return;
        }
        let addr = self.addr(dst);
        let filled = self.gpu.fill(addr, value.to_bits(), dst.len);
        self.record(filled);
    }

    fn copy(&mut self, op: Checked<CopyInto>) {
        let CopyInto { dst, src } = *op;
        if dst.len == 0 {
            return;
        }
        let (d, s) = (self.addr(dst), self.addr(src));
        let copied = self.gpu.copy(d, s, dst.len * 4);
        self.record(copied);
    }

    fn encoder_forward(&mut self, op: Checked<EncoderForward>) {
        let EncoderForward {
            out,
            tokens,
            wte,
            wpe,
            shape: EncoderShape { b, t, c },
        } = *op;
        let n = b * t;
        let v = wte.len / c;
        let args = [
            Arg::F(out),
            Arg::Tok(tokens),
            Arg::F(wte),
            Arg::F(wpe),
            Arg::U(n),
            Arg::U(t),
            Arg::U(c),
            Arg::U(v),
        ];
        self.launch("encoder_forward", Self::per_element(n * c), &args);
    }

    fn encoder_backward(&mut self, op: Checked<EncoderBackward>) {
        let EncoderBackward {
            dwte,
            dwpe,
            dout,
            tokens,
            shape: EncoderShape { b, t, c },
        } = *op;
        let n = b * t;
        if n == 0 {
            return;
        }
        let wpe_args = [
            Arg::F(dwpe.sub(0, t * c)),
            Arg::F(dout),
            Arg::U(b),
            Arg::U(t),
            Arg::U(c),
        ];
        self.launch("encoder_backward_wpe", Self::per_element(t * c), &wpe_args);
        let v = dwte.len / c;
        let host = &self.token_buffer(tokens.buf).host[tokens.offset..tokens.offset + n];
        let (u, index) = token_index(host, v);
        // index [u rows | u + 1 starts | n positions], rewritten in stream order after earlier readers.
        let base = match self.scratch(Scratch::EmbedIndex, index.len()) {
            Ok(base) => base,
            Err(e) => return self.record(Err(e)),
        };
        let copied = self.copy_in(base, &index);
        self.record(copied);
        let (rows, starts, positions) = (base, base + 4 * u as u64, base + 4 * (2 * u + 1) as u64);
        let args = [
            Arg::F(dwte),
            Arg::F(dout),
            Arg::Ptr(rows),
            Arg::Ptr(starts),
            Arg::Ptr(positions),
            Arg::U(u),
            Arg::U(c),
            Arg::U(v),
        ];
        self.launch("encoder_backward_wte", Self::per_element(u * c), &args);
    }

    fn layernorm_forward(&mut self, op: Checked<LayerNormForward>) {
        let LayerNormForward {
            out,
            mean,
            rstd,
            inp,
            weight,
            bias,
            shape: RowsShape { n, c },
        } = *op;
        let args = [
            Arg::F(out),
            Arg::F(mean),
            Arg::F(rstd),
            Arg::F(inp),
            Arg::F(weight),
            Arg::F(bias),
            Arg::U(n),
            Arg::U(c),
        ];
        self.launch("layernorm_forward", n, &args);
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
            shape: RowsShape { n, c },
        } = *op;
        let args = [
            Arg::F(dinp),
            Arg::F(mean),
            Arg::F(rstd),
            Arg::F(inp),
            Arg::F(weight),
            Arg::F(dout),
            Arg::U(n),
            Arg::U(c),
        ];
        self.launch("layernorm_backward", n, &args);
        let args = [
            Arg::F(dweight),
            Arg::F(dbias),
            Arg::F(mean),
            Arg::F(rstd),
            Arg::F(inp),
            Arg::F(dout),
            Arg::U(n),
            Arg::U(c),
        ];
        self.launch("layernorm_backward_params", c.div_ceil(COLUMNS_PER_BLOCK), &args);
    }

    fn matmul_forward(&mut self, op: Checked<MatmulForward>) {
        let MatmulForward {
            out,
            inp,
            weight,
            bias,
            shape: s,
        } = *op;
        let (o, i, w) = (self.addr(out), self.addr(inp), self.addr(weight));
        self.gemm(blas::forward(o, i, w, s));
        if let Some(bias) = bias {
            let args = [Arg::F(out), Arg::F(bias), Arg::U(s.n), Arg::U(s.oc)];
            self.launch("matmul_forward_bias", Self::per_element(s.n * s.oc), &args);
        }
    }

    fn matmul_backward(&mut self, op: Checked<MatmulBackward>) {
        let MatmulBackward {
            dinp,
            dweight,
            dbias,
            dout,
            inp,
            weight,
            shape: s,
        } = *op;
        let (di, dw) = (self.addr(dinp), self.addr(dweight));
        let (d, i, w) = (self.addr(dout), self.addr(inp), self.addr(weight));
        self.gemm(blas::backward_input(di, d, w, s));
        self.gemm(blas::backward_weight(dw, i, d, s));
        if let Some(dbias) = dbias {
            let args = [Arg::F(dbias), Arg::F(dout), Arg::U(s.n), Arg::U(s.oc)];
            self.launch("matmul_backward_bias", s.oc.div_ceil(COLUMNS_PER_BLOCK), &args);
        }
    }

    /// TF32 through cuBLAS's math mode; the kernels stay fp32.
    fn set_matmul_precision(&mut self, precision: MatmulPrecision) -> Result<()> {
        Ok(self.gpu.set_tf32(precision == MatmulPrecision::Tf32)?)
    }

    /// The flash kernels keep each row's log-sum-exp and recompute the probabilities in backward.
    fn attention_saving(&self) -> AttentionSaving {
        AttentionSaving::RowLogSumExp
    }

    fn attention_forward(&mut self, op: Checked<AttentionForward>) {
        let AttentionForward {
            out,
            saved: lse,
            qkv,
            shape,
            ..
        } = *op;
        if self.refuse_heads("attention_forward", shape) {
            return;
        }
        let AttentionShape { b, t, c, nh } = shape;
        let args = [
            Arg::F(out),
            Arg::F(lse),
            Arg::F(qkv),
            Arg::U(b),
            Arg::U(t),
            Arg::U(c),
            Arg::U(nh),
        ];
        self.launch_blocks_of("attention_forward", (flash_groups(b, t, nh), FLASH_ROWS), &args);
    }

    fn attention_backward(&mut self, op: Checked<AttentionBackward>) {
        let AttentionBackward {
            dqkv,
            scratch: delta,
            dout,
            qkv,
            out,
            saved: lse,
            shape,
            ..
        } = *op;
        if self.refuse_heads("attention_backward", shape) {
            return;
        }
        let AttentionShape { b, t, c, nh } = shape;
        let sizes = [Arg::U(b), Arg::U(t), Arg::U(c), Arg::U(nh)];
        let delta_args = [Arg::F(delta), Arg::F(dout), Arg::F(out)];
        let rows = Self::per_element(b * nh * t);
        self.launch("attention_backward_delta", rows, &[&delta_args[..], &sizes].concat());
        let args = [Arg::F(dqkv), Arg::F(lse), Arg::F(qkv), Arg::F(delta), Arg::F(dout)];
        let args = [&args[..], &sizes].concat();
        for kernel in [
            "attention_backward_dq",
            "attention_backward_dk",
            "attention_backward_dv",
        ] {
            self.launch_blocks_of(kernel, (flash_groups(b, t, nh), FLASH_ROWS), &args);
        }
    }

    fn gelu_forward(&mut self, op: Checked<GeluForward>) {
        let GeluForward { out, inp } = *op;
        self.launch(
            "gelu_forward",
            Self::per_element(out.len),
            &[Arg::F(out), Arg::F(inp), Arg::U(out.len)],
        );
    }

    fn gelu_backward(&mut self, op: Checked<GeluBackward>) {
        let GeluBackward { dinp, inp, dout } = *op;
        let args = [Arg::F(dinp), Arg::F(inp), Arg::F(dout), Arg::U(dinp.len)];
        self.launch("gelu_backward", Self::per_element(dinp.len), &args);
    }

    fn residual_forward(&mut self, op: Checked<ResidualForward>) {
        let ResidualForward { out, a, b } = *op;
        let args = [Arg::F(out), Arg::F(a), Arg::F(b), Arg::U(out.len)];
        self.launch("residual_forward", Self::per_element(out.len), &args);
    }

    fn add_inplace(&mut self, op: Checked<AddInplace>) {
        let AddInplace { dst, src } = *op;
        self.launch(
            "add_inplace",
            Self::per_element(dst.len),
            &[Arg::F(dst), Arg::F(src), Arg::U(dst.len)],
        );
    }

    fn crossentropy_forward(&mut self, op: Checked<CrossEntropyForward>) {
        let CrossEntropyForward {
            losses,
            logits,
            targets,
            shape: LogitsShape { n, v },
        } = *op;
        let args = [Arg::F(losses), Arg::F(logits), Arg::Tok(targets), Arg::U(n), Arg::U(v)];
        self.launch("crossentropy_forward", n, &args);
    }

    fn crossentropy_backward(&mut self, op: Checked<CrossEntropyBackward>) {
        let CrossEntropyBackward {
            dlogits,
            logits,
            targets,
            shape: LogitsShape { n, v },
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
        let args = [Arg::F(dlogits), Arg::Tok(targets), Arg::U(n), Arg::U(v), Arg::S(dloss)];
        self.launch("crossentropy_backward", n, &args);
    }

    fn sum_squares(&mut self, x: View) -> Result<f64> {
        if x.len == 0 {
            return self.take_error().map(|()| 0.0);
        }
        let blocks = x.len.div_ceil(SUM_BLOCK);
        let partial = self.scratch(Scratch::Partials, blocks)?;
        self.launch("sum_squares", blocks, &[Arg::Ptr(partial), Arg::F(x), Arg::U(x.len)]);
        let mut sums = vec![0f32; blocks];
        self.copy_out(partial, &mut sums)?;
        Ok(sums.iter().map(|&s| s as f64).sum())
    }

    fn scale(&mut self, x: View, s: f32) {
        self.launch(
            "scale",
            Self::per_element(x.len),
            &[Arg::F(x), Arg::S(s), Arg::U(x.len)],
        );
    }

    fn adamw(&mut self, op: Checked<AdamWUpdate>) {
        let AdamWUpdate {
            params,
            grads,
            m,
            v,
            step: h,
            decay_runs,
        } = *op;
        let n = params.len;
        // Without runs the kernel reads none: any valid address stands in.
        let runs = match decay_runs {
            Some(r) if r.len > 0 => Arg::Tok(r),
            _ => Arg::F(params),
        };
        let args = [
            Arg::F(params),
            Arg::F(grads),
            Arg::F(m),
            Arg::F(v),
            Arg::U(n),
            Arg::S(h.lr),
            Arg::S(h.beta1),
            Arg::S(h.beta2),
            Arg::S(h.eps),
            Arg::S(h.weight_decay),
            Arg::S(h.step_size),
            Arg::S(h.bias_correction2_sqrt),
            Arg::S(h.grad_scale),
            runs,
            Arg::U(decay_runs.map_or(0, |r| r.len)),
            Arg::U(decay_runs.is_some() as usize),
        ];
        self.launch("adamw", Self::per_element(n), &args);
    }

    /// The kernels index every tensor with 32 bits: attention's `[b, nh, t, t]`, the qkv projection and the
    /// logits `[b * t, vocab]` must stay under 2^32 elements.
    fn check_step_shape(&self, shape: StepShape) -> Result<()> {
        let attention = AttentionShape {
            b: shape.batch,
            t: shape.seq_len,
            c: shape.width,
            nh: shape.heads,
        };
        if let Some(e) = head_width_error("attention", attention) {
            return Err(e.into());
        }
        match shape.past_index_limit(u32::MAX as usize, 32, self.attention_saving()) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    fn begin_download(&mut self, src: View, host: Vec<f32>) -> Result<Download> {
        let addr = self.addr(src);
        let ticket = self.gpu.begin_read(addr, src.len)?;
        Ok(Download::InFlight { ticket, host })
    }

    fn download_ready(&mut self, download: &Download) -> Result<bool> {
        match download {
            Download::Ready(_) => Ok(true),
            Download::InFlight { ticket, .. } => Ok(self.gpu.read_ready(*ticket)?),
        }
    }

    fn finish_download(&mut self, download: Download) -> Result<Vec<f32>> {
        match download {
            Download::Ready(host) => Ok(host),
            Download::InFlight { ticket, mut host } => {
                self.gpu.finish_read(ticket, &mut host)?;
                self.take_error()?;
                Ok(host)
            }
        }
    }

    fn memory(&self) -> BackendMemory {
        BackendMemory::Device {
            available: self.gpu.free_memory(),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        let waited = self.gpu.synchronize();
        self.record(waited);
        self.take_error()
    }
}
