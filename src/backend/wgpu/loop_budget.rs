//! llvmpipe's loop budget: the iteration counts of each kernel and the checks that refuse a shape whose
//! invocations would run past the budget on a software adapter.
//!
//! llvmpipe (lavapipe) ends a shader invocation's loops once they have run [`SOFTWARE_LOOP_BUDGET`]
//! iterations in all (its guard against endless shaders) and silently leaves the rest of the work undone.
//! So, on software adapters, a kernel whose loops would run longer takes another kernel (the row kernels
//! give way to the tree kernels), or the op refuses: it records nothing and its
//! [`BackendError::ShapeUnsupported`] is returned at the next synchronisation point. This guards results,
//! not speed: it applies on every software adapter, whichever kernels it runs. Hardware drivers have no
//! such limit.

use super::{ceil_div, BackendError, WgpuBackend};
use crate::backend::flash::{head_width_error, FLASH_HEAD_MAX, FLASH_TILE};
use crate::backend::AttentionShape;

/// Iterations after which llvmpipe stops an invocation's loops; measured on Mesa 22.3 with two loops in a
/// row, whose iterations count against one budget.
pub(crate) const SOFTWARE_LOOP_BUDGET: usize = 65535;

/// Attention's loop iterations per invocation at sequence length `t`, in its heaviest kernels (`dq` and
/// `dk`): up to ⌈t / 32⌉ tiles, each staged in 8 steps, then per row of the tile three dot or update loops
/// of 8 steps and the row's own; 16 steps to load each of two rows, and the head's 64 to store.
pub(crate) fn attention_iterations(t: usize) -> usize {
    t.div_ceil(FLASH_TILE) * (8 + FLASH_TILE * 25) + 2 * 16 + FLASH_HEAD_MAX
}

/// A matmul's loop iterations per invocation over `k` terms: k steps (k / 4 for the vec4 and
/// texture-fed kernels), then 4 per store of the block's 64 accumulators.
pub(crate) fn matmul_iterations(k: usize, vec4: bool) -> usize {
    (if vec4 { k / 4 } else { k }) + 256
}

/// The tiled matmul's loop iterations per invocation over `k` terms: one per step of 8 terms. Its inner
/// loops have fixed trip counts of 4 and 8, which Mesa unrolls before llvmpipe counts anything (measured:
/// `hardware_kernels_keep_the_loop_budget`, whose slices would run over 350 K iterations if every one
/// counted, matches the CPU).
pub(crate) fn tiled_iterations(k: usize) -> usize {
    k.div_ceil(8) + 64
}

/// A tree reduction's loop iterations per invocation: `passes` strided loops over `len` elements
/// (`stride` apart per invocation), then `trees` reductions of `levels` levels each.
pub(crate) fn tree_iterations(len: usize, stride: usize, passes: usize, trees: usize, levels: usize) -> usize {
    passes * ceil_div(len, stride) + trees * levels
}

/// Loop iterations per invocation of the column-sum kernels (layer-norm parameter gradients, matmul bias
/// gradient) over `rows` rows: each of 16 lanes per column sums every 16th row, then a 4-level tree
/// (counted as 8).
pub(crate) fn column_sum_iterations(rows: usize) -> usize {
    tree_iterations(rows, 16, 1, 1, 8)
}

impl WgpuBackend {
    /// Loop iterations of a weight gradient over `tokens` terms: the tiled kernel where this backend runs
    /// the hardware kernels, else the strided one (the texture-fed kernel does not take the transposed
    /// operand).
    pub(crate) fn weight_gradient_iterations(&self, tokens: usize) -> usize {
        if self.hardware_kernels_only() {
            tiled_iterations(tokens)
        } else {
            matmul_iterations(tokens, false)
        }
    }

    /// Whether a kernel whose invocations run `iterations` loop iterations each computes everything on this
    /// adapter ([`SOFTWARE_LOOP_BUDGET`]).
    pub(crate) fn within_loop_budget(&self, iterations: usize) -> bool {
        !self.ctx.report.is_software || iterations < SOFTWARE_LOOP_BUDGET
    }

    /// Why `op`, running `iterations` loop iterations per invocation, cannot run on this adapter; `None`
    /// when it fits.
    pub(crate) fn loop_budget_error(&self, op: &str, iterations: usize) -> Option<BackendError> {
        (!self.within_loop_budget(iterations)).then(|| BackendError::ShapeUnsupported {
            op: op.to_string(),
            detail: format!(
                "needs {iterations} loop iterations per shader invocation, and {} stops a shader's loops after \
                 {SOFTWARE_LOOP_BUDGET}",
                self.ctx.report.name
            ),
        })
    }

    /// Whether a kernel of `op` whose invocations run `iterations` loop iterations may run here. When not,
    /// records the refusal, returned at the next synchronisation point, and the op must record nothing
    /// (`check_step_shape` refuses a training run's shapes before this can happen).
    #[must_use]
    /// Whether the attention kernels can run `shape` here (the head width, the loop budget); records why
    /// not.
    pub(crate) fn require_attention_kernels(&self, op: &str, shape: AttentionShape) -> bool {
        match head_width_error(op, shape) {
            Some(refusal) => {
                self.errors.record(refusal);
                false
            }
            None => self.require_loop_budget(op, attention_iterations(shape.t)),
        }
    }

    pub(crate) fn require_loop_budget(&self, op: &str, iterations: usize) -> bool {
        match self.loop_budget_error(op, iterations) {
            Some(refusal) => {
                self.errors.record(refusal);
                false
            }
            None => true,
        }
    }
}
