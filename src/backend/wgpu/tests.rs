//! The vec4 kernels against the CPU backend, on shapes the conformance suite does not reach (its matmuls
//! have odd sizes, so they take the strided kernel): n, k and strides multiples of 4, views at aligned and
//! unaligned offsets, and allocations split into small segments so that windows straddle them.

use super::{AdapterSelection, WgpuBackend};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, MatmulShape, View, WeightLayout};

fn wgpu_or_skip(max_buffer: Option<u64>) -> Option<WgpuBackend> {
    match WgpuBackend::new(AdapterSelection::any()) {
        Ok(mut be) => {
            if let Some(b) = max_buffer {
                be.set_max_buffer_bytes(b);
            }
            Some(be)
        }
        Err(e) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but no wgpu adapter: {e:#}"
            );
            eprintln!("SKIP: no wgpu adapter ({e:#})");
            None
        }
    }
}

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
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
fn run(
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

fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], abs: f32, rel: f32) {
    for (g, w) in got.iter().zip(want) {
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= abs + rel * b.abs(),
                "{what}: element {i}: wgpu {a} vs cpu {b}"
            );
        }
    }
}

fn check_matmuls(be: &mut WgpuBackend) {
    let shapes = [
        (4, 4, 4),
        (1, 8, 4),
        (130, 68, 132),
        (257, 36, 260),
        (128, 128, 128),
        (3, 12, 400),
    ];
    for (n, c, oc) in shapes {
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for bias in [true, false] {
                for pad in [0, 4, 6] {
                    let s = MatmulShape { n, c, oc, layout };
                    let lens = [n * oc, n * c, c * oc, oc];
                    let fwd =
                        |be: &mut dyn Backend, v: &[View]| be.matmul_forward(v[0], v[1], v[2], bias.then_some(v[3]), s);
                    let what = format!("matmul_forward {n}x{c}x{oc} {layout:?} bias={bias} pad={pad}");
                    let want = run(&mut CpuBackend::<f32>::new(), &lens, pad, 1, &fwd);
                    let got = run(be, &lens, pad, 1, &fwd);
                    assert_close(&what, &got, &want, 1e-5 * (c as f32).sqrt(), 1e-5);
                    let lens = [n * c, c * oc, oc, n * oc, n * c, c * oc];
                    let bwd = |be: &mut dyn Backend, v: &[View]| {
                        be.matmul_backward(v[0], v[1], bias.then_some(v[2]), v[3], v[4], v[5], s)
                    };
                    let what = format!("matmul_backward {n}x{c}x{oc} {layout:?} bias={bias} pad={pad}");
                    let want = run(&mut CpuBackend::<f32>::new(), &lens, pad, 2, &bwd);
                    let got = run(be, &lens, pad, 2, &bwd);
                    assert_close(&what, &got, &want, 1e-5 * (n.max(oc) as f32).sqrt(), 1e-5);
                }
            }
        }
    }
}

/// An elementwise op applied to views of one buffer.
type ElementwiseOp = dyn Fn(&mut dyn Backend, &[View]);

fn check_elementwise(be: &mut WgpuBackend) {
    for n in [1, 3, 4, 7, 1000, 70001] {
        for pad in [0, 4, 5] {
            let ops: [(&str, &ElementwiseOp); 5] = [
                ("residual_forward", &|be, v| be.residual_forward(v[0], v[1], v[2])),
                ("add_inplace", &|be, v| be.add_inplace(v[0], v[1])),
                ("scale", &|be, v| be.scale(v[0], -0.37)),
                ("fill", &|be, v| be.fill(v[1], 1.25)),
                ("copy", &|be, v| be.copy(v[0], v[2])),
            ];
            for (name, op) in ops {
                let want = run(&mut CpuBackend::<f32>::new(), &[n, n, n], pad, 3, op);
                let got = run(be, &[n, n, n], pad, 3, op);
                assert_close(&format!("{name} n{n} pad={pad}"), &got, &want, 0.0, 0.0);
            }
        }
    }
}

#[test]
fn vec4_kernels_match_cpu() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    check_matmuls(&mut be);
    check_elementwise(&mut be);
}

/// 256 KiB segments: the larger views straddle two buffers and go through gathered windows.
#[test]
fn vec4_kernels_match_cpu_segmented() {
    let Some(mut be) = wgpu_or_skip(Some(65536 * 4)) else {
        return;
    };
    check_matmuls(&mut be);
    check_elementwise(&mut be);
}
