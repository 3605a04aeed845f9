//! The vec4 and texture-fed kernels against the CPU backend.

use super::{assert_close, run, wgpu_or_skip};
use crate::backend::cpu::CpuBackend;
use crate::backend::wgpu::WgpuBackend;
use crate::backend::{AddInplace, CopyInto, MatmulBackward, MatmulForward, ResidualForward};
use crate::backend::{Backend, MatmulShape, View, WeightLayout};

fn check_matmuls(be: &mut WgpuBackend) {
    let shapes = [
        (4, 4, 4),
        (1, 8, 4),
        (130, 68, 132),
        (257, 36, 260),
        (128, 128, 128),
        // Rows 256 and 768 bytes apart: on software adapters the texture-fed kernel.
        (130, 64, 192),
        (3, 12, 400),
    ];
    for (n, c, oc) in shapes {
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for bias in [true, false] {
                for pad in [0, 4, 6] {
                    let s = MatmulShape { n, c, oc, layout };
                    let lens = [n * oc, n * c, c * oc, oc];
                    let fwd = |be: &mut dyn Backend, v: &[View]| {
                        be.matmul_forward(
                            MatmulForward {
                                out: v[0],
                                inp: v[1],
                                weight: v[2],
                                bias: bias.then_some(v[3]),
                                shape: s,
                            }
                            .checked(),
                        )
                    };
                    let what = format!("matmul_forward {n}x{c}x{oc} {layout:?} bias={bias} pad={pad}");
                    let want = run(&mut CpuBackend::<f32>::new(), &lens, pad, 1, &fwd);
                    let got = run(be, &lens, pad, 1, &fwd);
                    assert_close(&what, &got, &want, 1e-5 * (c as f32).sqrt(), 1e-5);
                    let lens = [n * c, c * oc, oc, n * oc, n * c, c * oc];
                    let bwd = |be: &mut dyn Backend, v: &[View]| {
                        be.matmul_backward(
                            MatmulBackward {
                                dinp: v[0],
                                dweight: v[1],
                                dbias: bias.then_some(v[2]),
                                dout: v[3],
                                inp: v[4],
                                weight: v[5],
                                shape: s,
                            }
                            .checked(),
                        )
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
                ("residual_forward", &|be, v| {
                    be.residual_forward(
                        ResidualForward {
                            out: v[0],
                            a: v[1],
                            b: v[2],
                        }
                        .checked(),
                    )
                }),
                ("add_inplace", &|be, v| {
                    be.add_inplace(AddInplace { dst: v[0], src: v[1] }.checked())
                }),
                ("scale", &|be, v| be.scale(v[0], -0.37)),
                ("fill", &|be, v| be.fill(v[1], 1.25)),
                ("copy", &|be, v| be.copy(CopyInto { dst: v[0], src: v[2] }.checked())),
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

/// On a software adapter with 8-lane subgroups (unless it runs the hardware kernels only), matmuls whose
/// operands can be copied into textures take the texture-fed kernels (`matmul4t` for `x @ W`,
/// `matmul4t_nt` for `x @ W^T`: the tied LM head's layout and the input gradient; `matmul4t_tn` for
/// `X^T @ dY`, the weight gradient), match the CPU, repeat bit for bit and give the storage-buffer kernels'
/// bits; elsewhere those kernels do not exist. The shapes leave partial tiles, and fewer rows than a
/// subgroup has lanes (whose weight gradient, k = 5, is not a multiple of 4 and stays on the strided
/// kernel).
#[test]
fn texture_matmul_runs_on_software_adapters() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let report = be.adapter().clone();
    let textured = report.is_software && report.subgroup_sizes == Some((8, 8)) && !be.hardware_kernels_only();
    assert_eq!(be.has_tex_matmul(), textured, "{report}");
    type Op = Box<dyn Fn(&mut dyn Backend, &[View])>;
    let mut results: Vec<(Vec<usize>, Op, Vec<Vec<f32>>)> = Vec::new();
    for (n, c, oc) in [(200, 128, 320), (5, 64, 128)] {
        let shape = |layout| MatmulShape { n, c, oc, layout };
        let (nn, tn) = (shape(WeightLayout::InOut), shape(WeightLayout::OutIn));
        // (what, operand lengths, op, texture-fed dispatches per call)
        let cases: [(&str, Vec<usize>, Op, u64); 3] = [
            (
                "x @ W",
                vec![n * oc, n * c, c * oc, oc],
                Box::new(move |be, v| {
                    be.matmul_forward(
                        MatmulForward {
                            out: v[0],
                            inp: v[1],
                            weight: v[2],
                            bias: Some(v[3]),
                            shape: nn,
                        }
                        .checked(),
                    )
                }),
                1,
            ),
            (
                "x @ W^T",
                vec![n * oc, n * c, c * oc, oc],
                Box::new(move |be, v| {
                    be.matmul_forward(
                        MatmulForward {
                            out: v[0],
                            inp: v[1],
                            weight: v[2],
                            bias: Some(v[3]),
                            shape: tn,
                        }
                        .checked(),
                    )
                }),
                1,
            ),
            (
                "dinp = dout @ W^T, dW = x^T @ dout",
                vec![n * c, c * oc, n * oc, n * c, c * oc],
                Box::new(move |be, v| {
                    be.matmul_backward(
                        MatmulBackward {
                            dinp: v[0],
                            dweight: v[1],
                            dbias: None,
                            dout: v[2],
                            inp: v[3],
                            weight: v[4],
                            shape: nn,
                        }
                        .checked(),
                    )
                }),
                if n % 4 == 0 { 2 } else { 1 },
            ),
        ];
        for (what, lens, op, per_call) in cases {
            let before = be.tex_matmul_dispatches();
            let want = run(&mut CpuBackend::<f32>::new(), &lens, 0, 1, &*op);
            let got = run(&mut be, &lens, 0, 1, &*op);
            let again = run(&mut be, &lens, 0, 1, &*op);
            let used = be.tex_matmul_dispatches() - before;
            let expected = if textured { 2 * per_call } else { 0 };
            assert_eq!(used, expected, "{what}: texture-fed dispatches, {report}");
            assert_close(what, &got, &want, 1e-5 * (c.max(oc) as f32).sqrt(), 1e-5);
            assert_eq!(got, again, "{what}: run to run, the same bits");
            results.push((lens, op, got));
        }
    }
    // Each kernel sums each output's k terms in the same order as the storage-buffer kernel the same
    // operands take without textures: the same bits.
    be.without_tex_matmul();
    for (lens, op, got) in results {
        let storage = run(&mut be, &lens, 0, 1, &*op);
        let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&storage),
            "texture-fed and storage-buffer kernels differ"
        );
    }
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

/// One AdamW dispatch over many tensors, the decay inside its runs, gives the bits of one dispatch per
/// tensor with the decay or without it (a tensor that does not decay multiplies by exactly 1).
#[test]
fn adamw_over_decay_runs_matches_one_call_per_tensor_bit_for_bit() {
    use crate::backend::{AdamWStep, AdamWUpdate};
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let n = 10_000;
    let runs = [0u32, 1500, 1500, 4000, 7001, 9000];
    let step = AdamWStep {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step_size: 3e-2,
        bias_correction2_sqrt: 0.2,
        grad_scale: 0.7,
    };
    let lens = [n; 4]; // params, grads, m, v
    let once = run(&mut be, &lens, 5, 21, &|be, v| {
        let table = be.alloc_tokens(runs.len()).unwrap(); // [runs.len()]
        be.upload_tokens(table, &runs).unwrap();
        let (params, grads, m, v) = (v[0], v[1], v[2], v[3]);
        let decay_runs = Some(table);
        be.adamw(
            AdamWUpdate {
                params,
                grads,
                m,
                v,
                step,
                decay_runs,
            }
            .checked(),
        );
    });
    // The stretches between boundaries: 0..1500 decays, 1500..4000 decays (runs that touch), then none,
    // 7001..9000, none.
    let stretches = [
        (0, 1500, true),
        (1500, 4000, true),
        (4000, 7001, false),
        (7001, 9000, true),
        (9000, n, false),
    ];
    let per_tensor = run(&mut be, &lens, 5, 21, &|be, v| {
        for &(s, e, decays) in &stretches {
            let [params, grads, m, v] = [v[0], v[1], v[2], v[3]].map(|x| x.sub(s, e - s));
            let step = AdamWStep {
                weight_decay: if decays { step.weight_decay } else { 0.0 },
                ..step
            };
            be.adamw(
                AdamWUpdate {
                    params,
                    grads,
                    m,
                    v,
                    step,
                    decay_runs: None,
                }
                .checked(),
            );
        }
    });
    let bits = |x: &[Vec<f32>]| x.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&once) == bits(&per_tensor),
        "one dispatch over runs differs from per-tensor dispatches"
    );
}
