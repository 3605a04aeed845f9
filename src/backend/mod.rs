//! The backend abstraction: the op set of one GPT-2 training step.
//!
//! Tensors are backend-owned buffers addressed by [`View`]s (buffer id + element offset + length), so the
//! parameters and gradients can each live in one flat buffer with named views into it, and the collective
//! layer can work on the whole flat buffer or on buckets of it. Nothing moves between host and device except
//! through the explicit transfer calls (`upload*`, `download`), so a GPU backend never round-trips through
//! host memory between ops.
//!
//! Accumulation rules (shared by every backend; the CPU backend is the readable specification):
//! - parameter gradients (`dweight`, `dbias`, `dwte`, `dwpe`) are always accumulated (`+=`), so gradient
//!   accumulation over micro-batches needs no extra pass;
//! - `layernorm_backward` accumulates into `dinp` (`+=`) because its input is the residual stream, whose
//!   gradient is the sum of the skip path and the normalised path;
//! - every other activation gradient is overwritten (`=`).
//!
//! Outputs never alias inputs, except where an op says so (`crossentropy_backward` may write `dlogits`
//! over `logits`).
//!
//! Errors: the errors backends return are [`BackendError`]s (inside `anyhow::Error`). Ops do not return
//! errors: a device failure, or a shape a backend refuses, during an op is recorded, and the first one is
//! returned by the next synchronisation point (`synchronize`, `download`, `sum_squares`).

/// Calls `$m!(method(Args), ...)` with every [`Backend`] op that takes only its checked arguments, so that
/// a backend wrapping another (a box, the profiler) forwards each without listing them again.
macro_rules! every_op {
    ($m:ident) => {
        $m!(
            copy(CopyInto),
            encoder_forward(EncoderForward),
            encoder_backward(EncoderBackward),
            layernorm_forward(LayerNormForward),
            layernorm_backward(LayerNormBackward),
            matmul_forward(MatmulForward),
            matmul_backward(MatmulBackward),
            attention_forward(AttentionForward),
            attention_backward(AttentionBackward),
            gelu_forward(GeluForward),
            gelu_backward(GeluBackward),
            residual_forward(ResidualForward),
            add_inplace(AddInplace),
            crossentropy_forward(CrossEntropyForward),
            crossentropy_backward(CrossEntropyBackward),
            adamw(AdamWUpdate),
            matmul_gelu_forward(MatmulGeluForward),
            add_layernorm_forward(AddLayerNormForward),
            crossentropy_forward_backward(CrossEntropyForwardBackward),
        );
    };
}

mod boxed;
pub mod conformance;
pub mod cpu;
pub mod cuda;
mod error;
pub mod factory;
pub mod flash;
pub mod matmul_bench;
mod op_args;
pub mod op_cost;
pub mod profiled;
pub mod testing;
mod token_index;
mod view;
pub mod wgpu;

pub use error::BackendError;
pub use op_args::{
    AdamWUpdate, AddInplace, AddLayerNormForward, AttentionBackward, AttentionForward, AttentionSaving, AttentionShape,
    Checked, CopyInto, CrossEntropyBackward, CrossEntropyForward, CrossEntropyForwardBackward, EncoderBackward,
    EncoderForward, EncoderShape, GeluBackward, GeluForward, LayerNormBackward, LayerNormForward, LogitsShape,
    MatmulBackward, MatmulForward, MatmulGeluForward, MatmulShape, OpArgs, ResidualForward, RowsShape, WeightLayout,
};
pub use view::{TokenView, View};

use anyhow::Result;

/// One AdamW update, already resolved to scalars (the schedule, clipping and bias corrections are
/// computed on the host, identically on every rank).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled decay; 0 for tensors of rank < 2.
    pub weight_decay: f32,
    /// `lr / (1 - beta1^t)`, with `t` the 1-based optimizer step (computed in f64 as torch does).
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)` (computed in f64 as torch does).
    pub bias_correction2_sqrt: f32,
    /// Multiplies the gradient before use: gradient averaging and clipping in one place.
    pub grad_scale: f32,
}

/// Where a backend keeps its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendMemory {
    /// In the process's own memory, beside the host staging buffers (the CPU backend).
    Host,
    /// On a device; `available` is the free device memory in bytes where the driver reports it.
    Device { available: Option<u64> },
}

/// A read-back of a device range, begun by [`Backend::begin_download`] while later work may still be
/// queued, and finished by [`Backend::finish_download`].
#[derive(Debug)]
pub enum Download {
    /// The values are on the host already (synchronous backends copy at once).
    Ready(Vec<f32>),
    /// The copy is recorded on the device; `ticket` names it in the backend's own table, and `host` is the
    /// buffer that will receive the values.
    InFlight { ticket: u64, host: Vec<f32> },
}

/// How matmuls multiply (`--matmul-precision`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// fp32 products and sums (TF32 off), every backend's default.
    #[default]
    Fp32,
    /// Inputs rounded to TF32 (10-bit mantissa) on tensor cores, fp32 sums: CUDA only, deterministic.
    Tf32,
}

impl std::str::FromStr for MatmulPrecision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" => Ok(MatmulPrecision::Fp32),
            "tf32" => Ok(MatmulPrecision::Tf32),
            other => Err(format!("unknown matmul precision {other:?}: expected fp32 or tf32")),
        }
    }
}

/// The shape of one training step's micro-batch on a model, as a backend checks it up front
/// ([`Backend::check_step_shape`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// The model's width (`n_embd`).
    pub width: usize,
    pub heads: usize,
    pub vocab: usize,
}

impl StepShape {
    /// The largest tensors of a step, by element count, with attention keeping what `saving` says: each
    /// must be indexable by the GPU kernels.
    pub fn largest_tensors(&self, saving: AttentionSaving) -> [(&'static str, usize); 3] {
        let (b, t) = (self.batch, self.seq_len);
        let per_row = match saving {
            AttentionSaving::Probabilities => t,
            AttentionSaving::RowLogSumExp => 1,
        };
        [
            (
                "attention",
                b.saturating_mul(self.heads).saturating_mul(t).saturating_mul(per_row),
            ),
            (
                "the qkv projection",
                b.saturating_mul(t).saturating_mul(3).saturating_mul(self.width),
            ),
            ("the logits", b.saturating_mul(t).saturating_mul(self.vocab)),
        ]
    }

    /// [`BackendError::ShapeUnsupported`] for the first tensor of the step with more than `limit` elements
    /// (the kernels' indices are `index_bits` wide), attention keeping what `saving` says.
    pub fn past_index_limit(&self, limit: usize, index_bits: u32, saving: AttentionSaving) -> Option<BackendError> {
        let (op, elements) = self.largest_tensors(saving).into_iter().find(|(_, n)| *n > limit)?;
        Some(BackendError::ShapeUnsupported {
            op: op.into(),
            detail: format!(
                "needs {elements} elements in one tensor at batch size {} and sequence length {}, past the \
                 {limit} that the kernels' {index_bits}-bit indices reach: a smaller batch or a shorter \
                 sequence fits",
                self.batch, self.seq_len
            ),
        })
    }
}

/// The op set of a GPT-2 training step. Every method panics only on a programming error (views of the
/// wrong length, a view into a freed buffer); anything that depends on the outside world returns `Result`
/// now or, for ops, at the next synchronisation point.
pub trait Backend {
    /// A short human-readable name, e.g. `cpu (f32, 2 threads)`.
    fn name(&self) -> String;

    // ---- memory and transfers ----
    /// A new zero-filled f32 buffer of `len` elements.
    fn alloc(&mut self, len: usize) -> Result<View>;
    /// A new zero-filled token buffer of `len` elements.
    fn alloc_tokens(&mut self, len: usize) -> Result<TokenView>;
    /// Frees the whole buffer `view` belongs to (not only the view's range). Every view into that buffer
    /// becomes invalid: using one, or freeing it again, is a programming error. Buffer ids are never
    /// reused, so a stale view cannot reach a later buffer. Work already recorded on the buffer completes.
    fn free(&mut self, view: View);
    /// [`Backend::free`] for a token buffer.
    fn free_tokens(&mut self, view: TokenView);
    fn upload(&mut self, dst: View, src: &[f32]) -> Result<()>;
    fn upload_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()>;
    fn download(&mut self, src: View, dst: &mut [f32]) -> Result<()>;
    fn fill(&mut self, dst: View, value: f32);
    /// `dst = src`.
    fn copy(&mut self, op: Checked<CopyInto>);

    // ---- forward/backward ops: each takes its arguments checked (see [`OpArgs`]); their structs document the
    // shapes ----
    fn encoder_forward(&mut self, op: Checked<EncoderForward>);
    fn encoder_backward(&mut self, op: Checked<EncoderBackward>);
    fn layernorm_forward(&mut self, op: Checked<LayerNormForward>);
    fn layernorm_backward(&mut self, op: Checked<LayerNormBackward>);
    fn matmul_forward(&mut self, op: Checked<MatmulForward>);
    fn matmul_backward(&mut self, op: Checked<MatmulBackward>);
    /// What this backend's attention keeps from forward for backward: the model carves its lengths and
    /// passes it back in the attention ops' arguments.
    fn attention_saving(&self) -> AttentionSaving;
    fn attention_forward(&mut self, op: Checked<AttentionForward>);
    fn attention_backward(&mut self, op: Checked<AttentionBackward>);
    fn gelu_forward(&mut self, op: Checked<GeluForward>);
    fn gelu_backward(&mut self, op: Checked<GeluBackward>);
    fn residual_forward(&mut self, op: Checked<ResidualForward>);
    fn add_inplace(&mut self, op: Checked<AddInplace>);
    fn crossentropy_forward(&mut self, op: Checked<CrossEntropyForward>);
    fn crossentropy_backward(&mut self, op: Checked<CrossEntropyBackward>);

    // ---- optimizer support ----
    /// `sum(x^2)` with a fixed reduction order; non-finite inputs give a non-finite result.
    fn sum_squares(&mut self, x: View) -> Result<f64>;
    /// `x *= s`.
    fn scale(&mut self, x: View, s: f32);
    /// One AdamW step (torch.optim.AdamW semantics).
    fn adamw(&mut self, op: Checked<AdamWUpdate>);
    /// Checks, before any work, that training steps of `shape` stay within what this backend can compute,
    /// so that a limit gives a clear error at start ([`BackendError::ShapeUnsupported`]) instead of a
    /// failure mid-step. The default accepts every shape.
    fn check_step_shape(&self, shape: StepShape) -> Result<()> {
        let _ = shape;
        Ok(())
    }

    // ---- fused ops: the defaults run the ops above in sequence; a backend overrides one to save passes over
    // memory, with the same results ----
    /// [`MatmulGeluForward`]: the default runs [`Backend::matmul_forward`] then [`Backend::gelu_forward`].
    fn matmul_gelu_forward(&mut self, op: Checked<MatmulGeluForward>) {
        let MatmulGeluForward {
            pre,
            out,
            inp,
            weight,
            bias,
            shape,
        } = *op;
        self.matmul_forward(
            MatmulForward {
                out: pre,
                inp,
                weight,
                bias: Some(bias),
                shape,
            }
            .checked(),
        );
        self.gelu_forward(GeluForward { out, inp: pre }.checked());
    }

    /// [`AddLayerNormForward`]: the default runs [`Backend::add_inplace`] then [`Backend::layernorm_forward`].
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
        self.add_inplace(
            AddInplace {
                dst: residual,
                src: skip,
            }
            .checked(),
        );
        let inp = residual;
        self.layernorm_forward(
            LayerNormForward {
                out,
                mean,
                rstd,
                inp,
                weight,
                bias,
                shape,
            }
            .checked(),
        );
    }

    /// [`CrossEntropyForwardBackward`]: the default runs [`Backend::crossentropy_forward`] then
    /// [`Backend::crossentropy_backward`] in place.
    fn crossentropy_forward_backward(&mut self, op: Checked<CrossEntropyForwardBackward>) {
        let CrossEntropyForwardBackward {
            losses,
            logits,
            targets,
            shape,
            dloss,
        } = *op;
        self.crossentropy_forward(
            CrossEntropyForward {
                losses,
                logits,
                targets,
                shape,
            }
            .checked(),
        );
        let dlogits = logits;
        self.crossentropy_backward(
            CrossEntropyBackward {
                dlogits,
                logits,
                targets,
                shape,
                dloss,
            }
            .checked(),
        );
    }

    /// Starts reading `src` back into `host` (resized to `src.len`), ordered after every op recorded so far
    /// but without waiting for them or for what is recorded later: the gradient sync reads a finished
    /// bucket while backward goes on. The default copies at once, which is what a synchronous backend wants.
    fn begin_download(&mut self, src: View, mut host: Vec<f32>) -> Result<Download> {
        host.resize(src.len, 0.0);
        self.download(src, &mut host)?;
        Ok(Download::Ready(host))
    }

    /// Whether `download` has arrived, without blocking.
    fn download_ready(&mut self, download: &Download) -> Result<bool> {
        Ok(matches!(download, Download::Ready(_)))
    }

    /// The values of a read-back begun by [`Backend::begin_download`], waiting for them if needed.
    fn finish_download(&mut self, download: Download) -> Result<Vec<f32>> {
        match download {
            Download::Ready(host) => Ok(host),
            Download::InFlight { ticket, .. } => Err(BackendError::InvalidView(format!(
                "{}: read-back #{ticket} was not begun by this backend",
                self.name()
            ))
            .into()),
        }
    }

    /// Where this backend's buffers live and how much room is left there, for the memory plan.
    fn memory(&self) -> BackendMemory {
        BackendMemory::Device { available: None }
    }

    /// How the matmuls multiply from now on. Every backend computes in fp32; only CUDA offers TF32 (its
    /// tensor cores, through cuBLAS), and the others refuse it by name.
    fn set_matmul_precision(&mut self, precision: MatmulPrecision) -> Result<()> {
        match precision {
            MatmulPrecision::Fp32 => Ok(()),
            MatmulPrecision::Tf32 => anyhow::bail!(
                "--matmul-precision tf32 needs the cuda backend: {} multiplies in fp32 only",
                self.name()
            ),
        }
    }

    /// Waits for queued work, then returns the first error recorded since the last synchronisation point
    /// (see the module doc); a no-op on synchronous backends.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt2(batch: usize, seq_len: usize) -> StepShape {
        StepShape {
            batch,
            seq_len,
            width: 768,
            heads: 12,
            vocab: 50257,
        }
    }

    /// The logits `[b * t, 50257]` reach 2^32 elements first at GPT-2's width: from about 85,400 tokens per
    /// micro-batch, refused by name before any work; 8 x 1024 is far below.
    #[test]
    fn the_up_front_check_names_the_logits_past_32_bit_indices() {
        let limit = u32::MAX as usize;
        let flash = AttentionSaving::RowLogSumExp;
        assert!(gpt2(8, 1024).past_index_limit(limit, 32, flash).is_none());
        assert!(gpt2(83, 1024).past_index_limit(limit, 32, flash).is_none());
        let err = gpt2(84, 1024)
            .past_index_limit(limit, 32, flash)
            .expect("84 x 1024 x 50257 > 2^32");
        let BackendError::ShapeUnsupported { op, detail } = err else {
            panic!("{err}")
        };
        assert_eq!(op, "the logits");
        assert!(
            detail.contains("4322906112 elements") && !detail.contains("--"),
            "{detail}"
        );
        // Long sequences reach the probabilities [b, nh, t, t] first where they are kept; the flash kernels
        // keep [b, nh, t].
        let probabilities = AttentionSaving::Probabilities;
        let long = gpt2(1, 20_000).past_index_limit(limit, 32, probabilities).unwrap();
        assert!(
            matches!(long, BackendError::ShapeUnsupported { ref op, .. } if op == "attention"),
            "{long}"
        );
        assert!(gpt2(1, 20_000).past_index_limit(limit, 32, flash).is_none());
    }
}
