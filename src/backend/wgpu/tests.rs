//! The vec4 kernels against the CPU backend, on shapes the conformance suite does not reach (its matmuls
//! have odd sizes, so they take the strided kernel): n, k and strides multiples of 4, views at aligned and
//! unaligned offsets, and allocations split into small segments so that windows straddle them. Then the
//! bind-group cache: a repeated sequence of ops (and a repeated training step) makes no new bind group,
//! parameters change under a cached one, temporaries bypass it, a replaced buffer is never rebound, and
//! the cache stays bounded. Then freeing (memory, bind groups, stale ids), device errors reaching the next
//! synchronisation point, and the loop budget with the hardware kernels only.

use super::{AdapterSelection, BindGroupStats, WgpuBackend, MAX_PENDING};
use crate::backend::cpu::CpuBackend;
use crate::backend::{AdamWStep, AttentionShape, Backend, BackendError, MatmulShape, TokenView, View, WeightLayout};
use crate::model::init::init_params;
use crate::model::{Gpt2, ModelConfig, ParamLayout};

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

/// On a software adapter with 8-lane subgroups (unless it runs the hardware kernels only), matmuls whose
/// operands can be copied into textures take the texture-fed kernels (`matmul4t` for `x @ W`,
/// `matmul4t_nt` for `x @ W^T`: the tied LM head's layout and the input gradient; `matmul4t_tn` for
/// `X^T @ dY`, the weight gradient), match the CPU, repeat bit for bit and give the storage-buffer kernels'
/// bits; elsewhere those kernels do not exist. The shapes
/// leave partial tiles, and fewer rows than a subgroup has lanes (whose weight gradient, k = 5, is not a
/// multiple of 4 and stays on the strided kernel).
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
                Box::new(move |be, v| be.matmul_forward(v[0], v[1], v[2], Some(v[3]), nn)),
                1,
            ),
            (
                "x @ W^T",
                vec![n * oc, n * c, c * oc, oc],
                Box::new(move |be, v| be.matmul_forward(v[0], v[1], v[2], Some(v[3]), tn)),
                1,
            ),
            (
                "dinp = dout @ W^T, dW = x^T @ dout",
                vec![n * c, c * oc, n * oc, n * c, c * oc],
                Box::new(move |be, v| be.matmul_backward(v[0], v[1], None, v[2], v[3], v[4], nn)),
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

/// What changed in the bind-group counters between `before` and `after`.
fn delta(before: BindGroupStats, after: BindGroupStats) -> BindGroupStats {
    BindGroupStats {
        hits: after.hits - before.hits,
        misses: after.misses - before.misses,
        uncached: after.uncached - before.uncached,
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn download(be: &mut WgpuBackend, v: View) -> Vec<f32> {
    let mut out = vec![0.0; v.len];
    be.download(v, &mut out).unwrap();
    out
}

const ADAMW: AdamWStep = AdamWStep {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
    step_size: 1e-2,
    bias_correction2_sqrt: 0.2,
    grad_scale: 0.5,
};

/// The tensors of [`forward_backward_update`], carved from one allocation at odd offsets.
struct StepViews {
    all: View,
    x: View,
    w: View,
    bias: View,
    y: View,
    g: View,
    r: View,
    dy: View,
    dx: View,
    dw: View,
    db: View,
    ln: View,
    mean: View,
    rstd: View,
    lw: View,
    lb: View,
    m: View,
    v: View,
}

const STEP_SHAPE: MatmulShape = MatmulShape {
    n: 8,
    c: 16,
    oc: 36,
    layout: WeightLayout::InOut,
};

fn step_views(be: &mut WgpuBackend) -> StepViews {
    let MatmulShape { n, c, oc, .. } = STEP_SHAPE;
    let lens = [
        n * c,
        c * oc,
        oc,
        n * oc,
        n * oc,
        n * oc,
        n * oc,
        n * c,
        c * oc,
        oc,
        n * c,
        n,
        n,
        c,
        c,
        c * oc,
        c * oc,
    ];
    // Three elements before each view, so that offsets are unaligned.
    let all = be.alloc(lens.iter().map(|l| l + 3).sum()).unwrap();
    let mut at = 0;
    let [x, w, bias, y, g, r, dy, dx, dw, db, ln, mean, rstd, lw, lb, m, v] = lens.map(|len| {
        at += 3 + len;
        all.sub(at - len, len)
    });
    StepViews {
        all,
        x,
        w,
        bias,
        y,
        g,
        r,
        dy,
        dx,
        dw,
        db,
        ln,
        mean,
        rstd,
        lw,
        lb,
        m,
        v,
    }
}

/// A forward, backward and AdamW update over `v`, from the same uploaded state every call; returns the
/// whole allocation afterwards and the `sum_squares` result.
fn forward_backward_update(be: &mut WgpuBackend, v: &StepViews) -> (Vec<f32>, f64) {
    be.upload(v.all, &values(11, v.all.len)).unwrap();
    let s = STEP_SHAPE;
    be.fill(v.dw, 0.0);
    be.fill(v.db, 0.0);
    be.matmul_forward(v.y, v.x, v.w, Some(v.bias), s);
    be.gelu_forward(v.g, v.y);
    be.scale(v.g, 0.5);
    be.residual_forward(v.r, v.g, v.y);
    let norm = be.sum_squares(v.r).unwrap();
    be.gelu_backward(v.dy, v.y, v.r);
    be.matmul_backward(v.dx, v.dw, Some(v.db), v.dy, v.x, v.w, s);
    be.layernorm_forward(v.ln, v.mean, v.rstd, v.x, v.lw, v.lb, s.n, s.c);
    be.add_inplace(v.dx, v.ln);
    be.adamw(v.w, v.dw, v.m, v.v, &ADAMW);
    (download(be, v.all), norm)
}

#[test]
fn repeated_ops_make_no_new_bind_group() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let views = step_views(&mut be);
    let start = be.bind_group_stats();
    let (first, first_norm) = forward_backward_update(&mut be, &views);
    let after_first = be.bind_group_stats();
    let (second, second_norm) = forward_backward_update(&mut be, &views);
    let first_run = delta(start, after_first);
    let second_run = delta(after_first, be.bind_group_stats());
    assert!(first_run.misses > 0, "the first run made no bind group: {first_run:?}");
    assert_eq!(
        second_run.misses, 0,
        "the second run made new bind groups: {second_run:?}"
    );
    assert_eq!(
        second_run.uncached, 0,
        "the second run made uncached bind groups: {second_run:?}"
    );
    let dispatches = first_run.hits + first_run.misses + first_run.uncached;
    assert_eq!(second_run.hits, dispatches, "every dispatch of the second run hits");
    assert_eq!(first_norm.to_bits(), second_norm.to_bits());
    assert!(bits(&first) == bits(&second), "the second run's results differ");
}

/// Steps after the first find every bind group cached, except the embedding backward's per-call index
/// (one uncached dispatch per step at this size).
#[test]
fn training_steps_after_the_first_reuse_their_bind_groups() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let cfg = ModelConfig::tiny();
    let (b, t) = (2, 16);
    let layout = ParamLayout::new(&cfg);
    let init = init_params(&cfg, &layout, 5);
    let mut model = Gpt2::new(&mut be, cfg.clone(), &init).unwrap();
    let mut stats = Vec::new();
    for step in 0..3u32 {
        let inputs: Vec<u32> = (0..(b * t) as u32)
            .map(|i| (i * 7 + step) % cfg.vocab_size as u32)
            .collect();
        let targets: Vec<u32> = inputs.iter().map(|x| (x + 1) % cfg.vocab_size as u32).collect();
        let before = be.bind_group_stats();
        model.forward(&mut be, &inputs, &targets, b, t).unwrap();
        model.zero_grads(&mut be);
        model.backward(&mut be, 1.0 / (b * t) as f32).unwrap();
        be.sum_squares(model.grads).unwrap();
        be.synchronize().unwrap();
        stats.push(delta(before, be.bind_group_stats()));
    }
    assert!(stats[0].misses > 0);
    for (step, s) in stats.iter().enumerate().skip(1) {
        assert_eq!(s.misses, 0, "step {step} made new bind groups: {s:?}");
        assert_eq!(s.uncached, 0, "step {step}: every window is cached: {s:?}");
        assert_eq!(s.hits + s.uncached, stats[0].hits + stats[0].misses + stats[0].uncached);
    }
}

/// The parameters are not part of the key: two dispatches of one cached bind group in one batch, and more
/// dispatches than the uniform ring has slots, each read their own parameters.
#[test]
fn parameters_change_under_a_cached_bind_group() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let (x, acc) = (be.alloc(7).unwrap(), be.alloc(7).unwrap());
    be.upload(x, &[1.0; 7]).unwrap();
    let before = be.bind_group_stats();
    be.scale(x, 2.0);
    be.scale(x, 3.0);
    assert!(
        delta(before, be.bind_group_stats()).hits >= 2,
        "the second scale reuses the bind groups"
    );
    assert_eq!(download(&mut be, x), vec![6.0; 7]);
    be.fill(acc, 0.0);
    let rounds = 2 * MAX_PENDING + 3;
    for i in 0..rounds {
        be.fill(x, i as f32);
        be.add_inplace(acc, x);
    }
    let want = (rounds * (rounds - 1) / 2) as f32;
    assert_eq!(download(&mut be, acc), vec![want; 7]);
}

/// Windows over temporary buffers (a view straddling two segments) are bound without the cache, and still
/// give the CPU's results.
#[test]
fn temporary_buffers_bypass_the_cache() {
    let Some(mut be) = wgpu_or_skip(Some(65536 * 4)) else {
        return;
    };
    let seg = be.seg_elems;
    let (all, other) = (be.alloc(2 * seg).unwrap(), be.alloc(100).unwrap());
    let straddling = all.sub(seg - 50, 100);
    let (a, b) = (values(1, 100), values(2, 100));
    be.upload(other, &b).unwrap();
    for _ in 0..2 {
        be.upload(straddling, &a).unwrap();
        let (cached, before) = (be.cached_bind_groups(), be.bind_group_stats());
        be.add_inplace(straddling, other);
        let d = delta(before, be.bind_group_stats());
        assert_eq!((d.hits, d.misses), (0, 0), "{d:?}");
        assert!(d.uncached > 0);
        assert_eq!(be.cached_bind_groups(), cached);
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_eq!(download(&mut be, straddling), want);
    }
}

/// The embedding backward's token index lives in one persistent buffer: from the second call on every
/// dispatch hits the bind-group cache, and two calls recorded in one batch with different tokens (the index
/// is rewritten between them) each give the CPU's result.
#[test]
fn embedding_index_is_cached_and_rewritten_safely() {
    let Some(mut be) = wgpu_or_skip(None) else {
        return;
    };
    let (b_, t, c, v) = (1, 4, 8, 5);
    let token_sets: [[u32; 4]; 2] = [[3, 1, 3, 0], [4, 4, 2, 1]];
    let mut cpu = CpuBackend::<f32>::new();
    let dout = be.alloc(t * c).unwrap();
    be.upload(dout, &values(3, t * c)).unwrap();
    let cpu_dout = cpu.alloc(t * c).unwrap();
    cpu.upload(cpu_dout, &values(3, t * c)).unwrap();
    let mut gpu_out = Vec::new();
    let mut cpu_out = Vec::new();
    let mut token_views = Vec::new();
    // Every upload first: an upload submits the recorded work, and the two calls must share one batch.
    for toks in &token_sets {
        let tokens: TokenView = be.alloc_tokens(b_ * t).unwrap();
        be.upload_tokens(tokens, toks).unwrap();
        let cpu_tokens = cpu.alloc_tokens(b_ * t).unwrap();
        cpu.upload_tokens(cpu_tokens, toks).unwrap();
        token_views.push((tokens, cpu_tokens));
        gpu_out.push((be.alloc(v * c).unwrap(), be.alloc(t * c).unwrap()));
        cpu_out.push((cpu.alloc(v * c).unwrap(), cpu.alloc(t * c).unwrap()));
    }
    for round in 0..token_sets.len() {
        let ((dwte, dwpe), (cpu_dwte, cpu_dwpe)) = (gpu_out[round], cpu_out[round]);
        let (tokens, cpu_tokens) = token_views[round];
        let before = be.bind_group_stats();
        be.encoder_backward(dwte, dwpe, dout, tokens, b_, t, c);
        cpu.encoder_backward(cpu_dwte, cpu_dwpe, cpu_dout, cpu_tokens, b_, t, c);
        let d = delta(before, be.bind_group_stats());
        assert_eq!(d.uncached, 0, "round {round}: the index window is cached: {d:?}");
    }
    // Round 0 again, on the same buffers: nothing new to build. It accumulates, so the CPU repeats it too.
    let ((dwte, dwpe), (cpu_dwte, cpu_dwpe)) = (gpu_out[0], cpu_out[0]);
    let (tokens, cpu_tokens) = token_views[0];
    be.synchronize().unwrap();
    let before = be.bind_group_stats();
    be.encoder_backward(dwte, dwpe, dout, tokens, b_, t, c);
    cpu.encoder_backward(cpu_dwte, cpu_dwpe, cpu_dout, cpu_tokens, b_, t, c);
    let d = delta(before, be.bind_group_stats());
    assert_eq!((d.misses, d.uncached), (0, 0), "a repeated call hits the cache: {d:?}");
    for ((dwte, dwpe), (cpu_dwte, cpu_dwpe)) in gpu_out.into_iter().zip(cpu_out) {
        for (gpu_view, cpu_view) in [(dwte, cpu_dwte), (dwpe, cpu_dwpe)] {
            let mut want = vec![0.0; cpu_view.len];
            cpu.download(cpu_view, &mut want).unwrap();
            assert_close("encoder_backward", &[download(&mut be, gpu_view)], &[want], 1e-6, 1e-6);
        }
    }
}

/// `sum_squares` replaces its scratch buffer when a larger one is needed: the old buffer's entries are
/// dropped, and a later call binds the new buffer (a miss) rather than a stale entry.
#[test]
fn replaced_buffer_is_never_rebound() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let (small, large) = (be.alloc(5000).unwrap(), be.alloc(50_000).unwrap());
    let (xs, xl) = (values(4, 5000), values(5, 50_000));
    be.upload(small, &xs).unwrap();
    be.upload(large, &xl).unwrap();
    // f32 block sums added in f64, as in the conformance suite.
    let check = |got: f64, x: &[f32]| {
        let want = crate::backend::cpu::ops::sum_squares(x);
        assert!((got - want).abs() <= 1e-6 * want, "sum_squares: {got} vs {want}");
    };
    check(be.sum_squares(small).unwrap(), &xs);
    let old = be.partials.as_ref().unwrap().0.id;
    assert!(be.bind_groups.binds(old));
    check(be.sum_squares(large).unwrap(), &xl);
    assert_ne!(
        be.partials.as_ref().unwrap().0.id,
        old,
        "a larger scratch buffer replaced the old one"
    );
    assert!(!be.bind_groups.binds(old), "entries of the replaced buffer are dropped");
    let before = be.bind_group_stats();
    check(be.sum_squares(small).unwrap(), &xs);
    assert_eq!(
        delta(before, be.bind_group_stats()).misses,
        1,
        "the new scratch buffer is bound afresh"
    );
}

#[test]
fn cache_is_cleared_past_its_capacity() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    be.bind_groups.set_capacity(8);
    let views: Vec<View> = (0..20).map(|_| be.alloc(3).unwrap()).collect();
    for (i, &v) in views.iter().enumerate() {
        be.fill(v, i as f32);
        assert!(be.cached_bind_groups() <= 8);
    }
    for (i, &v) in views.iter().enumerate() {
        assert_eq!(download(&mut be, v), vec![i as f32; 3]);
    }
}

/// Two views of one buffer whose windows differ only in where they start get bind groups of their own.
#[test]
fn windows_differing_only_in_start_are_bound_apart() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let all = be.alloc(4096).unwrap();
    let (a, b) = (all.sub(0, 8), all.sub(2048, 8));
    be.fill(all, 0.0);
    be.fill(a, 1.0);
    be.fill(b, 2.0);
    assert_eq!(download(&mut be, a), vec![1.0; 8]);
    assert_eq!(download(&mut be, b), vec![2.0; 8]);
}

#[test]
fn tiny_buffer_caps_still_leave_room_for_a_reduction_block() {
    for bytes in [0, 1, 4096, 16_384, 16_500] {
        let Some(be) = wgpu_or_skip(Some(bytes)) else { return };
        assert!(
            be.max_window_elems() >= super::SUM_BLOCK,
            "cap {bytes}: windows of {} elements",
            be.max_window_elems()
        );
    }
}

/// GPT-2's own attention shape (T = 1024, 64-wide heads) needs about 20 K loop iterations per invocation,
/// under the 65535 after which llvmpipe silently stops a shader's loops (one term per iteration needed
/// 66 K, and the last rows came out wrong); forward and backward match the CPU. On a software adapter a
/// shape past the budget is refused, its error returned by the next synchronisation, instead of computed
/// partly.
#[test]
fn attention_fits_the_software_loop_budget_at_gpt2_length() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let s = AttentionShape {
        b: 1,
        t: 1024,
        c: 64,
        nh: 1,
    };
    let (b, t, c, nh) = (s.b, s.t, s.c, s.nh);
    // out, att, qkv | dqkv, datt, dout
    let lens = [
        b * t * c,
        b * nh * t * t,
        b * t * 3 * c,
        b * t * 3 * c,
        b * nh * t * t,
        b * t * c,
    ];
    let op = move |be: &mut dyn Backend, v: &[View]| {
        be.attention_forward(v[0], v[1], v[2], s);
        be.attention_backward(v[3], v[4], v[5], v[2], v[1], s);
    };
    let want = run(&mut CpuBackend::<f32>::new(), &lens, 0, 3, &op);
    let got = run(&mut be, &lens, 0, 3, &op);
    assert_close("attention at T = 1024", &got, &want, 2e-5, 1e-4);

    if be.adapter().is_software {
        let long = AttentionShape {
            b: 1,
            t: 4096,
            c: 64,
            nh: 1,
        };
        let (out, att, qkv) = (
            be.alloc(4096 * 64).unwrap(),
            be.alloc(4096 * 4096).unwrap(),
            be.alloc(4096 * 192).unwrap(),
        );
        be.attention_forward(out, att, qkv, long);
        let err = be.synchronize().expect_err("T = 4096 exceeds the loop budget");
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::ShapeUnsupported { op, .. }) if op == "attention"),
            "{err:#}"
        );
        assert!(format!("{err:#}").contains("stops a shader's loops"), "{err:#}");
        be.synchronize().expect("a refusal is reported once");
    }
}

/// A training run whose shapes exceed llvmpipe's loop budget is refused before any work, with the limit
/// named; GPT-2's own shapes at a modest batch are accepted. Hardware adapters accept both.
#[test]
fn step_shapes_past_the_software_loop_budget_are_refused_up_front() {
    let Some(be) = wgpu_or_skip(None) else { return };
    be.check_step_shape(8, 1024, 768, 12).expect("GPT-2 at 8 x 1024 tokens");
    let big = be.check_step_shape(128, 1024, 768, 12);
    if be.adapter().is_software {
        let err = big.expect_err("128 x 1024 tokens exceed the budget");
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::ShapeUnsupported { .. })),
            "{err:#}"
        );
        let text = format!("{err:#}");
        assert!(
            text.contains("stops a shader's loops") && text.contains("batch size 128 and sequence length 1024"),
            "{text}"
        );
        assert!(!text.contains("--"), "no command-line flags in backend errors: {text}");
    } else {
        big.expect("hardware adapters have no loop budget");
    }
}

/// With only the kernels a hardware adapter runs, a software adapter still refuses what its loop budget
/// cannot compute: a weight gradient summing more tokens than the budget (k = 70000 on the strided kernel)
/// and a training shape past it; both within budget on hardware adapters.
#[test]
fn hardware_kernels_keep_the_loop_budget() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    be.use_hardware_kernels_only();
    assert!(be.hardware_kernels_only() && !be.row_kernels() && !be.has_tex_matmul());
    let s = MatmulShape {
        n: 70_000,
        c: 4,
        oc: 4,
        layout: WeightLayout::InOut,
    };
    let [dinp, dweight, dout, inp, weight] =
        [s.n * s.c, s.c * s.oc, s.n * s.oc, s.n * s.c, s.c * s.oc].map(|len| be.alloc(len).unwrap());
    be.matmul_backward(dinp, dweight, None, dout, inp, weight, s);
    let result = be.synchronize();
    let step = be.check_step_shape(128, 1024, 768, 12);
    if be.adapter().is_software {
        let err = result.expect_err("k = 70000 exceeds the loop budget");
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::ShapeUnsupported { op, .. }) if op == "matmul"),
            "{err:#}"
        );
        step.expect_err("128 x 1024 tokens exceed the budget");
    } else {
        result.unwrap();
        step.unwrap();
    }
}

/// Freeing an allocation returns its memory, drops the bind groups that bind it, and never lets its id
/// reach a later buffer: the next allocation gets a new id and new bind groups, and computes right.
#[test]
fn freed_buffers_release_memory_and_bind_groups() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let base = be.allocated_bytes();
    let old = be.alloc(1000).unwrap();
    let tokens = be.alloc_tokens(10).unwrap();
    assert_eq!(be.allocated_bytes(), base + 4000 + 40);
    be.fill(old, 2.0);
    let old_id = be.allocation(old.buf).segs[0].id;
    assert!(be.bind_groups.binds(old_id));
    be.free(old);
    be.free_tokens(tokens);
    assert_eq!(be.allocated_bytes(), base);
    assert!(!be.bind_groups.binds(old_id), "entries of the freed buffer are dropped");
    let new = be.alloc(1000).unwrap();
    assert_ne!(new.buf, old.buf, "ids are never reused");
    assert_ne!(be.allocation(new.buf).segs[0].id, old_id);
    let before = be.bind_group_stats();
    be.fill(new, 3.0);
    let d = delta(before, be.bind_group_stats());
    assert_eq!((d.hits, d.misses), (0, 1), "the new buffer is bound afresh: {d:?}");
    assert_eq!(download(&mut be, new), vec![3.0; 1000]);
    be.synchronize().unwrap();
}

/// A view into a freed buffer, or a second free, is a programming error: a panic, never another buffer.
#[test]
fn views_into_freed_buffers_panic() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let v = be.alloc(8).unwrap();
    be.free(v);
    let stale = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.fill(v, 1.0)));
    assert!(stale.is_err(), "a view into a freed buffer");
    let twice = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.free(v)));
    assert!(twice.is_err(), "a second free");
}

/// A model whose batch shape changes frees the old activations: memory goes back to what the new shape
/// needs, and returning to a shape gives the same memory and the same bits.
#[test]
fn model_frees_activations_when_the_shape_changes() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let mut model = Gpt2::new(&mut be, cfg.clone(), &init_params(&cfg, &layout, 5)).unwrap();
    let batch =
        |b: usize, t: usize| -> Vec<u32> { (0..(b * t) as u32).map(|i| i * 7 % cfg.vocab_size as u32).collect() };
    let mut run = |be: &mut WgpuBackend, b: usize, t: usize| {
        let x = batch(b, t);
        let loss = model.forward(be, &x, &x, b, t).unwrap();
        (loss, be.allocated_bytes())
    };
    let (loss_large, large) = run(&mut be, 2, 16);
    let (_, small) = run(&mut be, 1, 8);
    assert!(small < large, "{small} >= {large}");
    let (again, large_again) = run(&mut be, 2, 16);
    assert_eq!(large_again, large);
    assert_eq!(again.to_bits(), loss_large.to_bits());
}

/// An allocation past the adapter's `max_buffer_size` is refused with a typed error before any memory is
/// asked for.
#[test]
fn allocations_past_the_buffer_limit_are_refused() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let Ok(len) = usize::try_from(be.ctx.limits.max_buffer_size / 4 + 1) else {
        return;
    };
    let err = be.alloc_tokens(len).expect_err("past max_buffer_size");
    assert!(
        matches!(err.downcast_ref(), Some(BackendError::ShapeUnsupported { .. })),
        "{err:#}"
    );
}

/// A device error (here a validation error, provoked on purpose) does not panic: it is returned by the
/// next `download`, `sum_squares` or `synchronize`, once, and the backend works on.
#[test]
fn device_errors_reach_the_next_synchronisation_point() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let x = be.alloc(5).unwrap();
    be.upload(x, &[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let provoke = |be: &WgpuBackend| {
        // MAP_READ combines only with COPY_DST without MAPPABLE_PRIMARY_BUFFERS, which the device lacks.
        be.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("invalid on purpose"),
            size: 16,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let is_driver = |e: &anyhow::Error| matches!(e.downcast_ref(), Some(BackendError::Driver(_)));
    let _invalid = provoke(&be);
    let err = be.download(x, &mut [0.0; 5]).expect_err("download reports it");
    assert!(is_driver(&err), "{err:#}");
    let _invalid = provoke(&be);
    let err = be.sum_squares(x).expect_err("sum_squares reports it");
    assert!(is_driver(&err), "{err:#}");
    let _invalid = provoke(&be);
    let err = be.synchronize().expect_err("synchronize reports it");
    assert!(is_driver(&err), "{err:#}");
    be.synchronize().expect("reported once");
    assert_eq!(be.sum_squares(x).unwrap(), 55.0);
}

/// A lost device (destroyed here) is an error at every synchronisation point after it, not a panic.
#[test]
fn a_lost_device_is_an_error() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let x = be.alloc(5).unwrap();
    be.ctx.device.destroy();
    for _ in 0..2 {
        let err = be.synchronize().expect_err("the device is gone");
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::DeviceLost(_))),
            "{err:#}"
        );
    }
    let err = be.download(x, &mut [0.0; 5]).expect_err("the device is gone");
    assert!(
        matches!(err.downcast_ref(), Some(BackendError::DeviceLost(_))),
        "{err:#}"
    );
}
