//! Finite-difference gradient checks, in f64, for every op of the CPU reference backend and for the whole
//! GPT-2 model. Each op's backward is checked against central differences of `L = sum(out * r)` for a random
//! `r`; tolerance: |analytic - numeric| <= 1e-6 * max(1, |numeric|) with step h = 1e-5 for the ops (the
//! truncation error of a central difference is O(h^2) ~ 1e-10, rounding O(eps/h) ~ 1e-11) and h = 1e-6 for
//! the whole model (see `H_MODEL`).

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain::backend::cpu::{ops, CpuBackend};
use ringtrain::backend::{AttentionShape, MatmulShape, WeightLayout};
use ringtrain::model::{init::init_params, Gpt2, ModelConfig};

const H: f64 = 1e-5;
/// The whole-model check's step. Its init is scaled up tenfold, which makes the loss curved enough that the
/// O(H^2) truncation error of a 1e-5 step reaches 3e-6 on some embedding entries (seen on `wte[68]`); at
/// 1e-6 the truncation error is 100x smaller while f64 rounding (about 1e-16 * loss / H) stays near 1e-10.
const H_MODEL: f64 = 1e-6;
const TOL: f64 = 1e-6;

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-1.0..1.0) * scale).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Central-difference check of `analytic` = d loss / d x for every index of `x` (or a sample of them).
fn check(name: &str, x: &mut [f64], analytic: &[f64], loss: &mut dyn FnMut(&[f64]) -> f64, sample: Option<usize>) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let indices: Vec<usize> = match sample {
        Some(k) if k < x.len() => {
            let mut rng = ChaCha8Rng::seed_from_u64(x.len() as u64);
            (0..k).map(|_| rng.random_range(0..x.len())).collect()
        }
        _ => (0..x.len()).collect(),
    };
    for i in indices {
        let orig = x[i];
        x[i] = orig + H;
        let plus = loss(x);
        x[i] = orig - H;
        let minus = loss(x);
        x[i] = orig;
        let numeric = (plus - minus) / (2.0 * H);
        let err = (analytic[i] - numeric).abs();
        assert!(
            err <= TOL * numeric.abs().max(1.0),
            "{name}[{i}]: analytic {} vs numeric {numeric} (err {err:e})",
            analytic[i]
        );
    }
}

#[test]
fn layernorm_gradients() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (n, c) = (5, 7);
    let mut x = random(&mut rng, n * c, 2.0);
    let mut w = random(&mut rng, c, 1.0);
    let mut b = random(&mut rng, c, 1.0);
    let r = random(&mut rng, n * c, 1.0);
    let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        ops::layernorm_forward(&mut out, &mut mean, &mut rstd, x, w, b, c);
        (out, mean, rstd)
    };
    let (_, mean, rstd) = fwd(&x, &w, &b);
    // Start from non-zero gradients to check accumulation (+=).
    let (mut dx, mut dw, mut db) = (vec![0.5; n * c], vec![0.25; c], vec![-0.5; c]);
    ops::layernorm_backward(&mut dx, &mut dw, &mut db, &r, &x, &w, &mean, &rstd, c);
    dx.iter_mut().for_each(|v| *v -= 0.5);
    dw.iter_mut().for_each(|v| *v -= 0.25);
    db.iter_mut().for_each(|v| *v += 0.5);
    let (w0, b0, x0) = (w.clone(), b.clone(), x.clone());
    check("ln.dx", &mut x, &dx, &mut |x| dot(&fwd(x, &w0, &b0).0, &r), None);
    check("ln.dw", &mut w, &dw, &mut |w| dot(&fwd(&x0, w, &b0).0, &r), None);
    check("ln.db", &mut b, &db, &mut |b| dot(&fwd(&x0, &w0, b).0, &r), None);
}

#[test]
fn matmul_gradients_both_layouts() {
    for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let s = MatmulShape {
            n: 5,
            c: 7,
            oc: 3,
            layout,
        };
        let mut x = random(&mut rng, s.n * s.c, 1.0);
        let mut w = random(&mut rng, s.c * s.oc, 1.0);
        let mut b = random(&mut rng, s.oc, 1.0);
        let r = random(&mut rng, s.n * s.oc, 1.0);
        let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
            let mut out = vec![0.0; s.n * s.oc];
            ops::matmul_forward(&mut out, x, w, Some(b), s);
            dot(&out, &r)
        };
        let (mut dx, mut dw, mut db) = (vec![9.0; s.n * s.c], vec![0.0; s.c * s.oc], vec![0.0; s.oc]);
        ops::matmul_backward(&mut dx, &mut dw, Some(&mut db), &r, &x, &w, s);
        let (w0, b0, x0) = (w.clone(), b.clone(), x.clone());
        check("mm.dx", &mut x, &dx, &mut |x| fwd(x, &w0, &b0), None);
        check("mm.dw", &mut w, &dw, &mut |w| fwd(&x0, w, &b0), None);
        check("mm.db", &mut b, &db, &mut |b| fwd(&x0, &w0, b), None);
    }
}

#[test]
fn attention_gradients() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let s = AttentionShape {
        b: 2,
        t: 5,
        c: 6,
        nh: 2,
    };
    let mut qkv = random(&mut rng, s.b * s.t * 3 * s.c, 1.0);
    let r = random(&mut rng, s.b * s.t * s.c, 1.0);
    let fwd = |qkv: &[f64]| {
        let (mut out, mut att) = (vec![0.0; s.b * s.t * s.c], vec![0.0; s.b * s.nh * s.t * s.t]);
        ops::attention_forward(&mut out, &mut att, qkv, s);
        (out, att)
    };
    let (_, att) = fwd(&qkv);
    // Causality: probabilities above the diagonal are exactly zero and rows sum to one.
    for row in att.chunks(s.t).enumerate() {
        let tq = row.0 % s.t;
        assert!(row.1[tq + 1..].iter().all(|&p| p == 0.0));
        assert!((row.1.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    }
    let (mut dqkv, mut datt) = (vec![7.0; qkv.len()], vec![0.0; att.len()]);
    ops::attention_backward(&mut dqkv, &mut datt, &r, &qkv, &att, s);
    check("attn.dqkv", &mut qkv, &dqkv, &mut |q| dot(&fwd(q).0, &r), None);
}

#[test]
fn gelu_gradients() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut x = random(&mut rng, 50, 4.0);
    let r = random(&mut rng, 50, 1.0);
    let fwd = |x: &[f64]| {
        let mut out = vec![0.0; x.len()];
        ops::gelu_forward(&mut out, x);
        dot(&out, &r)
    };
    let mut dx = vec![0.0; 50];
    ops::gelu_backward(&mut dx, &x, &r);
    check("gelu.dx", &mut x, &dx, &mut |x| fwd(x), None);
}

#[test]
fn crossentropy_gradients() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (n, v) = (4, 11);
    let mut logits = random(&mut rng, n * v, 3.0);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 3) % v as u32).collect();
    let fwd = |x: &[f64]| {
        let mut losses = vec![0.0; n];
        ops::crossentropy_forward(&mut losses, x, &targets, v);
        losses.iter().sum::<f64>() / n as f64
    };
    let mut d = logits.clone();
    ops::crossentropy_backward_inplace(&mut d, &targets, v, 1.0 / n as f64);
    check("ce.dlogits", &mut logits, &d, &mut |x| fwd(x), None);
}

#[test]
fn encoder_gradients() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let (b, t, c, v) = (2, 3, 4, 5);
    let tokens = [1u32, 4, 1, 0, 1, 3];
    let mut wte = random(&mut rng, v * c, 1.0);
    let mut wpe = random(&mut rng, t * c, 1.0);
    let r = random(&mut rng, b * t * c, 1.0);
    let fwd = |wte: &[f64], wpe: &[f64]| {
        let mut out = vec![0.0; b * t * c];
        ops::encoder_forward(&mut out, &tokens, wte, wpe, t, c);
        dot(&out, &r)
    };
    let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    ops::encoder_backward(&mut dwte, &mut dwpe, &r, &tokens, t, c);
    let (wte0, wpe0) = (wte.clone(), wpe.clone());
    check("enc.dwte", &mut wte, &dwte, &mut |w| fwd(w, &wpe0), None);
    check("enc.dwpe", &mut wpe, &dwpe, &mut |w| fwd(&wte0, w), None);
}

#[test]
fn residual_and_add_are_exact() {
    let (a, b) = ([1.0, 2.0, 3.0], [0.5, -2.0, 4.0]);
    let mut out = [0.0; 3];
    ops::residual_forward(&mut out, &a, &b);
    assert_eq!(out, [1.5, 0.0, 7.0]);
    ops::add_inplace(&mut out, &a);
    assert_eq!(out, [2.5, 2.0, 10.0]);
}

/// The whole model in f64: the analytic gradient of the mean loss against central differences, on a
/// sample of entries of every tensor.
#[test]
fn whole_model_gradients() {
    let cfg = ModelConfig {
        n_layer: 2,
        n_embd: 8,
        n_head: 2,
        vocab_size: 13,
        n_positions: 6,
    };
    let layout = ringtrain::model::ParamLayout::new(&cfg);
    let init = init_params(&cfg, &layout, 7);
    // Scale the init up so the gradient is not dominated by tiny weights.
    let init: Vec<f32> = init.iter().map(|x| x * 10.0).collect();
    let mut be = CpuBackend::<f64>::new();
    let mut model = Gpt2::new(&mut be, cfg.clone(), &init).unwrap();
    let (b, t) = (2, 5);
    let inputs: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 5 + 1) % 13).collect();
    let targets: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7 + 3) % 13).collect();
    let mean_loss = |be: &mut CpuBackend<f64>, model: &mut Gpt2| -> f64 {
        model.forward(be, &inputs, &targets, b, t).unwrap();
        let losses = be.slice(model.losses_view().unwrap());
        losses.iter().sum::<f64>() / losses.len() as f64
    };
    mean_loss(&mut be, &mut model);
    model.zero_grads(&mut be);
    model.backward(&mut be, 1.0 / (b * t) as f32).unwrap();
    let grads = be.slice(model.grads).to_vec();
    let params_view = model.params;
    for spec in layout.specs.clone() {
        let mut rng = ChaCha8Rng::seed_from_u64(spec.offset as u64);
        for _ in 0..6 {
            let i = spec.offset + rng.random_range(0..spec.len);
            let orig = be.slice(params_view)[i];
            be.slice_mut(params_view)[i] = orig + H_MODEL;
            let plus = mean_loss(&mut be, &mut model);
            be.slice_mut(params_view)[i] = orig - H_MODEL;
            let minus = mean_loss(&mut be, &mut model);
            be.slice_mut(params_view)[i] = orig;
            let numeric = (plus - minus) / (2.0 * H_MODEL);
            let err = (grads[i] - numeric).abs();
            assert!(
                err <= TOL * numeric.abs().max(1.0),
                "{}[{}]: analytic {} vs numeric {numeric} (err {err:e})",
                spec.name,
                i - spec.offset,
                grads[i]
            );
        }
    }
}
