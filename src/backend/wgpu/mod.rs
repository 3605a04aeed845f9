//! The wgpu backend: every op of [`Backend`] as a WGSL compute shader (Vulkan, Metal, DX12).
//!
//! - **Context.** Instance, adapter, device and queue are built once (module `context`); the device gets every
//!   limit the adapter offers.
//! - **Pipelines.** One compute pipeline per kernel, compiled once at construction from `shaders/*.wgsl`
//!   (one file per op family, `common.wgsl` prepended). The kernel stem is the WGSL entry point and the
//!   Rust method name; ops needing several passes add suffixed kernels (`attention_backward_dq`, ...).
//! - **Bind groups.** Built once and cached (module `binding`), keyed by the layout (one per number of
//!   storage bindings) and each storage window's (buffer id, start, size). Buffer ids come from a counter,
//!   never reused. The uniform parameters are not in the key: they live in one ring buffer bound at a
//!   dynamic offset. Why: the AdamW scalars (`step_size`, bias correction, scheduled `lr`) change every step,
//!   so a key holding the parameter words would miss once per parameter tensor per step and keep growing;
//!   with the ring, every dispatch of a repeated step hits, and no buffer is created per dispatch. Windows
//!   over temporary buffers (gathered straddling views) bypass the cache: their buffer is new every call,
//!   so an entry could never hit again. Allocations are never freed (the `Backend` trait has no `free`), so
//!   entries cannot go stale; the buffers the backend does replace when they grow (the `sum_squares`
//!   scratch, the embedding backward's index) drop their entries. Past 4096 entries the cache is
//!   cleared, so changing shapes cannot grow it without bound.
//! - **Kernel shapes.** Tuned for CPU implementations (lavapipe), where each storage access is a
//!   per-invocation scalar access and barriers are costly, while staying plain WGSL for GPUs: the matmuls keep
//!   a large register block per invocation and read A and B straight from storage (no workgroup memory, no
//!   barriers); row-major operands with 4-aligned offsets, strides, `n` and `k` take the `vec4` kernel
//!   (`matmul4.wgsl`), everything else the strided one. On software adapters with 8-lane subgroups the
//!   `vec4` case, when both operands' rows are a multiple of 256 bytes apart, first copies A and B into
//!   read-only rgba32f storage textures and runs `matmul4t.wgsl`, which reads them with image loads (one
//!   load per lane, where storage-buffer loads cost llvmpipe a branchy loop over the lanes) and shares each row of A across a
//!   subgroup with a broadcast (`tex_matmul.rs`). Element-wise residual/add/scale/fill/copy run on
//!   `vec4` bindings when every view starts at a multiple of 4 elements (`residual4.wgsl`), the last `len % 4`
//!   elements on the scalar kernels.
//! - **Memory.** An allocation is one storage buffer, or, past the adapter's `max_buffer_size` (capped at
//!   [`MAX_SEGMENT_BYTES`]), several *segments* of at most that size. A [`View`] is bound as a *window* of
//!   its segment: the binding starts at the view's offset rounded down to
//!   `min_storage_buffer_offset_alignment`, and the remaining element offset travels in the kernel's
//!   uniform parameters. A window that straddles two segments (rare: the views that cross a segment
//!   boundary) is gathered into a temporary buffer before the dispatch and written back after it. Ops whose
//!   windows would exceed `max_storage_buffer_binding_size` are split: element-wise ops, AdamW and
//!   `sum_squares` by ranges, matmuls by halving M, N or K, the encoder by vocabulary rows, cross-entropy by
//!   rows, attention by sequence. So GPT-2's 154 MB `wte` inside the 500 MB flat parameter buffer works on
//!   adapters with a 128 MiB binding limit (lavapipe's), and activation buffers may exceed one buffer.
//!   Limits that remain: one cross-entropy row (`V` floats), one layer-norm `[n, c]` tensor and one
//!   sequence's attention `[nh, t, t]` must each fit a binding.
//! - **Submission.** Ops are recorded into one command encoder and submitted in batches: on `download`,
//!   `sum_squares`, `synchronize`, before an upload (so the upload lands after the ops recorded before it),
//!   and every [`MAX_PENDING`] dispatches. Only `download` and `sum_squares` read back. Each dispatch stages
//!   its parameters in the next slot of the uniform ring; the batch's slots are written with one
//!   `write_buffer` just before its submit (wgpu runs it after the earlier submits, so the next batch
//!   reuses the ring from slot 0).
//! - **Determinism.** No atomics; every output is written by one invocation summing in a fixed order, and
//!   reductions use fixed trees. The token embedding's backward groups positions by token on the host (the
//!   backend keeps a host copy of every token buffer, which only `upload_tokens` writes) and sums each
//!   token's positions in `(b, t)` order on the device, as the CPU specification does.

mod binding;
mod context;
#[cfg(test)]
mod tests;
mod tex_matmul;

pub use binding::BindGroupStats;
pub use context::{list_adapters, AdapterKind, AdapterReport, AdapterSelection};

use super::{AdamWStep, AttentionShape, Backend, MatmulShape, TokenView, View, WeightLayout};
use anyhow::{anyhow, bail, ensure, Result};
use binding::{BindGroupCache, BindKey, BufferId, BufferIds, UniformRing, WindowKey, MAX_CACHED_BIND_GROUPS};
use context::Context;
use std::collections::HashMap;
use std::num::NonZeroU64;
use std::time::Instant;

/// Largest wgpu buffer the backend creates, whatever `max_buffer_size` says: Vulkan only guarantees
/// allocations of 1 GiB (`maxMemoryAllocationSize`), and some drivers report a larger `max_buffer_size` than
/// one allocation can hold. Larger tensors are split into segments of this size.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 30;

/// Dispatches recorded before the encoder is submitted anyway: the number of slots of the uniform ring.
pub const MAX_PENDING: usize = 256;

const WG: u32 = 256;
/// C tile of one matmul workgroup (`TM` x `TN` of matmul.wgsl).
const MATMUL_TILE_M: usize = 128;
const MATMUL_TILE_N: usize = 128;
/// C tile of one workgroup of the vec4 matmul (matmul4.wgsl).
const MATMUL4_TILE_M: usize = 128;
const MATMUL4_TILE_N: usize = 128;
/// `VPI` of residual4.wgsl: vec4s per invocation of the vec4 element-wise kernels.
const VEC4_PER_INVOCATION: usize = 16;
/// sum_squares block: the CPU specification's `SUM_BLOCK`.
const SUM_BLOCK: usize = 4096;

const COMMON: &str = include_str!("../../../shaders/common.wgsl");

/// llvmpipe (lavapipe) ends a shader invocation's loops once they have run this many iterations in all
/// (its guard against endless shaders) and silently leaves the rest of the work undone; measured on Mesa
/// 22.3 with two loops in a row, whose iterations count against one budget. On software adapters, kernels
/// whose loops would run longer take another kernel, or the op refuses with a message that says so.
const SOFTWARE_LOOP_BUDGET: usize = 65535;

/// One op family: (name, WGSL source, [(entry point, number of storage bindings)]).
type Family = (&'static str, &'static str, &'static [(&'static str, u32)]);

const FAMILIES: &[Family] = &[
    (
        "encoder",
        include_str!("../../../shaders/encoder.wgsl"),
        &[
            ("encoder_forward", 4),
            ("encoder_backward_wpe", 2),
            ("encoder_backward_wte", 4),
        ],
    ),
    (
        "layernorm",
        include_str!("../../../shaders/layernorm.wgsl"),
        &[
            ("layernorm_forward", 6),
            ("layernorm_backward", 7),
            ("layernorm_backward_params", 8),
            ("layernorm_forward_rows", 6),
            ("layernorm_backward_rows", 7),
            ("layernorm_backward_params_cols", 8),
        ],
    ),
    (
        "matmul",
        include_str!("../../../shaders/matmul.wgsl"),
        &[("matmul", 4), ("matmul_backward_bias", 2)],
    ),
    (
        "matmul4",
        concat!(
            include_str!("../../../shaders/matmul4_shared.wgsl"),
            include_str!("../../../shaders/matmul4.wgsl")
        ),
        &[("matmul4", 4)],
    ),
    (
        "attention",
        include_str!("../../../shaders/attention.wgsl"),
        &[
            ("attention_forward", 3),
            ("attention_forward_out", 3),
            ("attention_backward", 5),
            ("attention_backward_dq", 4),
            ("attention_backward_dkv", 5),
        ],
    ),
    (
        "gelu",
        include_str!("../../../shaders/gelu.wgsl"),
        &[("gelu_forward", 2), ("gelu_backward", 3)],
    ),
    (
        "residual",
        include_str!("../../../shaders/residual.wgsl"),
        &[
            ("residual_forward", 3),
            ("add_inplace", 2),
            ("scale", 1),
            ("fill", 1),
            ("copy", 2),
        ],
    ),
    (
        "residual4",
        include_str!("../../../shaders/residual4.wgsl"),
        &[
            ("residual_forward4", 3),
            ("add_inplace4", 2),
            ("scale4", 1),
            ("fill4", 1),
            ("copy4", 2),
        ],
    ),
    (
        "crossentropy",
        include_str!("../../../shaders/crossentropy.wgsl"),
        &[
            ("crossentropy_forward", 3),
            ("crossentropy_backward", 3),
            ("crossentropy_forward_rows", 3),
            ("crossentropy_backward_rows", 3),
        ],
    ),
    ("adamw", include_str!("../../../shaders/adamw.wgsl"), &[("adamw", 4)]),
    (
        "reduce",
        include_str!("../../../shaders/reduce.wgsl"),
        &[("sum_squares", 2)],
    ),
];

struct Kernel {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    bindings: u32,
}

/// A buffer the backend keeps, with the identity the bind-group cache knows it by.
#[derive(Clone)]
struct Tracked {
    id: BufferId,
    buffer: wgpu::Buffer,
}

/// The persistent index buffer of `encoder_backward`.
struct EmbedIndex {
    buf: Tracked,
    /// Capacity in u32 elements; the whole of it is bound, so the window (and bind group) never changes.
    cap: usize,
    /// A dispatch recorded since the last submit reads it: the next rewrite must submit first, because a
    /// `write_buffer` lands before every command of the next submit.
    read_by_pending: bool,
}

/// A bound range of a buffer: `size` bytes from byte `start`; the view begins `off` elements into it.
/// `id` is `None` for a temporary buffer, whose bind groups are not cached.
/// `scatter` is set when the range straddles segments of an allocation and `buffer` is a temporary copy of
/// elements `[first, end)` of allocation `buf`: the copy is written back after each dispatch that binds it.
#[derive(Clone)]
struct Win {
    buffer: wgpu::Buffer,
    id: Option<BufferId>,
    start: u64,
    size: u64,
    off: u32,
    scatter: Option<(usize, usize, usize)>,
}

/// One allocation: segment `i` holds elements `[i * seg, min((i + 1) * seg, len))`.
struct Alloc {
    segs: Vec<Tracked>,
    seg: usize,
    len: usize,
}

impl Alloc {
    /// The pieces of `[first, end)`: (segment, element offset in the segment, offset in the range, length).
    fn parts(&self, first: usize, end: usize) -> Vec<(usize, usize, usize, usize)> {
        let mut out = Vec::new();
        let mut at = first;
        while at < end {
            let s = at / self.seg;
            let stop = end.min((s + 1) * self.seg);
            out.push((s, at - s * self.seg, at - first, stop - at));
            at = stop;
        }
        out
    }

    fn seg_len(&self, s: usize) -> usize {
        self.seg.min(self.len - s * self.seg)
    }
}

/// A bind group of `layout`: the uniform ring's slot, then `wins` in binding order.
fn make_bind_group(
    device: &wgpu::Device,
    layout: &wgpu::BindGroupLayout,
    uniforms: &UniformRing,
    wins: &[Win],
) -> wgpu::BindGroup {
    let mut entries = vec![wgpu::BindGroupEntry {
        binding: 0,
        resource: uniforms.binding(),
    }];
    for (i, w) in wins.iter().enumerate() {
        entries.push(wgpu::BindGroupEntry {
            binding: i as u32 + 1,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &w.buffer,
                offset: w.start,
                size: NonZeroU64::new(w.size),
            }),
        });
    }
    device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout,
        entries: &entries,
    })
}

/// Uniform parameters: up to 16 scalar words, in the order of the kernel's `Params` struct.
#[derive(Clone, Default)]
struct Params(Vec<u32>);

impl Params {
    fn u(mut self, x: impl TryInto<u32>) -> Self {
        self.0.push(
            x.try_into()
                .unwrap_or_else(|_| panic!("kernel parameter does not fit in u32")),
        );
        self
    }
    fn f(mut self, x: f32) -> Self {
        self.0.push(x.to_bits());
        self
    }
    /// The 16 words of a uniform slot, zero-padded.
    fn words(&self, kernel: &str) -> [u32; 16] {
        assert!(self.0.len() <= 16, "kernel {kernel}: too many parameters");
        let mut words = [0; 16];
        words[..self.0.len()].copy_from_slice(&self.0);
        words
    }
}

/// For the vec4 kernels: how far apart `m`'s rows lie (row-major, `cs == 1`) or, with `transposed`, its
/// transpose's rows (`rs == 1`), when that is a multiple of 4 elements.
fn vec4_rows(m: &Mat, transposed: bool) -> Option<usize> {
    let (unit, rows) = if transposed { (m.rs, m.cs) } else { (m.cs, m.rs) };
    (unit == 1 && rows % 4 == 0).then_some(rows)
}

/// One strided matrix operand: element `(r, c)` is at `off + r * rs + c * cs` of buffer `buf`.
#[derive(Clone, Copy, Debug)]
struct Mat {
    buf: usize,
    off: usize,
    rs: usize,
    cs: usize,
}

impl Mat {
    /// `[first, end)` element range touched by a `rows x cols` block.
    fn extent(&self, rows: usize, cols: usize) -> (usize, usize) {
        if rows == 0 || cols == 0 {
            return (self.off, self.off);
        }
        (self.off, self.off + (rows - 1) * self.rs + (cols - 1) * self.cs + 1)
    }
    fn at(&self, r: usize, c: usize) -> Mat {
        Mat {
            off: self.off + r * self.rs + c * self.cs,
            ..*self
        }
    }
}

/// `C[m, n] (=|+=) A[m, k] @ B[k, n] (+ bias[n])`.
#[derive(Clone, Copy, Debug)]
struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    a: Mat,
    b: Mat,
    c: Mat,
    bias: Option<View>,
    accumulate: bool,
}

/// A backend running every op as WGSL compute shaders on one wgpu adapter.
pub struct WgpuBackend {
    ctx: Context,
    kernels: HashMap<&'static str, Kernel>,
    bufs: Vec<Alloc>,
    /// Elements per segment of new allocations (what `max_buffer_size` allows, 256-byte aligned).
    seg_elems: usize,
    tok_bufs: Vec<(Tracked, usize)>,
    /// Host copies of the token buffers (written only by `upload_tokens`), for the embedding backward.
    tok_host: Vec<Vec<u32>>,
    dummy: Tracked,
    /// `sum_squares`' per-block partial sums and their number of elements, grown on demand (a call reads
    /// them back before returning, so the next call may reuse them).
    partials: Option<(Tracked, usize)>,
    /// The embedding backward's token index (`[rows | starts | positions]`, u32), grown on demand and
    /// rewritten by each call, so its bind groups are cached like any other.
    embed_index: Option<EmbedIndex>,
    /// The texture-fed matmul, on software adapters with 8-lane subgroups only (see `tex_matmul.rs`).
    /// One kernel per `tex_matmul::Variant`: `x @ W`, `x @ W^T` (the tied LM head and every input
    /// gradient) and `X^T @ dY` (every weight gradient).
    tex_matmul: Option<[tex_matmul::TexMatmul; 3]>,
    /// Dispatches of the texture-fed matmul so far (tests check which kernel ran).
    tex_matmul_dispatches: u64,
    /// Layer norm and cross-entropy take their one-invocation-per-row kernels (`*_rows`, no barriers)
    /// instead of one workgroup per row with tree reductions: on software adapters, where a barrier
    /// costs more than the row's arithmetic.
    row_kernels: bool,
    buffer_ids: BufferIds,
    bind_groups: BindGroupCache,
    /// Parameters of the dispatches recorded since the last submit.
    uniforms: UniformRing,
    encoder: Option<wgpu::CommandEncoder>,
    align: u64,
    max_binding: u64,
    max_groups: u32,
}

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// The cache key of a bind group of the layout with `bindings` storage bindings over `wins`; `None` when a
/// window is over a temporary buffer (new every call, so an entry for it could never hit again).
fn bind_key(bindings: u32, wins: &[Win]) -> Option<BindKey> {
    let windows = wins.iter().map(window_key).collect::<Option<Vec<_>>>()?;
    Some(BindKey {
        layout: bindings,
        windows,
    })
}

/// The cache identity of a window; `None` for one over a temporary buffer.
fn window_key(w: &Win) -> Option<WindowKey> {
    Some(WindowKey {
        buffer: w.id?,
        start: w.start,
        size: w.size,
    })
}

/// Records one dispatch of `pipeline` in its own compute pass.
fn record_dispatch(
    encoder: &mut wgpu::CommandEncoder,
    pipeline: &wgpu::ComputePipeline,
    bind_group: &wgpu::BindGroup,
    uniform_offset: u32,
    groups: (u32, u32),
) {
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: None,
        timestamp_writes: None,
    });
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, bind_group, &[uniform_offset]);
    pass.dispatch_workgroups(groups.0, groups.1, 1);
}

impl WgpuBackend {
    /// Opens the adapter chosen by `selection` and compiles every kernel. Fails with a clear message when
    /// no adapter matches or the adapter lacks what the kernels need.
    pub fn new(selection: AdapterSelection) -> Result<Self> {
        let ctx = Context::new(selection)?;
        let device = &ctx.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut layouts: HashMap<u32, (wgpu::BindGroupLayout, wgpu::PipelineLayout)> = HashMap::new();
        let mut kernels = HashMap::new();
        for (family, src, entries) in FAMILIES {
            let source = format!("{COMMON}\n{src}");
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(family),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            for &(entry, bindings) in entries.iter() {
                let (bgl, pl) = layouts
                    .entry(bindings)
                    .or_insert_with(|| {
                        let mut e = vec![binding::uniform_ring_entry()];
                        e.extend((1..=bindings).map(binding::storage_entry));
                        let bgl = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                            label: None,
                            entries: &e,
                        });
                        let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                            label: None,
                            bind_group_layouts: &[Some(&bgl)],
                            immediate_size: 0,
                        });
                        (bgl, pl)
                    })
                    .clone();
                let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(entry),
                    // Every kernel writes its workgroup memory before reading it.
                    compilation_options: wgpu::PipelineCompilationOptions {
                        zero_initialize_workgroup_memory: false,
                        ..Default::default()
                    },
                    cache: None,
                });
                kernels.insert(
                    entry,
                    Kernel {
                        pipeline,
                        layout: bgl,
                        bindings,
                    },
                );
            }
        }
        let eight_lanes = Some((tex_matmul::SUBGROUP_SIZE, tex_matmul::SUBGROUP_SIZE));
        let textured = ctx.report.is_software && ctx.report.subgroup_sizes == eight_lanes;
        let tex_matmul = textured.then(|| {
            let shared = include_str!("../../../shaders/matmul4_shared.wgsl");
            let make = |v: tex_matmul::Variant| {
                let source = format!("{COMMON}\n{shared}{}", v.source());
                tex_matmul::TexMatmul::new(device, &source, v.entry(), ctx.limits.max_texture_dimension_2d)
            };
            tex_matmul::Variant::ALL.map(make)
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!("compiling the WGSL kernels on {} failed: {e}", ctx.report.name);
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
        let row_kernels = ctx.report.is_software;
        Ok(WgpuBackend {
            ctx,
            kernels,
            bufs: Vec::new(),
            seg_elems,
            tok_bufs: Vec::new(),
            tok_host: Vec::new(),
            dummy,
            partials: None,
            embed_index: None,
            tex_matmul,
            tex_matmul_dispatches: 0,
            row_kernels,
            buffer_ids,
            bind_groups: BindGroupCache::new(MAX_CACHED_BIND_GROUPS),
            uniforms,
            encoder: None,
            align,
            max_binding,
            max_groups,
        })
    }

    /// The adapter this backend runs on.
    pub fn adapter(&self) -> &AdapterReport {
        &self.ctx.report
    }

    /// Chooses the one-invocation-per-row kernels of layer norm and cross-entropy (`true`, the default on
    /// software adapters) or the workgroup-per-row ones (the default elsewhere). Tests run both on one
    /// adapter.
    pub fn set_row_kernels(&mut self, on: bool) {
        self.row_kernels = on;
    }

    /// Whether layer norm and cross-entropy take the one-invocation-per-row kernels.
    pub fn row_kernels(&self) -> bool {
        self.row_kernels
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

    /// Largest number of elements a window may cover wherever it starts.
    fn max_window_elems(&self) -> usize {
        ((self.max_binding - self.align) / 4) as usize
    }

    fn fits(&self, first: usize, end: usize) -> bool {
        let start = (first as u64 * 4) / self.align * self.align;
        (end as u64 * 4).max(start + 4) - start <= self.max_binding
    }

    /// Window over elements `[first, end)` of `buffer` (of `buf_len` elements); `id` as in [`Win`].
    fn win_of(&self, buffer: &wgpu::Buffer, id: Option<BufferId>, buf_len: usize, first: usize, end: usize) -> Win {
        assert!(end <= buf_len, "range [{first}, {end}) out of a buffer of {buf_len}");
        if first == end {
            return self.dummy_win();
        }
        let start = (first as u64 * 4) / self.align * self.align;
        let size = end as u64 * 4 - start;
        assert!(
            size <= self.max_binding,
            "a {size}-byte window exceeds the adapter's storage binding limit of {} bytes",
            self.max_binding
        );
        Win {
            buffer: buffer.clone(),
            id,
            start,
            size,
            off: ((first as u64 * 4 - start) / 4) as u32,
            scatter: None,
        }
    }

    fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        let device = &self.ctx.device;
        self.encoder
            .get_or_insert_with(|| device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }))
    }

    /// Window over elements `[first, end)` of allocation `buf`. A range straddling two segments is gathered
    /// into a temporary buffer (and written back after each dispatch that binds it).
    fn win_range(&mut self, buf: usize, first: usize, end: usize) -> Win {
        let a = &self.bufs[buf];
        assert!(end <= a.len, "range [{first}, {end}) out of an allocation of {}", a.len);
        if first == end {
            return self.dummy_win();
        }
        let (s0, s1) = (first / a.seg, (end - 1) / a.seg);
        if s0 == s1 {
            let base = s0 * a.seg;
            let (seg, seg_len) = (a.segs[s0].clone(), a.seg_len(s0));
            return self.win_of(&seg.buffer, Some(seg.id), seg_len, first - base, end - base);
        }
        let parts = a.parts(first, end);
        let segs: Vec<wgpu::Buffer> = parts.iter().map(|p| a.segs[p.0].buffer.clone()).collect();
        let len = end - first;
        assert!(
            len as u64 * 4 <= self.max_binding,
            "a {}-byte window exceeds the adapter's storage binding limit of {} bytes",
            len * 4,
            self.max_binding
        );
        let temp = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("straddling view"),
            size: len as u64 * 4,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let enc = self.encoder();
        for ((_, local, at, n), seg) in parts.iter().zip(&segs) {
            enc.copy_buffer_to_buffer(seg, *local as u64 * 4, &temp, *at as u64 * 4, *n as u64 * 4);
        }
        Win {
            buffer: temp,
            id: None,
            start: 0,
            size: len as u64 * 4,
            off: 0,
            scatter: Some((buf, first, end)),
        }
    }

    fn win(&mut self, v: View) -> Win {
        self.win_range(v.buf, v.offset, v.end())
    }

    fn twin(&self, v: TokenView) -> Win {
        let (b, len) = &self.tok_bufs[v.buf];
        self.win_of(&b.buffer, Some(b.id), *len, v.offset, v.offset + v.len)
    }

    fn dummy_win(&self) -> Win {
        Win {
            buffer: self.dummy.buffer.clone(),
            id: Some(self.dummy.id),
            start: 0,
            size: 4,
            off: 0,
            scatter: None,
        }
    }

    /// Workgroup grid for `groups` workgroups, folded into 2-D past the per-dimension limit.
    fn grid(&self, groups: usize) -> (u32, u32) {
        let max = self.max_groups as usize;
        let x = groups.clamp(1, max);
        let y = ceil_div(groups.max(1), x);
        assert!(y <= max, "dispatch of {groups} workgroups is too large");
        (x as u32, y as u32)
    }

    fn grid1d(&self, n: usize) -> (u32, u32) {
        self.grid(ceil_div(n, WG as usize))
    }

    /// Whether a kernel whose invocations run `iterations` loop iterations each computes everything on this
    /// adapter ([`SOFTWARE_LOOP_BUDGET`]).
    fn within_loop_budget(&self, iterations: usize) -> bool {
        !self.ctx.report.is_software || iterations < SOFTWARE_LOOP_BUDGET
    }

    /// Why `op`, running `iterations` loop iterations per invocation, cannot run on this adapter; `None`
    /// when it fits.
    fn loop_budget_error(&self, op: &str, iterations: usize) -> Option<String> {
        (!self.within_loop_budget(iterations)).then(|| {
            format!(
                "{op} needs {iterations} loop iterations per shader invocation, and {} stops a shader's loops \
                 after {SOFTWARE_LOOP_BUDGET}; use --backend cpu for this shape",
                self.ctx.report.name
            )
        })
    }

    /// Panics with an explanation when a kernel's `iterations` per invocation exceed this adapter's loop
    /// budget, instead of returning partial results (`check_step_shape` refuses a training run's shapes
    /// with an error before this can happen).
    fn require_loop_budget(&self, op: &str, iterations: usize) {
        if let Some(why) = self.loop_budget_error(op, iterations) {
            panic!("{why}");
        }
    }

    /// Attention's loop iterations per invocation for rows of `t` and heads `hs` wide: t dot products of
    /// hs / 4 steps (and hs % 4), then three passes over t.
    fn attention_iterations(t: usize, hs: usize) -> usize {
        t * (hs / 4 + hs % 4 + 1) + 3 * t
    }

    /// A matmul's loop iterations per invocation over `k` terms: k steps (k / 4 for the vec4 and
    /// texture-fed kernels), then 4 per store of the block's 64 accumulators.
    fn matmul_iterations(k: usize, vec4: bool) -> usize {
        (if vec4 { k / 4 } else { k }) + 256
    }

    /// A tree reduction's loop iterations per invocation: `passes` strided loops over `len` elements
    /// (`stride` apart per invocation), then `trees` reductions of `levels` levels each.
    fn tree_iterations(len: usize, stride: usize, passes: usize, trees: usize, levels: usize) -> usize {
        passes * ceil_div(len, stride) + trees * levels
    }

    /// Loop iterations per invocation of the column-sum kernels (layer-norm parameter gradients, matmul bias
    /// gradient) over `rows` rows: each of 16 lanes per column sums every 16th row, then a 4-level tree
    /// (counted as 8).
    fn column_sum_iterations(rows: usize) -> usize {
        Self::tree_iterations(rows, 16, 1, 1, 8)
    }

    /// Kernel and grid of a reduction over `n` rows (or columns): `serial`, one invocation each running
    /// `serial_iterations` loop iterations, when [`Self::set_row_kernels`] is on and the loop budget allows
    /// it, else `tree`, one workgroup per `per_group` of them, whose invocations run `tree_iterations`
    /// (refused past the budget like any kernel).
    fn per_row(
        &self,
        (tree, per_group, tree_iterations): (&'static str, usize, usize),
        (serial, serial_iterations): (&'static str, usize),
        n: usize,
    ) -> (&'static str, (u32, u32)) {
        if self.row_kernels && self.within_loop_budget(serial_iterations) {
            return (serial, self.grid1d(n));
        }
        self.require_loop_budget(tree, tree_iterations);
        (tree, self.grid(ceil_div(n, per_group)))
    }

    fn dispatch(&mut self, kernel: &str, wins: &[Win], params: Params, groups: (u32, u32)) {
        let bindings = self.kernels[kernel].bindings;
        assert_eq!(wins.len() as u32, bindings, "kernel {kernel} binds {bindings} buffers");
        let uniform_offset = self.uniforms.push(&params.words(kernel));
        let bind_group = self.bind_group(kernel, wins);
        let device = &self.ctx.device;
        let encoder = self
            .encoder
            .get_or_insert_with(|| device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }));
        record_dispatch(
            encoder,
            &self.kernels[kernel].pipeline,
            &bind_group,
            uniform_offset,
            groups,
        );
        self.finish_dispatch(wins);
    }

    /// After a dispatch: writes straddling windows back to their segments, and submits when the uniform ring
    /// is full.
    fn finish_dispatch(&mut self, wins: &[Win]) {
        let encoder = self.encoder.as_mut().expect("a dispatch was just recorded");
        for w in wins {
            if let Some((buf, first, end)) = w.scatter {
                let a = &self.bufs[buf];
                for (s, local, at, n) in a.parts(first, end) {
                    let seg = &a.segs[s].buffer;
                    encoder.copy_buffer_to_buffer(&w.buffer, at as u64 * 4, seg, local as u64 * 4, n as u64 * 4);
                }
            }
        }
        if self.uniforms.is_full() {
            self.flush();
        }
    }

    /// The vec4 matmul with A and B copied into textures, when this backend has it (software adapters with
    /// 8-lane subgroups) and both operands can be copied (`TexMatmul::fits`). `variant` says which
    /// operand is given as the row-major transpose (`g.b.rs == 1` or `g.a.rs == 1`). Returns false,
    /// recording nothing, otherwise.
    fn try_tex_matmul(&mut self, g: &Gemm, wins: [&Win; 4], params: Params, variant: tex_matmul::Variant) -> bool {
        use tex_matmul::Variant;
        let [wc, wa, wb, wbias] = wins;
        let Some(tm) = self.tex_matmul.as_ref().map(|t| &t[variant as usize]) else {
            return false;
        };
        fn source(w: &Win, rows: usize, cols: usize, rs: usize) -> tex_matmul::Source<'_> {
            tex_matmul::Source {
                buffer: &w.buffer,
                offset: w.start + w.off as u64 * 4,
                row_bytes: rs as u64 * 4,
                rows,
                cols,
            }
        }
        // A transposed operand's texture holds its row-major transpose, whose rows are the operand's
        // column stride apart.
        let (sa, sb) = match variant {
            Variant::Plain => (source(wa, g.m, g.k, g.a.rs), source(wb, g.k, g.n, g.b.rs)),
            Variant::TransposedB => (source(wa, g.m, g.k, g.a.rs), source(wb, g.n, g.k, g.b.cs)),
            Variant::TransposedA => (source(wa, g.k, g.m, g.a.cs), source(wb, g.k, g.n, g.b.rs)),
        };
        // Temporary (gathered) windows are not copy sources.
        if wa.id.is_none() || wb.id.is_none() || !tm.fits(&sa) || !tm.fits(&sb) {
            return false;
        }
        let uniform_offset = self.uniforms.push(&params.words(variant.entry()));
        let device = &self.ctx.device;
        let encoder = self
            .encoder
            .get_or_insert_with(|| device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }));
        let tm = &mut self.tex_matmul.as_mut().expect("checked above")[variant as usize];
        let (ta, view_a) = tm.fill(device, &mut self.buffer_ids, encoder, tex_matmul::Operand::A, &sa);
        let (tb, view_b) = tm.fill(device, &mut self.buffer_ids, encoder, tex_matmul::Operand::B, &sb);
        let tm = &self.tex_matmul.as_ref().expect("checked above")[variant as usize];
        let key = tex_matmul::TexMatmul::key(window_key(wc), ta, tb, window_key(wbias));
        let bind_group = self.bind_groups.get_or_make(key, || {
            tm.bind_group(
                device,
                &self.uniforms,
                (&wc.buffer, wc.start, wc.size),
                &view_a,
                &view_b,
                (&wbias.buffer, wbias.start, wbias.size),
            )
        });
        let groups = (
            ceil_div(g.n, tex_matmul::TILE_N) as u32,
            ceil_div(g.m, tex_matmul::TILE_M) as u32,
        );
        let encoder = self.encoder.as_mut().expect("created above");
        record_dispatch(encoder, &tm.pipeline, &bind_group, uniform_offset, groups);
        self.tex_matmul_dispatches += 1;
        self.finish_dispatch(std::slice::from_ref(wc));
        true
    }

    /// Dispatches of the texture-fed matmul so far.
    pub fn tex_matmul_dispatches(&self) -> u64 {
        self.tex_matmul_dispatches
    }

    /// Whether `vec4` matmuls may take the texture-fed kernel on this adapter.
    pub fn has_tex_matmul(&self) -> bool {
        self.tex_matmul.is_some()
    }

    /// Drops the texture-fed kernel, so that tests can compare it with the storage-buffer one.
    #[cfg(test)]
    pub(crate) fn without_tex_matmul(&mut self) {
        self.tex_matmul = None;
    }

    /// The bind group of `kernel` over `wins`: from the cache, unless a window is over a temporary buffer.
    fn bind_group(&mut self, kernel: &str, wins: &[Win]) -> wgpu::BindGroup {
        let kernel = &self.kernels[kernel];
        let make = || make_bind_group(&self.ctx.device, &kernel.layout, &self.uniforms, wins);
        self.bind_groups.get_or_make(bind_key(kernel.bindings, wins), make)
    }

    /// Bind groups made so far: cache hits, cached misses, and uncached ones (temporary buffers).
    pub fn bind_group_stats(&self) -> BindGroupStats {
        self.bind_groups.stats()
    }

    /// Bind groups held by the cache now.
    pub fn cached_bind_groups(&self) -> usize {
        self.bind_groups.len()
    }

    /// Submits the recorded work (without waiting).
    fn flush(&mut self) {
        if let Some(ix) = &mut self.embed_index {
            ix.read_by_pending = false;
        }
        if let Some(enc) = self.encoder.take() {
            // Lands before the commands of this submit, which read it.
            self.uniforms.upload(&self.ctx.queue);
            self.ctx.queue.submit([enc.finish()]);
        }
    }

    fn wait(&mut self) -> Result<()> {
        self.flush();
        self.ctx
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("waiting for the GPU: {e}"))?;
        Ok(())
    }

    /// Copies the byte ranges `(buffer, offset, size)`, concatenated, back to the host.
    fn read_back(&mut self, pieces: &[(wgpu::Buffer, u64, u64)]) -> Result<Vec<u8>> {
        self.flush();
        let total: u64 = pieces.iter().map(|p| p.2).sum();
        // Staging buffers of at most 256 MiB (and max_buffer_size): big downloads go in rounds.
        let cap = self.ctx.limits.max_buffer_size.min(256 << 20) / 4 * 4;
        let mut out = Vec::with_capacity(total as usize);
        let mut round: Vec<(wgpu::Buffer, u64, u64)> = Vec::new();
        let mut round_bytes = 0;
        for (src, offset, size) in pieces {
            let mut done = 0;
            while done < *size {
                let n = (size - done).min(cap - round_bytes);
                round.push((src.clone(), offset + done, n));
                round_bytes += n;
                done += n;
                if round_bytes == cap {
                    self.read_round(&round, round_bytes, &mut out)?;
                    round.clear();
                    round_bytes = 0;
                }
            }
        }
        if round_bytes > 0 {
            self.read_round(&round, round_bytes, &mut out)?;
        }
        Ok(out)
    }

    /// One staging round of [`read_back`](Self::read_back): appends `bytes` bytes to `out`.
    fn read_round(&mut self, pieces: &[(wgpu::Buffer, u64, u64)], bytes: u64, out: &mut Vec<u8>) -> Result<()> {
        let device = &self.ctx.device;
        let staging = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        let mut at = 0;
        for (src, offset, size) in pieces {
            enc.copy_buffer_to_buffer(src, *offset, &staging, at, *size);
            at += size;
        }
        self.ctx.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("waiting for the GPU: {e}"))?;
        rx.recv()
            .map_err(|_| anyhow!("the GPU never answered a read-back"))?
            .map_err(|e| anyhow!("mapping a read-back buffer: {e}"))?;
        out.extend_from_slice(
            &staging
                .get_mapped_range(..)
                .map_err(|e| anyhow!("mapping a read-back buffer: {e:?}"))?[..bytes as usize],
        );
        staging.unmap();
        Ok(())
    }

    fn new_buffer(&self, len: usize, what: &str) -> Result<wgpu::Buffer> {
        let bytes = (len as u64 * 4).max(4);
        ensure!(
            bytes <= self.ctx.limits.max_buffer_size,
            "cannot allocate {what} of {bytes} bytes: {} allows buffers of at most {} bytes",
            self.ctx.report.name,
            self.ctx.limits.max_buffer_size
        );
        let scope = self.ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes.div_ceil(4) * 4,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!(
                "cannot allocate {what} of {bytes} bytes on {}: {e}",
                self.ctx.report.name
            );
        }
        Ok(buffer)
    }

    /// Gives `buffer` an identity for the bind-group cache.
    fn track(&mut self, buffer: wgpu::Buffer) -> Tracked {
        Tracked {
            id: self.buffer_ids.next(),
            buffer,
        }
    }

    /// Writes `aux` to the start of the embedding index buffer (grown to a power of two when too small) and
    /// returns the window over its whole capacity.
    fn write_embed_index(&mut self, aux: &[u32]) -> Win {
        if self.embed_index.as_ref().is_some_and(|ix| ix.read_by_pending) {
            self.flush();
        }
        if self.embed_index.as_ref().is_none_or(|ix| ix.cap < aux.len()) {
            let cap = aux
                .len()
                .next_power_of_two()
                .max(1024)
                .min(self.max_window_elems())
                .max(aux.len());
            let buffer = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("encoder_backward index"),
                size: cap as u64 * 4,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let buf = self.track(buffer);
            let fresh = EmbedIndex {
                buf,
                cap,
                read_by_pending: false,
            };
            if let Some(old) = self.embed_index.replace(fresh) {
                self.bind_groups.forget(old.buf.id);
            }
        }
        let ix = self.embed_index.as_mut().expect("just ensured");
        self.ctx
            .queue
            .write_buffer(&ix.buf.buffer, 0, bytemuck::cast_slice(aux));
        ix.read_by_pending = true;
        let (buffer, id, cap) = (ix.buf.buffer.clone(), ix.buf.id, ix.cap);
        self.win_of(&buffer, Some(id), cap, 0, cap)
    }

    /// A buffer of at least `blocks` elements for `sum_squares`' partial sums: the previous one when it is
    /// large enough, else a new one replacing it.
    fn sum_squares_partials(&mut self, blocks: usize) -> Result<Tracked> {
        if let Some((partials, len)) = &self.partials {
            if *len >= blocks {
                return Ok(partials.clone());
            }
        }
        let buffer = self.new_buffer(blocks, "sum_squares partials")?;
        let partials = self.track(buffer);
        if let Some((old, _)) = self.partials.replace((partials.clone(), blocks)) {
            // The old buffer is freed: its entries could never hit again but would keep its memory alive.
            self.bind_groups.forget(old.id);
        }
        Ok(partials)
    }

    /// Runs an element-wise kernel over equally long views, in ranges that fit a binding window.
    fn elementwise(&mut self, kernel: &str, views: &[View], scalar: Option<f32>) {
        let len = views[0].len;
        for v in views {
            assert_eq!(v.len, len, "{kernel}: views of different lengths");
        }
        let chunk = self.max_window_elems() / SUM_BLOCK * SUM_BLOCK;
        // The residual family has vec4 kernels: used for the multiple-of-4 head when every view starts at a
        // multiple of 4 elements (windows then start 16-byte aligned), the scalar kernel doing the tail.
        let vec4 = match kernel {
            "residual_forward" => Some("residual_forward4"),
            "add_inplace" => Some("add_inplace4"),
            "scale" => Some("scale4"),
            "fill" => Some("fill4"),
            "copy" => Some("copy4"),
            _ => None,
        };
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
                let mut p = Params::default().u(n / 4);
                for i in 0..3 {
                    p = p.u(wins.get(i).map_or(0, |w| w.off / 4));
                }
                if let Some(s) = scalar {
                    p = p.f(s);
                }
                let groups = self.grid(ceil_div(n / 4, WG as usize * VEC4_PER_INVOCATION));
                self.dispatch(k4, &wins, p, groups);
                start += n;
            }
        }
        while start < len {
            let n = chunk.min(len - start);
            let wins: Vec<Win> = views.iter().map(|v| self.win(v.sub(start, n))).collect();
            let mut p = Params::default().u(n);
            for i in 0..3 {
                p = p.u(wins.get(i).map_or(0, |w| w.off));
            }
            if let Some(s) = scalar {
                p = p.f(s);
            }
            let groups = self.grid1d(n);
            self.dispatch(kernel, &wins, p, groups);
            start += n;
        }
    }

    fn gemm(&mut self, g: Gemm) {
        if g.m == 0 || g.n == 0 {
            return;
        }
        let (a0, a1) = g.a.extent(g.m, g.k);
        let (b0, b1) = g.b.extent(g.k, g.n);
        let (c0, c1) = g.c.extent(g.m, g.n);
        let bias_fits = g.bias.is_none_or(|b| self.fits(b.offset, b.end()));
        let max_groups = self.max_groups as usize;
        let (rows_ok, cols_ok) = (
            ceil_div(g.m, MATMUL_TILE_M) <= max_groups,
            ceil_div(g.n, MATMUL_TILE_N) <= max_groups,
        );
        if self.fits(a0, a1) && self.fits(b0, b1) && self.fits(c0, c1) && bias_fits && rows_ok && cols_ok {
            let (wa, wb, wc) = (
                self.win_range(g.a.buf, a0, a1.max(a0)),
                self.win_range(g.b.buf, b0, b1.max(b0)),
                self.win_range(g.c.buf, c0, c1),
            );
            let wbias = match g.bias {
                Some(b) => self.win(b),
                None => self.dummy_win(),
            };
            let flags = g.accumulate as u32 | (g.bias.is_some() as u32) << 1;
            // Windows starting 16-byte aligned, with n and k multiples of 4, and each operand row-major or
            // (texture-fed kernels only) its row-major transpose, with rows a multiple of 4 apart: the vec4
            // kernels. Their parameters: A's and B's (texture) rows apart, in vec4s.
            let aligned = |w: &Win| w.off % 4 == 0 && w.start % 16 == 0;
            let vec4_params = |a_rows: usize, b_rows: usize| {
                Params::default()
                    .u(g.m)
                    .u(g.n)
                    .u(g.k)
                    .u(wc.off)
                    .u(g.c.rs)
                    .u(wa.off / 4)
                    .u(a_rows / 4)
                    .u(1u32)
                    .u(wb.off / 4)
                    .u(b_rows / 4)
                    .u(1u32)
                    .u(wbias.off)
                    .u(flags)
            };
            if g.n % 4 == 0 && g.k % 4 == 0 && g.k > 0 && aligned(&wa) && aligned(&wb) {
                let iterations = Self::matmul_iterations(g.k, true);
                if let (Some(a_rows), Some(b_rows)) = (vec4_rows(&g.a, false), vec4_rows(&g.b, false)) {
                    let p = vec4_params(a_rows, b_rows);
                    self.require_loop_budget("matmul", iterations);
                    if self.try_tex_matmul(&g, [&wc, &wa, &wb, &wbias], p.clone(), tex_matmul::Variant::Plain) {
                        return;
                    }
                    let groups = (
                        ceil_div(g.n, MATMUL4_TILE_N) as u32,
                        ceil_div(g.m, MATMUL4_TILE_M) as u32,
                    );
                    self.dispatch("matmul4", &[wc, wa, wb, wbias], p, groups);
                    return;
                }
                // `x @ W^T` (B transposed: the texture holds W) and `X^T @ dY` (A transposed, m a multiple of
                // 4 too: the texture holds X), on software adapters only.
                for (variant, a_t, b_t) in [
                    (tex_matmul::Variant::TransposedB, false, true),
                    (tex_matmul::Variant::TransposedA, true, false),
                ] {
                    let (Some(a_rows), Some(b_rows)) = (vec4_rows(&g.a, a_t), vec4_rows(&g.b, b_t)) else {
                        continue;
                    };
                    if self.tex_matmul.is_none() || (a_t && g.m % 4 != 0) {
                        continue;
                    }
                    self.require_loop_budget("matmul", iterations);
                    if self.try_tex_matmul(&g, [&wc, &wa, &wb, &wbias], vec4_params(a_rows, b_rows), variant) {
                        return;
                    }
                }
            }
            let p = Params::default()
                .u(g.m)
                .u(g.n)
                .u(g.k)
                .u(wc.off)
                .u(g.c.rs)
                .u(wa.off)
                .u(g.a.rs)
                .u(g.a.cs)
                .u(wb.off)
                .u(g.b.rs)
                .u(g.b.cs)
                .u(wbias.off)
                .u(flags);
            let groups = (ceil_div(g.n, MATMUL_TILE_N) as u32, ceil_div(g.m, MATMUL_TILE_M) as u32);
            self.require_loop_budget("matmul", Self::matmul_iterations(g.k, false));
            self.dispatch("matmul", &[wc, wa, wb, wbias], p, groups);
            return;
        }
        // Too large for one window (or one dispatch): past the dispatch limit halve M or N, else halve the
        // dimension that shrinks the largest window most.
        let span = |g: &Gemm| {
            let e = |(a, b): (usize, usize)| b - a;
            e(g.a.extent(g.m, g.k))
                .max(e(g.b.extent(g.k, g.n)))
                .max(e(g.c.extent(g.m, g.n)))
        };
        let split_m = |g: &Gemm| {
            let h = g.m / 2;
            let lo = Gemm { m: h, ..*g };
            let hi = Gemm {
                m: g.m - h,
                a: g.a.at(h, 0),
                c: g.c.at(h, 0),
                ..*g
            };
            (lo, hi)
        };
        let split_n = |g: &Gemm| {
            let h = g.n / 2;
            let lo = Gemm {
                n: h,
                bias: g.bias.map(|b| b.sub(0, h)),
                ..*g
            };
            let hi = Gemm {
                n: g.n - h,
                b: g.b.at(0, h),
                c: g.c.at(0, h),
                bias: g.bias.map(|b| b.sub(h, g.n - h)),
                ..*g
            };
            (lo, hi)
        };
        let split_k = |g: &Gemm| {
            let h = g.k / 2;
            let lo = Gemm { k: h, ..*g };
            let hi = Gemm {
                k: g.k - h,
                a: g.a.at(0, h),
                b: g.b.at(h, 0),
                bias: None,
                accumulate: true,
                ..*g
            };
            (lo, hi)
        };
        if !rows_ok || !cols_ok {
            let (lo, hi) = if !rows_ok { split_m(&g) } else { split_n(&g) };
            self.gemm(lo);
            self.gemm(hi);
            return;
        }
        let mut best: Option<(usize, (Gemm, Gemm))> = None;
        for (ok, halves) in [(g.m > 1, split_m(&g)), (g.n > 1, split_n(&g)), (g.k > 1, split_k(&g))] {
            if ok {
                let s = span(&halves.0).max(span(&halves.1));
                if best.as_ref().is_none_or(|(b, _)| s < *b) {
                    best = Some((s, halves));
                }
            }
        }
        let (_, (lo, hi)) = best.expect("a 1x1x1 matmul always fits a window");
        self.gemm(lo);
        self.gemm(hi);
    }

    /// Rows of `[rows, row_len]` that one window can hold.
    fn rows_per_window(&self, row_len: usize) -> usize {
        (self.max_window_elems() / row_len.max(1)).max(1)
    }
}

impl Backend for WgpuBackend {
    fn check_step_shape(&self, b: usize, t: usize, c: usize, nh: usize) -> Result<()> {
        let tokens = b * t;
        let checks = [
            ("attention", Self::attention_iterations(t, c / nh.max(1))),
            // The weight gradients sum over every token of the micro-batch (k = b * t; the strided kernel
            // where the texture-fed one does not apply).
            ("the weight-gradient matmul", Self::matmul_iterations(tokens, false)),
            ("the embedding backward", tokens),
        ];
        for (op, iterations) in checks {
            if let Some(why) = self.loop_budget_error(op, iterations) {
                bail!("{why}, or a smaller --batch-size / --seq-len (now {b} x {t} tokens per rank)");
            }
        }
        Ok(())
    }

    fn name(&self) -> String {
        let r = &self.ctx.report;
        format!("wgpu ({}, {}, {})", r.name, r.backend, r.device_type)
    }

    fn alloc(&mut self, len: usize) -> Result<View> {
        let seg = self.seg_elems;
        let mut segs = Vec::new();
        for s in 0..len.div_ceil(seg).max(1) {
            let buffer = self.new_buffer(seg.min(len - (s * seg).min(len)), "tensor")?;
            segs.push(self.track(buffer));
        }
        self.bufs.push(Alloc { segs, seg, len });
        Ok(View {
            buf: self.bufs.len() - 1,
            offset: 0,
            len,
        })
    }

    fn alloc_tokens(&mut self, len: usize) -> Result<TokenView> {
        let buffer = self.new_buffer(len, "tokens")?;
        let tracked = self.track(buffer);
        self.tok_bufs.push((tracked, len));
        self.tok_host.push(vec![0; len]);
        Ok(TokenView {
            buf: self.tok_bufs.len() - 1,
            offset: 0,
            len,
        })
    }

    fn upload(&mut self, dst: View, src: &[f32]) -> Result<()> {
        ensure!(
            src.len() == dst.len,
            "upload of {} values into a view of {}",
            src.len(),
            dst.len
        );
        ensure!(dst.end() <= self.bufs[dst.buf].len, "upload view {dst:?} out of bounds");
        if src.is_empty() {
            return Ok(());
        }
        self.flush();
        let a = &self.bufs[dst.buf];
        for (s, local, at, n) in a.parts(dst.offset, dst.end()) {
            let bytes: &[u8] = bytemuck::cast_slice(&src[at..at + n]);
            self.ctx.queue.write_buffer(&a.segs[s].buffer, local as u64 * 4, bytes);
        }
        Ok(())
    }

    fn upload_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()> {
        ensure!(
            src.len() == dst.len,
            "upload of {} tokens into a view of {}",
            src.len(),
            dst.len
        );
        ensure!(
            dst.offset + dst.len <= self.tok_bufs[dst.buf].1,
            "token view {dst:?} out of bounds"
        );
        if src.is_empty() {
            return Ok(());
        }
        self.flush();
        self.tok_host[dst.buf][dst.offset..dst.offset + dst.len].copy_from_slice(src);
        let buffer = &self.tok_bufs[dst.buf].0.buffer;
        self.ctx
            .queue
            .write_buffer(buffer, dst.offset as u64 * 4, bytemuck::cast_slice(src));
        Ok(())
    }

    fn download(&mut self, src: View, dst: &mut [f32]) -> Result<()> {
        ensure!(
            dst.len() == src.len,
            "download of a view of {} into {} values",
            src.len,
            dst.len()
        );
        ensure!(
            src.end() <= self.bufs[src.buf].len,
            "download view {src:?} out of bounds"
        );
        if dst.is_empty() {
            return Ok(());
        }
        let a = &self.bufs[src.buf];
        let pieces: Vec<(wgpu::Buffer, u64, u64)> = a
            .parts(src.offset, src.end())
            .into_iter()
            .map(|(s, local, _, n)| (a.segs[s].buffer.clone(), local as u64 * 4, n as u64 * 4))
            .collect();
        let bytes = self.read_back(&pieces)?;
        dst.copy_from_slice(bytemuck::cast_slice(&bytes));
        Ok(())
    }

    fn fill(&mut self, dst: View, value: f32) {
        self.elementwise("fill", &[dst], Some(value));
    }

    fn copy(&mut self, dst: View, src: View) {
        assert!(!dst.overlaps(&src), "copy between overlapping views");
        self.elementwise("copy", &[dst, src], None);
    }

    fn encoder_forward(&mut self, out: View, tokens: TokenView, wte: View, wpe: View, b: usize, t: usize, c: usize) {
        let n = b * t;
        assert!(out.len == n * c && tokens.len == n && wpe.len >= t * c && c > 0 && wte.len % c == 0);
        if n == 0 {
            return;
        }
        let v = wte.len / c;
        let (wout, wtok, wwpe) = (self.win(out), self.twin(tokens), self.win(wpe.sub(0, t * c)));
        let rows = self.rows_per_window(c);
        let mut v0 = 0;
        while v0 < v {
            let v1 = (v0 + rows).min(v);
            let wwte = self.win(wte.sub(v0 * c, (v1 - v0) * c));
            let p = Params::default()
                .u(n)
                .u(t)
                .u(c)
                .u(wout.off)
                .u(wwte.off)
                .u(wwpe.off)
                .u(wtok.off)
                .u(v0)
                .u(v1);
            let groups = self.grid1d(n * c);
            self.dispatch(
                "encoder_forward",
                &[wout.clone(), wwte, wwpe.clone(), wtok.clone()],
                p,
                groups,
            );
            v0 = v1;
        }
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
        let n = b * t;
        assert!(dout.len == n * c && tokens.len == n && dwpe.len >= t * c && c > 0 && dwte.len % c == 0);
        if n == 0 {
            return;
        }
        // A token's invocation adds up to every position of the batch.
        self.require_loop_budget("embedding backward", n);
        let wdout = self.win(dout);
        // dwpe: one invocation per (t, channel), summing the batch in order.
        let wdwpe = self.win(dwpe.sub(0, t * c));
        let p = Params::default()
            .u(b)
            .u(t)
            .u(c)
            .u(wdwpe.off)
            .u(wdout.off)
            .u(0u32)
            .u(0u32)
            .u(0u32)
            .u(0u32);
        let groups = self.grid1d(t * c);
        self.dispatch("encoder_backward_wpe", &[wdwpe, wdout.clone()], p, groups);
        // dwte: group the positions by token on the host, in (b, t) order: [rows | starts | positions].
        let v = dwte.len / c;
        let toks = &self.tok_host[tokens.buf][tokens.offset..tokens.offset + n];
        assert!(
            toks.iter().all(|&x| (x as usize) < v),
            "token id out of the vocabulary of {v}"
        );
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by_key(|&i| (toks[i as usize], i));
        let mut rows = Vec::new();
        let mut starts = Vec::new();
        for (j, &i) in order.iter().enumerate() {
            let tok = toks[i as usize];
            if rows.last() != Some(&tok) {
                rows.push(tok);
                starts.push(j as u32);
            }
        }
        starts.push(n as u32);
        let u = rows.len();
        let mut aux = rows;
        aux.extend_from_slice(&starts);
        aux.extend_from_slice(&order);
        let waux = self.write_embed_index(&aux);
        let rows_per = self.rows_per_window(c);
        let mut v0 = 0;
        while v0 < v {
            let v1 = (v0 + rows_per).min(v);
            let wdwte = self.win(dwte.sub(v0 * c, (v1 - v0) * c));
            let p = Params::default()
                .u(u)
                .u(t)
                .u(c)
                .u(wdwte.off)
                .u(wdout.off)
                .u(0u32)
                .u(0u32)
                .u(v0)
                .u(v1);
            let groups = self.grid1d(u * c);
            let dummy = self.dummy_win();
            self.dispatch(
                "encoder_backward_wte",
                &[wdwte, wdout.clone(), dummy, waux.clone()],
                p,
                groups,
            );
            v0 = v1;
        }
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
        assert!(out.len == n * c && inp.len == n * c && mean.len == n && rstd.len == n);
        assert!(weight.len == c && bias.len == c);
        if n == 0 {
            return;
        }
        let w = [out, mean, rstd, inp, weight, bias].map(|v| self.win(v));
        let p = Params::default()
            .u(n)
            .u(c)
            .u(w[0].off)
            .u(w[1].off)
            .u(w[2].off)
            .u(w[3].off)
            .u(w[4].off)
            .u(w[5].off)
            .u(0u32)
            .u(0u32);
        let (kernel, groups) = self.per_row(
            ("layernorm_forward", 1, Self::tree_iterations(c, WG as usize, 3, 2, 8)),
            ("layernorm_forward_rows", 3 * c),
            n,
        );
        self.dispatch(kernel, &w, p, groups);
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
        assert!(weight.len == c && dweight.len == c && dbias.len == c);
        if n == 0 {
            return;
        }
        let w = [dinp, mean, rstd, inp, weight, dbias, dout, dweight].map(|v| self.win(v));
        let p = Params::default()
            .u(n)
            .u(c)
            .u(w[0].off)
            .u(w[1].off)
            .u(w[2].off)
            .u(w[3].off)
            .u(w[4].off)
            .u(w[5].off)
            .u(w[6].off)
            .u(w[7].off);
        // Both passes read the same parameter block: the input gradient by rows, then dweight/dbias by columns.
        let (kernel, groups) = self.per_row(
            ("layernorm_backward", 1, Self::tree_iterations(c, WG as usize, 2, 2, 8)),
            ("layernorm_backward_rows", 2 * c),
            n,
        );
        self.dispatch(kernel, &w[..7], p.clone(), groups);
        let (kernel, groups) = self.per_row(
            ("layernorm_backward_params", 16, Self::column_sum_iterations(n)),
            ("layernorm_backward_params_cols", n),
            c,
        );
        self.dispatch(kernel, &w, p, groups);
    }

    fn matmul_forward(&mut self, out: View, inp: View, weight: View, bias: Option<View>, s: MatmulShape) {
        assert!(out.len == s.n * s.oc && inp.len == s.n * s.c && weight.len == s.c * s.oc);
        assert!(bias.is_none_or(|b| b.len == s.oc));
        // W as a c x oc matrix.
        let (w_rs, w_cs) = match s.layout {
            WeightLayout::InOut => (s.oc, 1),
            WeightLayout::OutIn => (1, s.c),
        };
        self.gemm(Gemm {
            m: s.n,
            n: s.oc,
            k: s.c,
            a: Mat {
                buf: inp.buf,
                off: inp.offset,
                rs: s.c,
                cs: 1,
            },
            b: Mat {
                buf: weight.buf,
                off: weight.offset,
                rs: w_rs,
                cs: w_cs,
            },
            c: Mat {
                buf: out.buf,
                off: out.offset,
                rs: s.oc,
                cs: 1,
            },
            bias,
            accumulate: false,
        });
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
        assert!(dinp.len == s.n * s.c && inp.len == s.n * s.c && dout.len == s.n * s.oc);
        assert!(weight.len == s.c * s.oc && dweight.len == s.c * s.oc);
        assert!(dbias.is_none_or(|b| b.len == s.oc));
        let mat = |v: View, rs: usize, cs: usize| Mat {
            buf: v.buf,
            off: v.offset,
            rs,
            cs,
        };
        // dinp [n, c] = dout [n, oc] @ W^T, W^T as an oc x c matrix.
        let wt = match s.layout {
            WeightLayout::InOut => mat(weight, 1, s.oc),
            WeightLayout::OutIn => mat(weight, s.c, 1),
        };
        self.gemm(Gemm {
            m: s.n,
            n: s.c,
            k: s.oc,
            a: mat(dout, s.oc, 1),
            b: wt,
            c: mat(dinp, s.c, 1),
            bias: None,
            accumulate: false,
        });
        match s.layout {
            // dW [c, oc] += inp^T @ dout
            WeightLayout::InOut => self.gemm(Gemm {
                m: s.c,
                n: s.oc,
                k: s.n,
                a: mat(inp, 1, s.c),
                b: mat(dout, s.oc, 1),
                c: mat(dweight, s.oc, 1),
                bias: None,
                accumulate: true,
            }),
            // dW [oc, c] += dout^T @ inp
            WeightLayout::OutIn => self.gemm(Gemm {
                m: s.oc,
                n: s.c,
                k: s.n,
                a: mat(dout, 1, s.oc),
                b: mat(inp, s.c, 1),
                c: mat(dweight, s.c, 1),
                bias: None,
                accumulate: true,
            }),
        }
        if let Some(db) = dbias {
            if s.n == 0 {
                return;
            }
            // One invocation per column; split by rows of dout when dout exceeds a window.
            let rows = self.rows_per_window(s.oc);
            let mut r0 = 0;
            while r0 < s.n {
                let r1 = (r0 + rows).min(s.n);
                let (wdb, wd) = (self.win(db), self.win(dout.sub(r0 * s.oc, (r1 - r0) * s.oc)));
                let p = Params::default()
                    .u(r1 - r0)
                    .u(s.oc)
                    .u(0u32)
                    .u(wdb.off)
                    .u(s.oc)
                    .u(wd.off)
                    .u(s.oc);
                let groups = self.grid(ceil_div(s.oc, 16));
                self.require_loop_budget("matmul bias gradient", Self::column_sum_iterations(r1 - r0));
                self.dispatch("matmul_backward_bias", &[wdb, wd], p, groups);
                r0 = r1;
            }
        }
    }

    fn attention_forward(&mut self, out: View, att: View, qkv: View, s: AttentionShape) {
        let AttentionShape { b, t, c, nh } = s;
        assert!(out.len == b * t * c && att.len == b * nh * t * t && qkv.len == b * t * 3 * c);
        assert!(nh > 0 && c % nh == 0);
        if b == 0 || t == 0 {
            return;
        }
        self.require_loop_budget("attention", Self::attention_iterations(t, c / nh));
        let whole = self.fits(att.offset, att.end()) && self.fits(qkv.offset, qkv.end());
        let per = if whole { b } else { 1 };
        for b0 in (0..b).step_by(per) {
            let nb = per.min(b - b0);
            let o = out.sub(b0 * t * c, nb * t * c);
            let a = att.sub(b0 * nh * t * t, nb * nh * t * t);
            let q = qkv.sub(b0 * t * 3 * c, nb * t * 3 * c);
            let w = [o, a, q].map(|v| self.win(v));
            let p = || {
                Params::default()
                    .u(nb)
                    .u(t)
                    .u(c)
                    .u(nh)
                    .u(w[0].off)
                    .u(w[1].off)
                    .u(w[2].off)
                    .u(0u32)
                    .u(0u32)
            };
            let g1 = self.grid1d(nb * nh * t);
            self.dispatch("attention_forward", &w, p(), g1);
            let g2 = self.grid1d(nb * t * c);
            self.dispatch("attention_forward_out", &w, p(), g2);
        }
    }

    fn attention_backward(&mut self, dqkv: View, datt: View, dout: View, qkv: View, att: View, s: AttentionShape) {
        let AttentionShape { b, t, c, nh } = s;
        assert!(dout.len == b * t * c && att.len == b * nh * t * t && qkv.len == b * t * 3 * c);
        assert!(dqkv.len == qkv.len && datt.len == att.len && nh > 0 && c % nh == 0);
        if b == 0 || t == 0 {
            return;
        }
        self.require_loop_budget("attention backward", Self::attention_iterations(t, c / nh));
        let whole = [att, datt, qkv, dqkv].iter().all(|v| self.fits(v.offset, v.end()));
        let per = if whole { b } else { 1 };
        for b0 in (0..b).step_by(per) {
            let nb = per.min(b - b0);
            let dq = dqkv.sub(b0 * t * 3 * c, nb * t * 3 * c);
            let a = att.sub(b0 * nh * t * t, nb * nh * t * t);
            let q = qkv.sub(b0 * t * 3 * c, nb * t * 3 * c);
            let da = datt.sub(b0 * nh * t * t, nb * nh * t * t);
            let d = dout.sub(b0 * t * c, nb * t * c);
            let w = [dq, a, q, da, d].map(|v| self.win(v));
            let p = || {
                Params::default()
                    .u(nb)
                    .u(t)
                    .u(c)
                    .u(nh)
                    .u(w[0].off)
                    .u(w[1].off)
                    .u(w[2].off)
                    .u(w[3].off)
                    .u(w[4].off)
            };
            let g1 = self.grid1d(nb * nh * t);
            self.dispatch("attention_backward", &w, p(), g1);
            let g2 = self.grid1d(nb * t * c);
            self.dispatch("attention_backward_dq", &w[..4], p(), g2);
            self.dispatch("attention_backward_dkv", &w, p(), g2);
        }
    }

    fn gelu_forward(&mut self, out: View, inp: View) {
        self.elementwise("gelu_forward", &[out, inp], None);
    }

    fn gelu_backward(&mut self, dinp: View, inp: View, dout: View) {
        self.elementwise("gelu_backward", &[dinp, inp, dout], None);
    }

    fn residual_forward(&mut self, out: View, a: View, b: View) {
        self.elementwise("residual_forward", &[out, a, b], None);
    }

    fn add_inplace(&mut self, dst: View, src: View) {
        self.elementwise("add_inplace", &[dst, src], None);
    }

    fn crossentropy_forward(&mut self, losses: View, logits: View, targets: TokenView, n: usize, v: usize) {
        assert!(losses.len == n && logits.len == n * v && targets.len == n && v > 0);
        let rows = self.rows_per_window(v);
        let mut r0 = 0;
        while r0 < n {
            let r1 = (r0 + rows).min(n);
            let (wl, wx, wt) = (
                self.win(losses.sub(r0, r1 - r0)),
                self.win(logits.sub(r0 * v, (r1 - r0) * v)),
                self.twin(targets.sub(r0, r1 - r0)),
            );
            let p = Params::default().u(r1 - r0).u(v).u(wl.off).u(wx.off).u(wt.off).f(0.0);
            let (kernel, groups) = self.per_row(
                (
                    "crossentropy_forward",
                    1,
                    Self::tree_iterations(v, WG as usize, 2, 2, 8),
                ),
                ("crossentropy_forward_rows", 2 * v),
                r1 - r0,
            );
            self.dispatch(kernel, &[wl, wx, wt], p, groups);
            r0 = r1;
        }
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
        assert!(dlogits.len == n * v && logits.len == n * v && targets.len == n && v > 0);
        if dlogits != logits {
            self.copy(dlogits, logits);
        }
        let rows = self.rows_per_window(v);
        let mut r0 = 0;
        while r0 < n {
            let r1 = (r0 + rows).min(n);
            let (wx, wt) = (
                self.win(dlogits.sub(r0 * v, (r1 - r0) * v)),
                self.twin(targets.sub(r0, r1 - r0)),
            );
            let p = Params::default().u(r1 - r0).u(v).u(0u32).u(wx.off).u(wt.off).f(dloss);
            let (kernel, groups) = self.per_row(
                (
                    "crossentropy_backward",
                    1,
                    Self::tree_iterations(v, WG as usize, 3, 2, 8),
                ),
                ("crossentropy_backward_rows", 3 * v),
                r1 - r0,
            );
            let dummy = self.dummy_win();
            self.dispatch(kernel, &[dummy, wx, wt], p, groups);
            r0 = r1;
        }
    }

    fn sum_squares(&mut self, x: View) -> Result<f64> {
        if x.len == 0 {
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
            let p = Params::default().u(n).u(wx.off).u(start / SUM_BLOCK);
            let groups = self.grid(ceil_div(n, SUM_BLOCK));
            self.dispatch("sum_squares", &[wp, wx], p, groups);
            start += n;
        }
        let bytes = self.read_back(&[(partial.buffer, 0, blocks as u64 * 4)])?;
        let sums: &[f32] = bytemuck::cast_slice(&bytes);
        Ok(sums.iter().map(|&s| s as f64).sum())
    }

    fn scale(&mut self, x: View, s: f32) {
        self.elementwise("scale", &[x], Some(s));
    }

    fn adamw(&mut self, params: View, grads: View, m: View, v: View, h: &AdamWStep) {
        let len = params.len;
        assert!(grads.len == len && m.len == len && v.len == len);
        let chunk = self.max_window_elems() / SUM_BLOCK * SUM_BLOCK;
        let mut start = 0;
        while start < len {
            let n = chunk.min(len - start);
            let w = [params, grads, m, v].map(|x| self.win(x.sub(start, n)));
            let p = Params::default()
                .u(n)
                .u(w[0].off)
                .u(w[1].off)
                .u(w[2].off)
                .u(w[3].off)
                .f(h.lr)
                .f(h.beta1)
                .f(h.beta2)
                .f(h.eps)
                .f(h.weight_decay)
                .f(h.step_size)
                .f(h.bias_correction2_sqrt)
                .f(h.grad_scale);
            let groups = self.grid1d(n);
            self.dispatch("adamw", &w, p, groups);
            start += n;
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        self.wait()
    }
}

/// Times `iters` forward matmuls `[m, k] @ [k, n]` (after one warm-up) and returns GFLOP/s.
pub fn bench_matmul(be: &mut WgpuBackend, m: usize, k: usize, n: usize, iters: usize) -> Result<f64> {
    let (a, w, o) = (be.alloc(m * k)?, be.alloc(k * n)?, be.alloc(m * n)?);
    be.fill(a, 0.5);
    be.fill(w, 0.25);
    let shape = MatmulShape {
        n: m,
        c: k,
        oc: n,
        layout: WeightLayout::InOut,
    };
    be.matmul_forward(o, a, w, None, shape);
    be.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters {
        be.matmul_forward(o, a, w, None, shape);
    }
    be.synchronize()?;
    let secs = start.elapsed().as_secs_f64();
    Ok(2.0 * (m * k * n * iters) as f64 / secs / 1e9)
}
