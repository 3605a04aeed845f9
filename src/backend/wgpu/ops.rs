//! The ops of [`Backend`] on the wgpu backend: each checks its views, binds them as windows, splits the
//! work where a window would exceed a storage binding (element-wise ops, AdamW and `sum_squares` by
//! ranges, the encoder by vocabulary rows, cross-entropy by rows, attention by sequence) and records its
//! dispatches. Matmuls are planned in `matmul.rs`.
//!
//! Limits that remain: one cross-entropy row (`V` floats), one layer-norm `[n, c]` tensor and one
//! sequence's attention `[nh, t, t]` must each fit a binding.

use super::kernels::WG;
use super::loop_budget::{attention_iterations, column_sum_iterations, tree_iterations};
use super::params::{
    word, AdamWParams, AttentionParams, CrossEntropyParams, EncoderParams, GeluParams, KernelParams, LayerNormParams,
    ReduceParams, ResidualParams,
};
use super::windows::Win;
use super::{ceil_div, Backend, BackendError, Download, TokenView, View, WgpuBackend, SUM_BLOCK};
use crate::backend::flash::{head_width_error, FLASH_ROWS as ATTENTION_ROWS};
use crate::backend::op_args::*;
use crate::backend::StepShape;
use anyhow::Result;

/// `VPI` of residual4.wgsl: vec4s per invocation of the vec4 element-wise kernels.
const VEC4_PER_INVOCATION: usize = 16;

impl WgpuBackend {
    /// Runs an element-wise kernel over equally long views (bound in this order), in ranges that fit a
    /// binding window. `vec4`, the kernel's vec4 twin, runs the multiple-of-4 head when every view starts at
    /// a multiple of 4 elements (windows then start 16-byte aligned), the scalar kernel the tail.
    /// `params(n, offsets)` gives a range's parameters from its length and its windows' offsets (in vec4s
    /// for the twin; 0 past the last view).
    fn elementwise<P: KernelParams>(
        &mut self,
        kernel: &'static str,
        vec4: Option<&'static str>,
        views: &[View],
        params: impl Fn(u32, [u32; 3]) -> P,
    ) {
        // Equal lengths: every caller's arguments were checked (`OpArgs::check`).
        let len = views[0].len;
        let chunk = self.max_window_elems() / SUM_BLOCK * SUM_BLOCK;
        let offsets = |wins: &[Win], unit: u32| std::array::from_fn(|i| wins.get(i).map_or(0, |w| w.off / unit));
        let mut start = 0;
        if let Some(k4) = vec4.filter(|_| len >= 4 && views.iter().all(|v| v.offset % 4 == 0)) {
            let head = len / 4 * 4;
            while start < head {
                let n = chunk.min(head - start);
                let wins: Vec<Win> = views.iter().map(|v| self.win(v.sub(start, n))).collect();
                if wins.iter().any(|w| w.off % 4 != 0 || w.start % 16 != 0) {
                    // Unaligned window (an adapter with an odd offset alignment): scalar kernels for the rest.
                    break;
                }
                let p = params(word(n / 4), offsets(&wins, 4));
                let groups = self.grid(ceil_div(n / 4, WG as usize * VEC4_PER_INVOCATION));
                self.dispatch(k4, &wins, &p, groups);
                start += n;
            }
        }
        while start < len {
            let n = chunk.min(len - start);
            let wins: Vec<Win> = views.iter().map(|v| self.win(v.sub(start, n))).collect();
            let p = params(word(n), offsets(&wins, 1));
            let groups = self.grid1d(n);
            self.dispatch(kernel, &wins, &p, groups);
            start += n;
        }
    }
}

/// Parameters of the residual family's kernels (`residual_forward`, `add_inplace`, `scale`, `fill`,
/// `copy` and their vec4 twins) with scalar `s`: 0 for the kernels that read none.
fn residual_params(s: f32) -> impl Fn(u32, [u32; 3]) -> ResidualParams {
    move |n, [dst_off, a_off, b_off]| ResidualParams {
        n,
        dst_off,
        a_off,
        b_off,
        s,
    }
}

fn gelu_params(n: u32, [out_off, inp_off, dout_off]: [u32; 3]) -> GeluParams {
    GeluParams {
        n,
        out_off,
        inp_off,
        dout_off,
    }
}

impl Backend for WgpuBackend {
    /// The shaders index with 32 bits (attention, the qkv projection and the logits must stay under 2^32
    /// elements), and a software adapter's loop budget bounds the longest loops.
    fn check_step_shape(&self, shape: StepShape) -> Result<()> {
        if let Some(e) = shape.past_index_limit(u32::MAX as usize, 32, self.attention_saving()) {
            return Err(e.into());
        }
        let (b, t, c, nh) = (shape.batch, shape.seq_len, shape.width, shape.heads);
        if let Some(e) = head_width_error("attention", AttentionShape { b, t, c, nh }) {
            return Err(e.into());
        }
        let tokens = b * t;
        let checks = [
            ("attention", attention_iterations(t)),
            // The weight gradients sum over every token of the micro-batch (k = b * t; the strided kernel
            // where the texture-fed one does not apply).
            ("the weight-gradient matmul", self.weight_gradient_iterations(tokens)),
            ("the embedding backward", tokens),
        ];
        for (op, iterations) in checks {
            if let Some(BackendError::ShapeUnsupported { op, detail }) = self.loop_budget_error(op, iterations) {
                let detail = format!("{detail} (at batch size {b} and sequence length {t}: {tokens} tokens per rank)");
                return Err(BackendError::ShapeUnsupported { op, detail }.into());
            }
        }
        Ok(())
    }

    fn name(&self) -> String {
        let r = &self.ctx.report;
        format!("wgpu ({}, {}, {})", r.name, r.backend, r.device_type)
    }

    fn alloc(&mut self, len: usize) -> Result<View> {
        self.alloc_tensor(len)
    }

    fn alloc_tokens(&mut self, len: usize) -> Result<TokenView> {
        self.alloc_token_buffer(len)
    }

    fn free(&mut self, view: View) {
        self.free_tensor(view.buf);
    }

    fn free_tokens(&mut self, view: TokenView) {
        self.free_token_buffer(view.buf);
    }

    fn upload(&mut self, dst: View, src: &[f32]) -> Result<()> {
        self.write_tensor(dst, src)
    }

    fn upload_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()> {
        self.write_tokens(dst, src)
    }

    fn download(&mut self, src: View, dst: &mut [f32]) -> Result<()> {
        self.read_tensor(src, dst)
    }

    fn begin_download(&mut self, src: View, host: Vec<f32>) -> Result<Download> {
        self.begin_read(src, host)
    }

    fn download_ready(&mut self, download: &Download) -> Result<bool> {
        Ok(self.read_ready(download)?)
    }

    fn finish_download(&mut self, download: Download) -> Result<Vec<f32>> {
        Ok(self.finish_read(download)?)
    }

    fn fill(&mut self, dst: View, value: f32) {
        self.elementwise("fill", Some("fill4"), &[dst], residual_params(value));
    }

    fn copy(&mut self, op: Checked<CopyInto>) {
        self.elementwise("copy", Some("copy4"), &[op.dst, op.src], residual_params(0.0));
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
        if n == 0 {
            return;
        }
        let v = wte.len / c;
        let (wout, wtok, wwpe) = (self.win(out), self.twin(tokens), self.win(wpe.sub(0, t * c)));
        for (v0, v1) in self.row_windows(v, c) {
            let wwte = self.win(wte.sub(v0 * c, (v1 - v0) * c));
            let p = EncoderParams {
                n: word(n),
                t: word(t),
                c: word(c),
                dst_off: wout.off,
                src0_off: wwte.off,
                src1_off: wwpe.off,
                idx_off: wtok.off,
                v0: word(v0),
                v1: word(v1),
            };
            let groups = self.grid1d(n * c);
            let wins = [wout.clone(), wwte, wwpe.clone(), wtok.clone()];
            self.dispatch("encoder_forward", &wins, &p, groups);
        }
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
        // A token's invocation adds up to every position of the batch.
        if !self.require_loop_budget("the embedding backward", n) {
            return;
        }
        let wdout = self.win(dout);
        // dwpe: one invocation per (t, channel), summing the batch in order.
        let wdwpe = self.win(dwpe.sub(0, t * c));
        let p = EncoderParams {
            n: word(b),
            t: word(t),
            c: word(c),
            dst_off: wdwpe.off,
            src0_off: wdout.off,
            ..Default::default()
        };
        let groups = self.grid1d(t * c);
        self.dispatch("encoder_backward_wpe", &[wdwpe, wdout.clone()], &p, groups);
        // dwte: one invocation per (distinct token, channel), summing the token's positions in (b, t) order,
        // grouped on the host.
        let v = dwte.len / c;
        let (u, index) = crate::backend::token_index::token_index(
            &self.token_buffer(tokens.buf).host[tokens.offset..tokens.offset + n],
            v,
        );
        let waux = self.write_embed_index(&index);
        for (v0, v1) in self.row_windows(v, c) {
            let wdwte = self.win(dwte.sub(v0 * c, (v1 - v0) * c));
            let p = EncoderParams {
                n: word(u),
                t: word(t),
                c: word(c),
                dst_off: wdwte.off,
                src0_off: wdout.off,
                v0: word(v0),
                v1: word(v1),
                ..Default::default()
            };
            let groups = self.grid1d(u * c);
            let wins = [wdwte, wdout.clone(), self.dummy_win(), waux.clone()];
            self.dispatch("encoder_backward_wte", &wins, &p, groups);
        }
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
        if n == 0 {
            return;
        }
        let w = [out, mean, rstd, inp, weight, bias].map(|v| self.win(v));
        let p = LayerNormParams {
            n: word(n),
            c: word(c),
            out_off: w[0].off,
            mean_off: w[1].off,
            rstd_off: w[2].off,
            inp_off: w[3].off,
            w_off: w[4].off,
            b_off: w[5].off,
            dout_off: 0,
            dw_off: 0,
        };
        let Some((kernel, groups)) = self.per_row(
            ("layernorm_forward", 1, tree_iterations(c, WG as usize, 3, 2, 8)),
            ("layernorm_forward_rows", 3 * c),
            n,
        ) else {
            return;
        };
        self.dispatch(kernel, &w, &p, groups);
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
        if n == 0 {
            return;
        }
        let w = [dinp, mean, rstd, inp, weight, dbias, dout, dweight].map(|v| self.win(v));
        let p = LayerNormParams {
            n: word(n),
            c: word(c),
            out_off: w[0].off,
            mean_off: w[1].off,
            rstd_off: w[2].off,
            inp_off: w[3].off,
            w_off: w[4].off,
            b_off: w[5].off,
            dout_off: w[6].off,
            dw_off: w[7].off,
        };
        // Both passes read the same parameter block: the input gradient by rows, then dweight/dbias by columns.
        let Some((kernel, groups)) = self.per_row(
            ("layernorm_backward", 1, tree_iterations(c, WG as usize, 2, 2, 8)),
            ("layernorm_backward_rows", 2 * c),
            n,
        ) else {
            return;
        };
        self.dispatch(kernel, &w[..7], &p, groups);
        let Some((kernel, groups)) = self.per_row(
            ("layernorm_backward_params", 16, column_sum_iterations(n)),
            ("layernorm_backward_params_cols", n),
            c,
        ) else {
            return;
        };
        self.dispatch(kernel, &w, &p, groups);
    }

    fn matmul_forward(&mut self, op: Checked<MatmulForward>) {
        let MatmulForward {
            out,
            inp,
            weight,
            bias,
            shape,
        } = *op;
        self.matmul_forward_gemm(out, inp, weight, bias, shape);
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
        self.matmul_backward_gemms(dinp, dweight, dout, inp, weight, s);
        if let Some(db) = dbias {
            self.matmul_bias_gradient(db, dout, s.n, s.oc);
        }
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
        let AttentionShape { b, t, c, nh } = shape;
        if b == 0 || t == 0 || !self.require_attention_kernels("attention", shape) {
            return;
        }
        let per = match self.attention_batch_step("attention", b, &[(out, t * c), (lse, nh * t), (qkv, t * 3 * c)]) {
            Some(per) => per,
            None => return,
        };
        for b0 in (0..b).step_by(per) {
            let nb = per.min(b - b0);
            let o = out.sub(b0 * t * c, nb * t * c);
            let l = lse.sub(b0 * nh * t, nb * nh * t);
            let q = qkv.sub(b0 * t * 3 * c, nb * t * 3 * c);
            let w = [o, l, q].map(|v| self.win(v));
            let p = AttentionParams {
                b: word(nb),
                t: word(t),
                c: word(c),
                nh: word(nh),
                out_off: w[0].off,
                lse_off: w[1].off,
                qkv_off: w[2].off,
                delta_off: 0,
                dout_off: 0,
                fout_off: 0,
            };
            let groups = self.grid(nb * nh * t.div_ceil(ATTENTION_ROWS));
            self.dispatch("attention_forward", &w, &p, groups);
        }
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
        let AttentionShape { b, t, c, nh } = shape;
        if b == 0 || t == 0 || !self.require_attention_kernels("attention backward", shape) {
            return;
        }
        let per_sequence = [
            (dqkv, t * 3 * c),
            (lse, nh * t),
            (qkv, t * 3 * c),
            (delta, nh * t),
            (dout, t * c),
            (out, t * c),
        ];
        let per = match self.attention_batch_step("attention backward", b, &per_sequence) {
            Some(per) => per,
            None => return,
        };
        for b0 in (0..b).step_by(per) {
            let nb = per.min(b - b0);
            let views = [
                dqkv.sub(b0 * t * 3 * c, nb * t * 3 * c),
                lse.sub(b0 * nh * t, nb * nh * t),
                qkv.sub(b0 * t * 3 * c, nb * t * 3 * c),
                delta.sub(b0 * nh * t, nb * nh * t),
                dout.sub(b0 * t * c, nb * t * c),
                out.sub(b0 * t * c, nb * t * c),
            ];
            let w = views.map(|v| self.win(v));
            let p = AttentionParams {
                b: word(nb),
                t: word(t),
                c: word(c),
                nh: word(nh),
                out_off: w[0].off,
                lse_off: w[1].off,
                qkv_off: w[2].off,
                delta_off: w[3].off,
                dout_off: w[4].off,
                fout_off: w[5].off,
            };
            let rows = self.grid1d(nb * nh * t);
            self.dispatch("attention_backward_delta", &w, &p, rows);
            let groups = self.grid(nb * nh * t.div_ceil(ATTENTION_ROWS));
            for kernel in [
                "attention_backward_dq",
                "attention_backward_dk",
                "attention_backward_dv",
            ] {
                self.dispatch(kernel, &w[..5], &p, groups);
            }
        }
    }

    fn gelu_forward(&mut self, op: Checked<GeluForward>) {
        self.elementwise("gelu_forward", None, &[op.out, op.inp], gelu_params);
    }

    fn gelu_backward(&mut self, op: Checked<GeluBackward>) {
        self.elementwise("gelu_backward", None, &[op.dinp, op.inp, op.dout], gelu_params);
    }

    fn residual_forward(&mut self, op: Checked<ResidualForward>) {
        self.elementwise(
            "residual_forward",
            Some("residual_forward4"),
            &[op.out, op.a, op.b],
            residual_params(0.0),
        );
    }

    fn add_inplace(&mut self, op: Checked<AddInplace>) {
        self.elementwise(
            "add_inplace",
            Some("add_inplace4"),
            &[op.dst, op.src],
            residual_params(0.0),
        );
    }

    fn crossentropy_forward(&mut self, op: Checked<CrossEntropyForward>) {
        let CrossEntropyForward {
            losses,
            logits,
            targets,
            shape: LogitsShape { n, v },
        } = *op;
        for (r0, r1) in self.row_windows(n, v) {
            let (wl, wx, wt) = (
                self.win(losses.sub(r0, r1 - r0)),
                self.win(logits.sub(r0 * v, (r1 - r0) * v)),
                self.twin(targets.sub(r0, r1 - r0)),
            );
            let p = CrossEntropyParams {
                n: word(r1 - r0),
                v: word(v),
                out_off: wl.off,
                logits_off: wx.off,
                tgt_off: wt.off,
                dloss: 0.0,
            };
            let Some((kernel, groups)) = self.per_row(
                ("crossentropy_forward", 1, tree_iterations(v, WG as usize, 2, 2, 8)),
                ("crossentropy_forward_rows", 2 * v),
                r1 - r0,
            ) else {
                return;
            };
            self.dispatch(kernel, &[wl, wx, wt], &p, groups);
        }
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
        for (r0, r1) in self.row_windows(n, v) {
            let (wx, wt) = (
                self.win(dlogits.sub(r0 * v, (r1 - r0) * v)),
                self.twin(targets.sub(r0, r1 - r0)),
            );
            let p = CrossEntropyParams {
                n: word(r1 - r0),
                v: word(v),
                out_off: 0,
                logits_off: wx.off,
                tgt_off: wt.off,
                dloss,
            };
            let Some((kernel, groups)) = self.per_row(
                ("crossentropy_backward", 1, tree_iterations(v, WG as usize, 3, 2, 8)),
                ("crossentropy_backward_rows", 3 * v),
                r1 - r0,
            ) else {
                return;
            };
            let wins = [self.dummy_win(), wx, wt];
            self.dispatch(kernel, &wins, &p, groups);
        }
    }

    fn sum_squares(&mut self, x: View) -> Result<f64> {
        if x.len == 0 {
            self.check_device_errors()?;
            return Ok(0.0);
        }
        let blocks = ceil_div(x.len, SUM_BLOCK);
        let partial = self.sum_squares_partials(blocks)?;
        let chunk = self.max_window_elems() / SUM_BLOCK * SUM_BLOCK;
        let mut start = 0;
        while start < x.len {
            let n = chunk.min(x.len - start);
            let wx = self.win(x.sub(start, n));
            let wp = self.win_of(&partial.buffer, Some(partial.id), blocks, 0, blocks);
            let p = ReduceParams {
                n: word(n),
                x_off: wx.off,
                out_off: word(start / SUM_BLOCK),
            };
            let groups = self.grid(ceil_div(n, SUM_BLOCK));
            self.dispatch("sum_squares", &[wp, wx], &p, groups);
            start += n;
        }
        let bytes = self.read_back(&[(partial.buffer, 0, blocks as u64 * 4)])?;
        let sums: &[f32] = bytemuck::cast_slice(&bytes);
        Ok(sums.iter().map(|&s| s as f64).sum())
    }

    fn scale(&mut self, x: View, s: f32) {
        self.elementwise("scale", Some("scale4"), &[x], residual_params(s));
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
        let len = params.len;
        let chunk = self.max_window_elems() / SUM_BLOCK * SUM_BLOCK;
        let mut start = 0;
        while start < len {
            let n = chunk.min(len - start);
            let mut w = [params, grads, m, v].map(|x| self.win(x.sub(start, n))).to_vec();
            w.push(match decay_runs {
                Some(runs) if runs.len > 0 => self.twin(runs),
                _ => self.dummy_win(),
            });
            let p = AdamWParams {
                n: word(n),
                p_off: w[0].off,
                g_off: w[1].off,
                m_off: w[2].off,
                v_off: w[3].off,
                lr: h.lr,
                beta1: h.beta1,
                beta2: h.beta2,
                eps: h.eps,
                weight_decay: h.weight_decay,
                step_size: h.step_size,
                bc2_sqrt: h.bias_correction2_sqrt,
                grad_scale: h.grad_scale,
                base: word(start),
                runs_off: w[4].off,
                n_bounds: word(decay_runs.map_or(0, |r| r.len)),
                runs_given: decay_runs.is_some() as u32,
            };
            let groups = self.grid1d(n);
            self.dispatch("adamw", &w, &p, groups);
            start += n;
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        let waited = self.wait();
        // After the wait every map callback has fired, so the staging of reclaimed read-backs is reusable.
        self.readbacks.end_interval();
        Ok(waited?)
    }
}

impl WgpuBackend {
    /// Sequences per dispatch of the attention kernels over `views` (each with its elements per sequence):
    /// all when every view fits one binding, else one at a time. `None`, with the refusal recorded, when one
    /// sequence's views do not fit.
    fn attention_batch_step(&mut self, op: &str, b: usize, views: &[(View, usize)]) -> Option<usize> {
        if views.iter().all(|(v, _)| self.fits(v.offset, v.end())) {
            return Some(b);
        }
        // A sequence's window starts at most one alignment before its first element.
        let largest = views.iter().map(|&(_, per)| per).max().unwrap_or(0);
        if 4 * largest as u64 + self.align <= self.max_binding {
            return Some(1);
        }
        self.errors.record(BackendError::ShapeUnsupported {
            op: op.into(),
            detail: format!(
                "one sequence needs a {}-byte binding, past this adapter's limit of {} bytes",
                4 * largest,
                self.max_binding
            ),
        });
        None
    }
}
