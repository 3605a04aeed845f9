//! The wgpu backend: every op of [`Backend`] as a WGSL compute shader (Vulkan, Metal, DX12).
//!
//! Where each part lives:
//! - `context.rs`: instance, adapters and device, built once; the device gets every limit the adapter offers.
//! - `kernels.rs`: the kernel table (one WGSL file per op family, `common.wgsl` prepended) and the compute
//!   pipelines, compiled once at construction.
//! - `params.rs`: the uniform parameters of each kernel.
//! - `binding.rs`: the bind-group cache and the ring of uniform parameter slots.
//! - `memory.rs`: allocations (and freeing them), segments, transfers, and the buffers the backend keeps.
//! - `windows.rs`: how a view is bound (a window of its buffer), and how much one window holds.
//! - `submit.rs`: recording dispatches, submitting batches, waiting and reading back.
//! - `readback.rs`: early read-backs (`begin_download`), their tickets and the pool of staging buffers.
//! - `device_errors.rs`: device failures, recorded as they happen and returned at the next
//!   synchronisation point.
//! - `matmul.rs`: matmul planning (kernel choice, splitting).
//! - `ops.rs`: the ops of [`Backend`].
//! - `software/`: everything that exists only for software adapters (llvmpipe): the row kernels, the
//!   texture-fed matmuls and the loop-budget checks. A reader of the hardware path can skip it.
//!
//! Environment: `RINGTRAIN_WGPU_HARDWARE_KERNELS=1` ([`HARDWARE_KERNELS_ENV`]), read once by
//! [`WgpuBackend::new`], makes a software adapter run exactly the kernels a hardware adapter runs (no row
//! kernels, no texture-fed matmuls), so that CI covers the hardware path on lavapipe.
//!
//! Design points shared by all of them:
//! - **Bind groups.** Built once and cached, keyed by the layout (one per number of storage bindings) and
//!   each storage window's (buffer id, start, size). Buffer ids come from a counter, never reused. The
//!   uniform parameters are not in the key: they live in one ring buffer bound at a dynamic offset. Why: the
//!   AdamW scalars (`step_size`, bias correction, scheduled `lr`) change every step, so a key holding the
//!   parameter words would miss once per parameter tensor per step and keep growing; with the ring, every
//!   dispatch of a repeated step hits, and no buffer is created per dispatch. Windows over temporary
//!   buffers (gathered straddling views) bypass the cache: their buffer is new every call, so an entry
//!   could never hit again. A freed allocation, and the buffers the backend replaces when they grow (the
//!   `sum_squares` scratch, the embedding backward's index), drop their entries, so none can go stale or
//!   keep a freed buffer's memory alive. Past 4096 entries the cache is cleared, so changing shapes cannot
//!   grow it without bound.
//! - **Kernel shapes.** Tuned for CPU implementations (lavapipe), where each storage access is a
//!   per-invocation scalar access and barriers are costly, while staying plain WGSL for GPUs (see
//!   `matmul.rs`). Element-wise residual/add/scale/fill/copy run on `vec4` bindings when every view starts
//!   at a multiple of 4 elements (`residual4.wgsl`), the last `len % 4` elements on the scalar kernels.
//! - **Memory.** Allocations past one buffer are split into segments, and ops whose windows would exceed
//!   a storage binding split their work (`memory.rs`, `ops.rs`). So GPT-2's 154 MB `wte` inside the 500 MB
//!   flat parameter buffer works on adapters with a 128 MiB binding limit (lavapipe's), and activation
//!   buffers may exceed one buffer.
//! - **Determinism.** No atomics; every output is written by one invocation summing in a fixed order, and
//!   reductions use fixed trees. The token embedding's backward groups positions by token on the host (the
//!   backend keeps a host copy of every token buffer, which only `upload_tokens` writes) and sums each
//!   token's positions in `(b, t)` order on the device, as the CPU specification does.

mod binding;
mod context;
mod device_errors;
mod kernels;
mod loop_budget;
mod matmul;
mod memory;
mod ops;
mod params;
mod readback;
mod software;
mod submit;
#[cfg(test)]
mod tests;
mod windows;

pub use binding::BindGroupStats;
pub use context::{list_adapters, AdapterKind, AdapterReport, AdapterSelection};
pub use software::HARDWARE_KERNELS_ENV;

use super::{Backend, BackendError, Download, MatmulShape, TokenView, View, WeightLayout};
use anyhow::Result;
use binding::{BindGroupCache, BufferIds, UniformRing, MAX_CACHED_BIND_GROUPS};
use context::Context;
use device_errors::DeviceErrors;
use kernels::Kernel;
use memory::{Alloc, EmbedIndex, TokenBuffer, Tracked};
use readback::Readbacks;
use software::SoftwareKernels;
use std::collections::HashMap;

/// Largest wgpu buffer the backend creates, whatever `max_buffer_size` says: Vulkan only guarantees
/// allocations of 1 GiB (`maxMemoryAllocationSize`), and some drivers report a larger `max_buffer_size` than
/// one allocation can hold. Larger tensors are split into segments of this size.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 30;

/// Dispatches recorded before the encoder is submitted anyway: the number of slots of the uniform ring.
pub const MAX_PENDING: usize = 256;

/// Largest read-back staging buffer (also capped by `max_buffer_size`); bigger read-backs use several.
const MAX_STAGING_BYTES: u64 = 256 << 20;

/// sum_squares block: the CPU specification's `SUM_BLOCK`.
const SUM_BLOCK: usize = 4096;

/// A backend running every op as WGSL compute shaders on one wgpu adapter.
pub struct WgpuBackend {
    ctx: Context,
    kernels: HashMap<&'static str, Kernel>,
    /// The allocations, indexed by `View::buf`; `None` once freed (ids are never reused).
    bufs: Vec<Option<Alloc>>,
    /// Elements per segment of new allocations (what `max_buffer_size` allows, 256-byte aligned).
    seg_elems: usize,
    /// The token buffers, indexed by `TokenView::buf`; `None` once freed.
    tok_bufs: Vec<Option<TokenBuffer>>,
    /// Bound for operands a kernel does not read.
    dummy: Tracked,
    /// `sum_squares`' per-block partial sums and their number of elements, grown on demand (a call reads
    /// them back before returning, so the next call may reuse them).
    partials: Option<(Tracked, usize)>,
    /// Split-K matmuls' partial products `[splits, m, n]`, grown on demand up to
    /// [`matmul::SPLIT_K_PARTIALS_MAX`] elements (dispatches in queue order may reuse them).
    split_k: Option<(Tracked, usize)>,
    /// The embedding backward's token index (`[rows | starts | positions]`, u32), grown on demand and
    /// rewritten by each call, so its bind groups are cached like any other.
    embed_index: Option<EmbedIndex>,
    /// The kernels only software adapters use (none on hardware adapters).
    software: SoftwareKernels,
    buffer_ids: BufferIds,
    bind_groups: BindGroupCache,
    /// Parameters of the dispatches recorded since the last submit.
    uniforms: UniformRing,
    encoder: Option<wgpu::CommandEncoder>,
    /// Early read-backs in flight, by ticket, and their pool of staging buffers.
    readbacks: Readbacks,
    /// The first device error since the last synchronisation point.
    errors: DeviceErrors,
    align: u64,
    max_binding: u64,
    max_groups: u32,
    /// Bytes one staging buffer holds at most: [`MAX_STAGING_BYTES`] and what `max_buffer_size` allows.
    staging_cap: u64,
}

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl WgpuBackend {
    /// Opens the adapter chosen by `selection` and compiles every kernel. Fails with a clear message when
    /// no adapter matches or the adapter lacks what the kernels need. Reads [`HARDWARE_KERNELS_ENV`].
    pub fn new(selection: AdapterSelection) -> Result<Self> {
        let ctx = Context::new(selection)?;
        let device = &ctx.device;
        let errors = DeviceErrors::default();
        errors.install(device);
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let kernels = kernels::compile(device);
        let software = SoftwareKernels::new(&ctx, software::hardware_kernels_requested());
        if let Some(e) = pollster::block_on(scope.pop()) {
            let why = format!("compiling the WGSL kernels on {} failed: {e}", ctx.report.name);
            return Err(BackendError::Driver(why).into());
        }
        let mut buffer_ids = BufferIds::default();
        let dummy = Tracked {
            id: buffer_ids.next(),
            buffer: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("dummy"),
                size: 256,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            }),
        };
        let uniform_alignment = ctx.limits.min_uniform_buffer_offset_alignment as u64;
        let uniforms = UniformRing::new(device, uniform_alignment, MAX_PENDING);
        let align = ctx.limits.min_storage_buffer_offset_alignment as u64;
        let seg_elems = (ctx.limits.max_buffer_size.min(MAX_SEGMENT_BYTES) / 4) as usize / 64 * 64;
        let max_binding = ctx.limits.max_storage_buffer_binding_size.min(seg_elems as u64 * 4) / 4 * 4;
        let max_groups = ctx.limits.max_compute_workgroups_per_dimension;
        let staging_cap = ctx.limits.max_buffer_size.min(MAX_STAGING_BYTES) / 4 * 4;
        Ok(WgpuBackend {
            ctx,
            kernels,
            bufs: Vec::new(),
            seg_elems,
            tok_bufs: Vec::new(),
            dummy,
            partials: None,
            split_k: None,
            embed_index: None,
            software,
            buffer_ids,
            bind_groups: BindGroupCache::new(MAX_CACHED_BIND_GROUPS),
            uniforms,
            encoder: None,
            readbacks: Readbacks::default(),
            errors,
            align,
            max_binding,
            max_groups,
            staging_cap,
        })
    }

    /// The adapter this backend runs on.
    pub fn adapter(&self) -> &AdapterReport {
        &self.ctx.report
    }

    /// Caps the storage binding size used for windows (never above the adapter's limit). Tests use it to
    /// exercise the splitting paths of large tensors with small ones.
    pub fn set_max_binding_bytes(&mut self, bytes: u64) {
        let cap = self
            .ctx
            .limits
            .max_storage_buffer_binding_size
            .min(self.seg_elems as u64 * 4);
        self.max_binding = bytes.clamp(4 * SUM_BLOCK as u64 + self.align, cap) / 4 * 4;
    }

    /// Caps the size of one wgpu buffer for allocations made from now on (never above the adapter's
    /// `max_buffer_size`); larger allocations are split into segments. Tests use it to exercise views that
    /// straddle segments. Also caps the binding size to one segment.
    pub fn set_max_buffer_bytes(&mut self, bytes: u64) {
        // At least one `sum_squares` block must fit a window wherever it starts, even after rounding the
        // segment down to 64 elements (256 bytes); a smaller window would split element-wise ops into
        // empty pieces forever.
        let min = 4 * SUM_BLOCK as u64 + 2 * self.align + 256;
        let bytes = bytes.clamp(min, self.ctx.limits.max_buffer_size.min(MAX_SEGMENT_BYTES));
        self.seg_elems = (bytes / 4) as usize / 64 * 64;
        self.max_binding = self.max_binding.min(self.seg_elems as u64 * 4);
    }

    /// Caps the size of one staging buffer (at least 4 bytes), so that tests read back in several rounds
    /// without 256 MiB views.
    #[cfg(test)]
    pub(super) fn set_max_staging_bytes(&mut self, bytes: u64) {
        let max = self.ctx.limits.max_buffer_size.min(MAX_STAGING_BYTES);
        self.staging_cap = bytes.clamp(4, max) / 4 * 4;
    }
}
