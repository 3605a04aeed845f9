//! Everything that exists only for software adapters (llvmpipe/lavapipe, which run the kernels on the
//! CPU). A reader of the hardware path can skip this module: on a hardware adapter none of its kernels is
//! built or chosen, and its loop-budget checks pass every shape.
//!
//! Why it exists: llvmpipe runs compute shaders correctly but with costs unlike a GPU's, and with one
//! silent limit.
//! - **Row kernels.** A workgroup barrier switches between all of a workgroup's subgroups, so the tree
//!   reductions of layer norm and cross-entropy (9 barriers per reduction) cost more than the row's
//!   arithmetic. The `*_rows` kernels run one invocation per row (per column for the layer-norm parameter
//!   gradients), summing in index order with no workgroup memory and no barrier.
//! - **Texture-fed matmuls** (`tex_matmul.rs`). A storage-buffer load whose address differs between
//!   invocations becomes a loop over the SIMD lanes; an image load becomes one load per lane. So on
//!   adapters with 8-lane subgroups the `vec4` matmuls copy their operands into textures first.
//! - **Loop budget** (`../loop_budget.rs`, outside this module because every op consults it). llvmpipe stops
//!   an invocation's loops after 65535 iterations and leaves the rest undone. The row kernels give way to
//!   the tree kernels past it, and ops whose kernels would run past it refuse instead of returning partial
//!   results.
//!
//! **Hardware kernels only.** With [`HARDWARE_KERNELS_ENV`]`=1` in the environment when the backend is
//! created, a software adapter builds and chooses none of the row kernels and texture-fed matmuls: it runs
//! exactly the kernels a hardware adapter runs (tree reductions, workgroup-per-row layer norm and
//! cross-entropy, the plain and strided matmuls), so that CI checks the hardware path on lavapipe. The loop
//! budget still applies: it guards results, and the adapter is still llvmpipe.

mod tex_matmul;

use super::context::Context;
use super::kernels::COMMON;
use super::matmul::{vec4_rows, Gemm};
use super::params::{KernelParams, MatmulParams};
use super::submit::{record_dispatch, window_key};
use super::windows::Win;
use super::{ceil_div, WgpuBackend};
use tex_matmul::{Operand, Source, TexMatmul, Variant};

/// The environment variable that, set to `1`, makes a software adapter run only the kernels a hardware
/// adapter runs; read once, when the backend is created.
pub const HARDWARE_KERNELS_ENV: &str = "RINGTRAIN_WGPU_HARDWARE_KERNELS";

/// Whether [`HARDWARE_KERNELS_ENV`] asks for the hardware kernels only.
pub(super) fn hardware_kernels_requested() -> bool {
    std::env::var(HARDWARE_KERNELS_ENV).is_ok_and(|v| v == "1")
}

/// The software-only kernels this backend uses.
pub(super) struct SoftwareKernels {
    /// Only the kernels a hardware adapter runs are built and chosen ([`HARDWARE_KERNELS_ENV`]).
    hardware_only: bool,
    /// Layer norm and cross-entropy take their one-invocation-per-row kernels (`*_rows`, no barriers)
    /// instead of one workgroup per row with tree reductions.
    pub(super) row_kernels: bool,
    /// The texture-fed matmul, on software adapters with 8-lane subgroups only. One kernel per [`Variant`]:
    /// `x @ W`, `x @ W^T` (the tied LM head and every input gradient) and `X^T @ dY` (every weight
    /// gradient).
    tex_matmul: Option<[TexMatmul; 3]>,
    /// Dispatches of the texture-fed matmul so far (tests check which kernel ran).
    tex_matmul_dispatches: u64,
}

impl SoftwareKernels {
    /// The kernels for the adapter of `ctx`: none on hardware adapters, nor with `hardware_only`. Errors
    /// surface through the caller's validation error scope.
    pub(super) fn new(ctx: &Context, hardware_only: bool) -> Self {
        let software = ctx.report.is_software && !hardware_only;
        let eight_lanes = Some((tex_matmul::SUBGROUP_SIZE, tex_matmul::SUBGROUP_SIZE));
        let textured = software && ctx.report.subgroup_sizes == eight_lanes;
        let tex_matmul = textured.then(|| {
            let shared = include_str!("../../../../shaders/matmul4_shared.wgsl");
            let make = |v: Variant| {
                let source = format!("{COMMON}\n{shared}{}", v.source());
                TexMatmul::new(&ctx.device, &source, v.entry(), ctx.limits.max_texture_dimension_2d)
            };
            Variant::ALL.map(make)
        });
        SoftwareKernels {
            hardware_only,
            row_kernels: software,
            tex_matmul,
            tex_matmul_dispatches: 0,
        }
    }
}

impl WgpuBackend {
    /// Chooses the one-invocation-per-row kernels of layer norm and cross-entropy (`true`, the default on
    /// software adapters) or the workgroup-per-row ones (the default elsewhere). Tests run both on one
    /// adapter.
    pub fn set_row_kernels(&mut self, on: bool) {
        self.software.row_kernels = on;
    }

    /// Whether layer norm and cross-entropy take the one-invocation-per-row kernels.
    pub fn row_kernels(&self) -> bool {
        self.software.row_kernels
    }

    /// Whether this backend runs only the kernels a hardware adapter runs ([`HARDWARE_KERNELS_ENV`]); always
    /// true in effect on hardware adapters, where no software-only kernel exists.
    pub fn hardware_kernels_only(&self) -> bool {
        self.software.hardware_only || !self.ctx.report.is_software
    }

    /// Dispatches of the texture-fed matmul so far.
    pub fn tex_matmul_dispatches(&self) -> u64 {
        self.software.tex_matmul_dispatches
    }

    /// Whether `vec4` matmuls may take the texture-fed kernel on this adapter.
    pub fn has_tex_matmul(&self) -> bool {
        self.software.tex_matmul.is_some()
    }

    /// Switches to the kernels a hardware adapter runs, as [`HARDWARE_KERNELS_ENV`] does at construction
    /// (tests cannot set the environment safely while other tests run).
    #[cfg(test)]
    pub(crate) fn use_hardware_kernels_only(&mut self) {
        self.software.hardware_only = true;
        self.software.row_kernels = false;
        self.software.tex_matmul = None;
    }

    /// Drops the texture-fed kernel, so that tests can compare it with the storage-buffer one.
    #[cfg(test)]
    pub(crate) fn without_tex_matmul(&mut self) {
        self.software.tex_matmul = None;
    }

    /// Kernel and grid of a reduction over `n` rows (or columns): `serial`, one invocation each running
    /// `serial_iterations` loop iterations, when [`Self::set_row_kernels`] is on and the loop budget allows
    /// it, else `tree`, one workgroup per `per_group` of them, whose invocations run `tree_iterations`
    /// (`None`, refused, past the budget like any kernel).
    pub(super) fn per_row(
        &self,
        (tree, per_group, tree_iterations): (&'static str, usize, usize),
        (serial, serial_iterations): (&'static str, usize),
        n: usize,
    ) -> Option<(&'static str, (u32, u32))> {
        if self.software.row_kernels && self.within_loop_budget(serial_iterations) {
            return Some((serial, self.grid1d(n)));
        }
        self.require_loop_budget(tree, tree_iterations)
            .then(|| (tree, self.grid(ceil_div(n, per_group))))
    }

    /// `x @ W^T` (B transposed: the texture holds W) and `X^T @ dY` (A transposed, m a multiple of 4 too:
    /// the texture holds X) on the texture-fed kernels, for a `vec4`-eligible gemm whose operands are not
    /// both row-major. `params` gives the kernel's parameters from A's and B's (texture) rows apart.
    /// Returns whether the gemm is taken care of: recorded, or refused past the loop budget (which the
    /// other kernels would exceed too); false, recording nothing, when neither kernel applies.
    pub(super) fn try_transposed_tex_matmul(
        &mut self,
        g: &Gemm,
        wins: [&Win; 4],
        iterations: usize,
        params: impl Fn(usize, usize) -> MatmulParams,
    ) -> bool {
        for (variant, a_t, b_t) in [(Variant::TransposedB, false, true), (Variant::TransposedA, true, false)] {
            let (Some(a_rows), Some(b_rows)) = (vec4_rows(&g.a, a_t), vec4_rows(&g.b, b_t)) else {
                continue;
            };
            if self.software.tex_matmul.is_none() || (a_t && g.m % 4 != 0) {
                continue;
            }
            if !self.require_loop_budget("matmul", iterations) {
                return true;
            }
            if self.try_tex_matmul(g, wins, &params(a_rows, b_rows), variant) {
                return true;
            }
        }
        false
    }

    /// `A @ B`, both row-major, on the texture-fed kernel; false, recording nothing, when it does not apply.
    pub(super) fn try_plain_tex_matmul(&mut self, g: &Gemm, wins: [&Win; 4], params: &MatmulParams) -> bool {
        self.try_tex_matmul(g, wins, params, Variant::Plain)
    }

    /// The vec4 matmul with A and B copied into textures, when this backend has it (software adapters with
    /// 8-lane subgroups) and both operands can be copied (`TexMatmul::fits`). `variant` says which
    /// operand is given as the row-major transpose (`g.b.rs == 1` or `g.a.rs == 1`). Returns false,
    /// recording nothing, otherwise.
    fn try_tex_matmul(&mut self, g: &Gemm, wins: [&Win; 4], params: &MatmulParams, variant: Variant) -> bool {
        let [wc, wa, wb, wbias] = wins;
        let Some(tm) = self.software.tex_matmul.as_ref().map(|t| &t[variant as usize]) else {
            return false;
        };
        fn source(w: &Win, rows: usize, cols: usize, rs: usize) -> Source<'_> {
            Source {
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
        let uniform_offset = self.uniforms.push(&params.words());
        let device = &self.ctx.device;
        let encoder = self
            .encoder
            .get_or_insert_with(|| device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }));
        let tm = &mut self.software.tex_matmul.as_mut().expect("checked above")[variant as usize];
        let (ta, view_a) = tm.fill(device, &mut self.buffer_ids, encoder, Operand::A, &sa);
        let (tb, view_b) = tm.fill(device, &mut self.buffer_ids, encoder, Operand::B, &sb);
        let tm = &self.software.tex_matmul.as_ref().expect("checked above")[variant as usize];
        let key = TexMatmul::key(window_key(wc), ta, tb, window_key(wbias));
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
        self.software.tex_matmul_dispatches += 1;
        self.finish_dispatch(std::slice::from_ref(wc));
        true
    }
}
