//! What the GPU backends' flash attention kernels (`shaders/attention.wgsl`, `kernels/attention.cu`) share
//! with the host: their tiling and the widest head they take.

use super::{AttentionShape, BackendError};

/// Rows (query rows forward and in `dq`, key rows in `dk` and `dv`) per workgroup or block: `ROWS`.
pub const FLASH_ROWS: usize = 64;

/// Rows staged per tile in workgroup or shared memory: `TILE`.
pub const FLASH_TILE: usize = 32;

/// The widest head: each invocation keeps a head's values in registers (`HS`).
pub const FLASH_HEAD_MAX: usize = 64;

/// Workgroups (blocks) of the kernels that give each invocation a row: `b · nh · ⌈t / 64⌉`.
pub fn flash_groups(b: usize, t: usize, nh: usize) -> usize {
    b * nh * t.div_ceil(FLASH_ROWS)
}

/// Why the kernels cannot run `shape`'s heads, if they cannot.
pub fn head_width_error(op: &str, shape: AttentionShape) -> Option<BackendError> {
    let hs = shape.c / shape.nh.max(1);
    (hs > FLASH_HEAD_MAX).then(|| BackendError::ShapeUnsupported {
        op: op.into(),
        detail: format!(
            "heads are {hs} wide ({} channels over {} heads), and the GPU attention kernels keep a head of at \
             most {FLASH_HEAD_MAX} values in registers: more heads, or the CPU backend, fit",
            shape.c, shape.nh
        ),
    })
}
