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

mod boxed;
pub mod conformance;
pub mod cpu;
pub mod cuda;
mod error;
pub mod factory;
pub mod matmul_bench;
pub mod testing;
mod view;
pub mod wgpu;

pub use error::BackendError;
pub use view::{TokenView, View};

use anyhow::Result;

/// How a matmul weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[in, out]`: Hugging Face `Conv1D` layout, `out = inp @ w`.
    InOut,
    /// `[out, in]`: the tied LM head reads `wte` `[V, C]` this way, `out = inp @ w^T`.
    OutIn,
}

/// Shape of a matmul: `inp [n, c] -> out [n, oc]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub n: usize,
    pub c: usize,
    pub oc: usize,
    pub layout: WeightLayout,
}

/// Shape of causal self-attention over a `[b, t, c]` activation with `nh` heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

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
    /// `dst = src` (same length, no overlap).
    fn copy(&mut self, dst: View, src: View);

    // ---- forward/backward ops ----
    /// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]`.
    /// Shapes: out `[b*t, c]`, tokens `[b*t]`, wte `[v, c]`, wpe `[>=t, c]`.
    #[allow(clippy::too_many_arguments)]
    fn encoder_forward(&mut self, out: View, tokens: TokenView, wte: View, wpe: View, b: usize, t: usize, c: usize);
    /// `dwte[tokens[b,t],:] += dout[b,t,:]`, `dwpe[t,:] += dout[b,t,:]`.
    #[allow(clippy::too_many_arguments)]
    fn encoder_backward(&mut self, dwte: View, dwpe: View, dout: View, tokens: TokenView, b: usize, t: usize, c: usize);
    /// Layer norm over the last axis, eps 1e-5. Shapes: out/inp `[n, c]`, mean/rstd `[n]`, weight/bias `[c]`.
    #[allow(clippy::too_many_arguments)]
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
    );
    /// Accumulates into `dinp`, `dweight` and `dbias`.
    #[allow(clippy::too_many_arguments)]
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
    );
    /// `out = inp @ W (+ bias)`. Shapes: out `[n, oc]`, inp `[n, c]`, weight per `shape.layout`, bias `[oc]`.
    fn matmul_forward(&mut self, out: View, inp: View, weight: View, bias: Option<View>, shape: MatmulShape);
    /// Overwrites `dinp`; accumulates into `dweight` and `dbias`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &mut self,
        dinp: View,
        dweight: View,
        dbias: Option<View>,
        dout: View,
        inp: View,
        weight: View,
        shape: MatmulShape,
    );
    /// Causal multi-head attention. Shapes: out `[b, t, c]`, att `[b, nh, t, t]` (softmax probabilities,
    /// kept for backward; entries above the diagonal are 0), qkv `[b, t, 3c]` laid out as q | k | v.
    fn attention_forward(&mut self, out: View, att: View, qkv: View, shape: AttentionShape);
    /// Overwrites `dqkv`; `datt` `[b, nh, t, t]` is scratch.
    fn attention_backward(&mut self, dqkv: View, datt: View, dout: View, qkv: View, att: View, shape: AttentionShape);
    /// GELU, tanh approximation (`gelu_new`). Shapes: out/inp `[n]`.
    fn gelu_forward(&mut self, out: View, inp: View);
    /// Overwrites `dinp`.
    fn gelu_backward(&mut self, dinp: View, inp: View, dout: View);
    /// `out = a + b`.
    fn residual_forward(&mut self, out: View, a: View, b: View);
    /// `dst += src`.
    fn add_inplace(&mut self, dst: View, src: View);
    /// Per-position cross-entropy of `softmax(logits)` against `targets`.
    /// Shapes: losses `[n]`, logits `[n, v]`, targets `[n]`.
    fn crossentropy_forward(&mut self, losses: View, logits: View, targets: TokenView, n: usize, v: usize);
    /// `dlogits = dloss * (softmax(logits) - onehot(targets))`; `dlogits` may be the same view as `logits`.
    fn crossentropy_backward(
        &mut self,
        dlogits: View,
        logits: View,
        targets: TokenView,
        n: usize,
        v: usize,
        dloss: f32,
    );

    // ---- optimizer support ----
    /// `sum(x^2)` with a fixed reduction order; non-finite inputs give a non-finite result.
    fn sum_squares(&mut self, x: View) -> Result<f64>;
    /// `x *= s`.
    fn scale(&mut self, x: View, s: f32);
    /// One AdamW step (torch.optim.AdamW semantics) over equally long views.
    fn adamw(&mut self, params: View, grads: View, m: View, v: View, step: &AdamWStep);
    /// Checks, before any work, that training steps on `b` sequences of `t` tokens of a model `c` wide with
    /// `nh` heads stay within what this backend can compute, so that a limit gives a clear error at start
    /// ([`BackendError::ShapeUnsupported`]) instead of a failure mid-step. The default accepts every shape.
    fn check_step_shape(&self, b: usize, t: usize, c: usize, nh: usize) -> Result<()> {
        let _ = (b, t, c, nh);
        Ok(())
    }

    // ---- fused ops: the defaults run the ops above in sequence; a backend overrides one to save passes over
    // memory, with the same results ----
    /// `pre = inp @ W + bias`, then `out = gelu(pre)` (the MLP's first layer and its activation): the same
    /// as [`Backend::matmul_forward`] then [`Backend::gelu_forward`].
    /// Shapes: pre, out `[n, oc]`, inp `[n, c]`, weight per `shape.layout`, bias `[oc]`.
    fn matmul_gelu_forward(&mut self, pre: View, out: View, inp: View, weight: View, bias: View, shape: MatmulShape) {
        self.matmul_forward(pre, inp, weight, Some(bias), shape);
        self.gelu_forward(out, pre);
    }

    /// `residual += skip`, then the layer norm of the new `residual` into `out`, saving mean and 1/std: the
    /// same as [`Backend::add_inplace`] then [`Backend::layernorm_forward`].
    /// Shapes: residual, skip, out `[n, c]`, mean, rstd `[n]`, w, b `[c]`.
    #[allow(clippy::too_many_arguments)]
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
        self.add_inplace(residual, skip);
        self.layernorm_forward(out, mean, rstd, residual, w, b, n, c);
    }

    /// The per-position losses, then `logits` replaced in place by their gradient `dloss * (softmax -
    /// onehot(targets))`: the same as [`Backend::crossentropy_forward`] then
    /// [`Backend::crossentropy_backward`] in place. Shapes: losses `[n]`, logits `[n, v]`, targets `[n]`.
    fn crossentropy_forward_backward(
        &mut self,
        losses: View,
        logits: View,
        targets: TokenView,
        n: usize,
        v: usize,
        dloss: f32,
    ) {
        self.crossentropy_forward(losses, logits, targets, n, v);
        self.crossentropy_backward(logits, logits, targets, n, v, dloss);
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

    /// Waits for queued work, then returns the first error recorded since the last synchronisation point
    /// (see the module doc); a no-op on synchronous backends.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}
