//! Unit tests of the wgpu backend, on whatever adapter is found (lavapipe in CI), against the CPU backend
//! where results are compared:
//! - `kernels`: the vec4 and texture-fed kernels, on shapes the conformance suite does not reach (its
//!   matmuls have odd sizes, so they take the strided kernel): n, k and strides multiples of 4, views at
//!   aligned and unaligned offsets, and allocations split into small segments so that windows straddle them;
//! - `bind_groups`: a repeated sequence of ops (and a repeated training step) makes no new bind group,
//!   parameters change under a cached one, temporaries bypass it, a replaced buffer is never rebound, and
//!   the cache stays bounded;
//! - `limits`: the window and buffer caps, and llvmpipe's loop budget (with the hardware kernels only too);
//! - `lifecycle`: freeing (memory, bind groups, stale ids) and device errors reaching the next
//!   synchronisation point;
//! - `readback`: early read-backs (`begin_download`): ordering, several in flight, readiness, the staging
//!   pool, and errors.

mod bind_groups;
mod kernels;
mod lifecycle;
mod limits;
mod readback;

use super::{AdapterSelection, BindGroupStats, WgpuBackend};
use crate::backend::testing::{open_or_skip, Device};
use crate::backend::{Backend, View};

pub(super) fn wgpu_or_skip(max_buffer: Option<u64>) -> Option<WgpuBackend> {
    let mut be = open_or_skip(Device::Wgpu, WgpuBackend::new(AdapterSelection::any()))?;
    if let Some(b) = max_buffer {
        be.set_max_buffer_bytes(b);
    }
    Some(be)
}

/// Deterministic values in [-1, 1).
pub(super) fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Runs `op` on views of the given lengths, each placed `pad` elements after the previous one in a single
/// allocation (so offsets are not all zero), and returns every view's contents afterwards.
pub(super) fn run(
    be: &mut dyn Backend,
    lens: &[usize],
    pad: usize,
    seed: u64,
    op: &dyn Fn(&mut dyn Backend, &[View]),
) -> Vec<Vec<f32>> {
    let total: usize = lens.iter().map(|l| l + pad).sum::<usize>() + pad;
    let all = be.alloc(total).unwrap();
    let mut views = Vec::new();
    let mut at = pad;
    for (i, &l) in lens.iter().enumerate() {
        let v = all.sub(at, l);
        be.upload(v, &values(seed + i as u64, l)).unwrap();
        views.push(v);
        at += l + pad;
    }
    op(be, &views);
    views
        .iter()
        .map(|&v| {
            let mut out = vec![0.0; v.len];
            be.download(v, &mut out).unwrap();
            out
        })
        .collect()
}

pub(super) fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], abs: f32, rel: f32) {
    for (g, w) in got.iter().zip(want) {
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= abs + rel * b.abs(),
                "{what}: element {i}: wgpu {a} vs cpu {b}"
            );
        }
    }
}

/// What changed in the bind-group counters between `before` and `after`.
pub(super) fn delta(before: BindGroupStats, after: BindGroupStats) -> BindGroupStats {
    BindGroupStats {
        hits: after.hits - before.hits,
        misses: after.misses - before.misses,
        uncached: after.uncached - before.uncached,
    }
}

pub(super) fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

pub(super) fn download(be: &mut WgpuBackend, v: View) -> Vec<f32> {
    let mut out = vec![0.0; v.len];
    be.download(v, &mut out).unwrap();
    out
}
