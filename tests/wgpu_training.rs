//! End-to-end training on the wgpu backend against the CPU backend.
//!
//! - `tiny_trains_like_cpu`: `ModelConfig::tiny()` trained for 50 AdamW steps (B=4, T=32, lr 1e-3, clipping
//!   at 1.0) on both backends from the same init and batches. Tolerance: every step's loss within
//!   [`LOSS_TOL`] absolute of the CPU's (the kernels differ from the CPU in summation order and in
//!   exp/tanh rounding, and those differences compound over steps; measured on lavapipe: 2e-7, so the
//!   bound leaves room for GPUs with other exp/fma behaviour), and the loss must fall.
//! - `wgpu_is_deterministic`: 10 steps twice on wgpu (two backends, two models) give bit-identical losses
//!   and parameters.
//! - `tiny_matches_pytorch_reference`: the PyTorch golden state (logits, loss, gradients, one AdamW step)
//!   with the CPU reference test's tolerances (measured on lavapipe: logits 3.6e-7, gradients 6e-8).
//! - `gpt2_124m_step` (`#[ignore]`, a few GiB of memory): one forward/backward/AdamW step of the 124M
//!   configuration (B=1, T=16) on wgpu, compared with the CPU backend.
//!
//! With no wgpu adapter: "SKIP: no wgpu adapter", except under `CI=true`, where the tests fail.

use ringtrain::backend::cpu::CpuBackend;
use ringtrain::backend::testing::{open_or_skip, Device};
use ringtrain::backend::wgpu::{AdapterSelection, WgpuBackend};
use ringtrain::backend::Backend;
use ringtrain::model::{init::init_params, Gpt2, ModelConfig, ParamLayout};
use ringtrain::optim::adamw::clip_coefficient;
use ringtrain::optim::{AdamW, AdamWConfig};
use std::time::Instant;

mod common;

/// Largest allowed |loss_wgpu - loss_cpu| at any of the 50 steps.
const LOSS_TOL: f64 = 5e-4;

fn wgpu_backend() -> Option<WgpuBackend> {
    open_or_skip(Device::Wgpu, WgpuBackend::new(AdapterSelection::any()))
}

/// A learnable batch for step `s`: sequences counting up by a per-sequence stride, modulo `v`.
fn batch(s: usize, b: usize, t: usize, v: usize) -> (Vec<u32>, Vec<u32>) {
    let mut inputs = Vec::with_capacity(b * t);
    let mut targets = Vec::with_capacity(b * t);
    for i in 0..b {
        let stride = 1 + (s * 7 + i * 3) % 5;
        let start = (s * 131 + i * 17) % v;
        for j in 0..t {
            inputs.push(((start + j * stride) % v) as u32);
            targets.push(((start + (j + 1) * stride) % v) as u32);
        }
    }
    (inputs, targets)
}

/// Trains `steps` steps; returns the per-step losses and the final parameters.
fn train<B: Backend>(be: &mut B, cfg: &ModelConfig, steps: usize, b: usize, t: usize) -> (Vec<f64>, Vec<f32>) {
    let layout = ParamLayout::new(cfg);
    let init = init_params(cfg, &layout, 1234);
    let mut model = Gpt2::new(be, cfg.clone(), &init).unwrap();
    let mut opt = AdamW::new(be, AdamWConfig::default(), layout.total).unwrap();
    let mut losses = Vec::new();
    for s in 0..steps {
        let (inputs, targets) = batch(s, b, t, cfg.vocab_size);
        let loss = model.forward(be, &inputs, &targets, b, t).unwrap();
        model.zero_grads(be);
        model.backward(be, 1.0 / (b * t) as f32).unwrap();
        let norm = be.sum_squares(model.grads).unwrap().sqrt();
        let coef = clip_coefficient(norm, 1.0);
        opt.update_range(be, &layout, model.params, model.grads, 0, layout.total, 1e-3, coef)
            .unwrap();
        losses.push(loss);
    }
    be.synchronize().unwrap();
    (losses, model.download_params(be).unwrap())
}

#[test]
fn tiny_trains_like_cpu() {
    let Some(mut gpu) = wgpu_backend() else { return };
    let cfg = ModelConfig::tiny();
    let (b, t, steps) = (4, 32, 50);
    let start = Instant::now();
    let (cpu_losses, _) = train(&mut CpuBackend::<f32>::new(), &cfg, steps, b, t);
    let cpu_time = start.elapsed();
    let start = Instant::now();
    let (gpu_losses, params) = train(&mut gpu, &cfg, steps, b, t);
    let gpu_time = start.elapsed();
    let mut worst = 0f64;
    for (s, (g, c)) in gpu_losses.iter().zip(&cpu_losses).enumerate() {
        let err = (g - c).abs();
        worst = worst.max(err);
        assert!(err <= LOSS_TOL, "step {s}: wgpu loss {g} vs cpu {c} (diff {err:e})");
    }
    eprintln!(
        "{}: 50 steps in {gpu_time:.2?} (cpu {cpu_time:.2?}); loss {:.4} -> {:.4}; max loss diff vs cpu {worst:e}",
        gpu.name(),
        gpu_losses[0],
        gpu_losses[steps - 1]
    );
    assert!(params.iter().all(|x| x.is_finite()));
    assert!(
        gpu_losses[steps - 1] < gpu_losses[0] - 0.5,
        "loss did not fall: {gpu_losses:?}"
    );
}

#[test]
fn wgpu_is_deterministic() {
    let Some(mut first) = wgpu_backend() else { return };
    let Some(mut second) = wgpu_backend() else { return };
    let cfg = ModelConfig::tiny();
    let (l1, p1) = train(&mut first, &cfg, 10, 2, 17);
    let (l2, p2) = train(&mut second, &cfg, 10, 2, 17);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        l1.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        l2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "losses differ between two identical runs"
    );
    assert!(bits(&p1) == bits(&p2), "parameters differ between two identical runs");
}

/// One step of GPT-2 124M (V = 50257, a 154 MB wte inside a 500 MB flat parameter buffer) on wgpu, against
/// the CPU backend: loss within 1e-5, gradient relative L2 error below 1e-4, and updated parameters within
/// lr = 1e-4 (AdamW's first step moves each parameter by about lr * sign(g), so a gradient near 0 whose
/// rounding differs may move by up to lr; measured on lavapipe: loss 1e-6, parameters 5.5e-5).
#[test]
#[ignore = "GPT-2 124M: about 5 GiB of memory and a minute or more on a software adapter"]
fn gpt2_124m_step() {
    check_gpt2_step(1, 16);
}

/// The same at GPT-2's full context, T = 1024: the attention rows are 1024 long, which on lavapipe is near
/// llvmpipe's per-invocation loop budget (ARCHITECTURE.md).
#[test]
#[ignore = "GPT-2 124M at T = 1024: about 10 GiB of memory and 10-15 minutes on a software adapter"]
fn gpt2_124m_step_full_context() {
    check_gpt2_step(1, 1024);
}

fn check_gpt2_step(b: usize, t: usize) {
    let Some(mut gpu) = wgpu_backend() else { return };
    let cfg = ModelConfig::gpt2();
    let init = init_params(&cfg, &ParamLayout::new(&cfg), 7);
    let (gl, gg, gp) = gpt2_step(&mut gpu, &cfg, &init, b, t);
    let (cl, cg, cp) = gpt2_step(&mut CpuBackend::<f32>::new(), &cfg, &init, b, t);
    assert!((gl - cl).abs() < 1e-5, "loss {gl} vs {cl}");
    let diff2: f64 = gg.iter().zip(&cg).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let norm2: f64 = cg.iter().map(|&a| (a as f64).powi(2)).sum();
    let rel = (diff2 / norm2).sqrt();
    assert!(rel < 1e-4, "gradients differ: relative L2 error {rel:e}");
    let worst = gp.iter().zip(&cp).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("gradient relative L2 error {rel:e}, parameters differ by up to {worst:e}");
    assert!(worst <= 1e-4, "parameters differ by up to {worst}");
}

/// Returns the loss, the gradients and the updated parameters.
fn gpt2_step<B: Backend>(be: &mut B, cfg: &ModelConfig, init: &[f32], b: usize, t: usize) -> (f64, Vec<f32>, Vec<f32>) {
    let start = Instant::now();
    let layout = ParamLayout::new(cfg);
    let mut model = Gpt2::new(be, cfg.clone(), init).unwrap();
    let mut opt = AdamW::new(be, AdamWConfig::default(), layout.total).unwrap();
    let (inputs, targets) = batch(0, b, t, cfg.vocab_size);
    let loss = model.forward(be, &inputs, &targets, b, t).unwrap();
    model.zero_grads(be);
    model.backward(be, 1.0 / (b * t) as f32).unwrap();
    let norm = be.sum_squares(model.grads).unwrap().sqrt();
    let mut grads = vec![0f32; layout.total];
    be.download(model.grads, &mut grads).unwrap();
    let coef = clip_coefficient(norm, 1.0);
    opt.update_range(be, &layout, model.params, model.grads, 0, layout.total, 1e-4, coef)
        .unwrap();
    let params = model.download_params(be).unwrap();
    eprintln!("{}: loss {loss}, grad norm {norm}, {:.2?}", be.name(), start.elapsed());
    (loss, grads, params)
}

/// The whole model on wgpu against PyTorch + Hugging Face (`tests/fixtures/gpt2-tiny-pytorch`, as
/// `tests/reference.rs` does for the CPU backend): logits within 1e-5 abs, loss 1e-5, every gradient within
/// 1e-6 abs + 1e-4 rel, the parameters after one AdamW step (lr 1e-3) within 0.1 * lr.
#[test]
fn tiny_matches_pytorch_reference() {
    use ringtrain::model::checkpoint::load_model;
    use safetensors::SafeTensors;
    let dir = common::pytorch_reference_dir();
    let Some(mut be) = wgpu_backend() else { return };
    let (cfg, init) = load_model(&dir.join("model")).unwrap();
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let raw = |name: &str| {
        st.tensor(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .data()
            .to_vec()
    };
    let f32s = |name: &str| -> Vec<f32> { bytemuck_f32(&raw(name)) };
    let tokens = |name: &str| -> Vec<u32> { bytemuck_f32(&raw(name)).iter().map(|x| x.to_bits()).collect() };
    let (inputs, targets) = (tokens("inputs"), tokens("targets"));
    let (b, t) = (4, 32);
    let mut model = Gpt2::new(&mut be, cfg.clone(), &init).unwrap();
    let logits = model.logits(&mut be, &inputs, b, t).unwrap();
    let logit_err = max_abs_diff(&logits, &f32s("logits"));
    assert!(logit_err < 1e-5, "logits differ by {logit_err}");
    let loss = model.forward(&mut be, &inputs, &targets, b, t).unwrap();
    let expected_loss = f32s("loss")[0] as f64;
    assert!((loss - expected_loss).abs() < 1e-5, "loss {loss} vs {expected_loss}");
    model.zero_grads(&mut be);
    model.backward(&mut be, 1.0 / (b * t) as f32).unwrap();
    let layout = ParamLayout::new(&cfg);
    let mut grads = vec![0f32; layout.total];
    be.download(model.grads, &mut grads).unwrap();
    let mut grad_err = 0f32;
    for spec in &layout.specs {
        let want = f32s(&format!("grad.transformer.{}", spec.name));
        let got = &grads[spec.offset..spec.offset + spec.len];
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let tol = 1e-6 + 1e-4 * w.abs();
            assert!((g - w).abs() <= tol, "grad {}[{i}]: {g} vs {w}", spec.name);
            grad_err = grad_err.max((g - w).abs());
        }
    }
    let config = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let lr = 1e-3;
    let mut opt = AdamW::new(&mut be, config, layout.total).unwrap();
    opt.update_range(&mut be, &layout, model.params, model.grads, 0, layout.total, lr, 1.0)
        .unwrap();
    let updated = model.download_params(&mut be).unwrap();
    let mut worst = 0f32;
    for spec in &layout.specs {
        let want = f32s(&format!("updated.transformer.{}", spec.name));
        let err = max_abs_diff(&updated[spec.offset..spec.offset + spec.len], &want);
        worst = worst.max(err);
        assert!(err <= 0.1 * lr as f32, "updated {}: max diff {err}", spec.name);
    }
    eprintln!(
        "{}: logits max diff {logit_err:e}, loss diff {:e}, grads max diff {grad_err:e}, updated max diff {worst:e}",
        be.name(),
        (loss - expected_loss).abs()
    );
}

/// Little-endian 4-byte words as f32 (token ids are read through their bits).
fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
