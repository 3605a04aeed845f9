//! The bind-group cache: what hits, what misses, what bypasses it, and that it stays bounded.

use super::{assert_close, bits, delta, download, values, wgpu_or_skip};
use crate::backend::cpu::CpuBackend;
use crate::backend::wgpu::{WgpuBackend, MAX_PENDING};
use crate::backend::{AdamWStep, Backend, MatmulShape, TokenView, View, WeightLayout};
use crate::backend::{
    AdamWUpdate, AddInplace, EncoderBackward, EncoderShape, GeluBackward, GeluForward, LayerNormForward,
    MatmulBackward, MatmulForward, ResidualForward, RowsShape,
};
use crate::model::init::init_params;
use crate::model::{Gpt2, ModelConfig, ParamLayout};

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
    be.matmul_forward(
        MatmulForward {
            out: v.y,
            inp: v.x,
            weight: v.w,
            bias: Some(v.bias),
            shape: s,
        }
        .checked(),
    );
    be.gelu_forward(GeluForward { out: v.g, inp: v.y }.checked());
    be.scale(v.g, 0.5);
    be.residual_forward(
        ResidualForward {
            out: v.r,
            a: v.g,
            b: v.y,
        }
        .checked(),
    );
    let norm = be.sum_squares(v.r).unwrap();
    be.gelu_backward(
        GeluBackward {
            dinp: v.dy,
            inp: v.y,
            dout: v.r,
        }
        .checked(),
    );
    be.matmul_backward(
        MatmulBackward {
            dinp: v.dx,
            dweight: v.dw,
            dbias: Some(v.db),
            dout: v.dy,
            inp: v.x,
            weight: v.w,
            shape: s,
        }
        .checked(),
    );
    be.layernorm_forward(
        LayerNormForward {
            out: v.ln,
            mean: v.mean,
            rstd: v.rstd,
            inp: v.x,
            weight: v.lw,
            bias: v.lb,
            shape: RowsShape { n: s.n, c: s.c },
        }
        .checked(),
    );
    be.add_inplace(AddInplace { dst: v.dx, src: v.ln }.checked());
    be.adamw(
        AdamWUpdate {
            params: v.w,
            grads: v.dw,
            m: v.m,
            v: v.v,
            step: ADAMW,
            decay_runs: None,
        }
        .checked(),
    );
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
        be.add_inplace(AddInplace { dst: acc, src: x }.checked());
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
        be.add_inplace(
            AddInplace {
                dst: straddling,
                src: other,
            }
            .checked(),
        );
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
        be.encoder_backward(
            EncoderBackward {
                dwte,
                dwpe,
                dout,
                tokens,
                shape: EncoderShape { b: b_, t, c },
            }
            .checked(),
        );
        cpu.encoder_backward(
            EncoderBackward {
                dwte: cpu_dwte,
                dwpe: cpu_dwpe,
                dout: cpu_dout,
                tokens: cpu_tokens,
                shape: EncoderShape { b: b_, t, c },
            }
            .checked(),
        );
        let d = delta(before, be.bind_group_stats());
        assert_eq!(d.uncached, 0, "round {round}: the index window is cached: {d:?}");
    }
    // Round 0 again, on the same buffers: nothing new to build. It accumulates, so the CPU repeats it too.
    let ((dwte, dwpe), (cpu_dwte, cpu_dwpe)) = (gpu_out[0], cpu_out[0]);
    let (tokens, cpu_tokens) = token_views[0];
    be.synchronize().unwrap();
    let before = be.bind_group_stats();
    be.encoder_backward(
        EncoderBackward {
            dwte,
            dwpe,
            dout,
            tokens,
            shape: EncoderShape { b: b_, t, c },
        }
        .checked(),
    );
    cpu.encoder_backward(
        EncoderBackward {
            dwte: cpu_dwte,
            dwpe: cpu_dwpe,
            dout: cpu_dout,
            tokens: cpu_tokens,
            shape: EncoderShape { b: b_, t, c },
        }
        .checked(),
    );
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
