//! The whole model against PyTorch + Hugging Face: `tests/fixtures/gpt2-tiny-pytorch` holds the init
//! checkpoint, a batch, and the logits, loss, gradients and one AdamW step that PyTorch computed
//! (`scripts/make_reference.py` writes it).
//! Tolerances (fp32): logits 1e-5 abs, loss 1e-5 abs, gradients 1e-6 abs + 1e-4 rel, updated parameters
//! 1e-4 = 0.1 * lr (measured: logits 3e-7, loss 9e-8, updated 7.4e-6).

use ringtrain::backend::cpu::CpuBackend;
use ringtrain::model::checkpoint::load_model;
use ringtrain::model::{Gpt2, ParamLayout};
use ringtrain::optim::{AdamW, AdamWConfig};
use safetensors::SafeTensors;

mod common;

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn i32s_as_u32(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn tiny_step_matches_pytorch() {
    let dir = common::pytorch_reference_dir();
    let (cfg, init) = load_model(&dir.join("model")).unwrap();
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (inputs, targets) = (i32s_as_u32(&st, "inputs"), i32s_as_u32(&st, "targets"));
    let (b, t) = (4, 32);

    let mut be = CpuBackend::<f32>::new();
    let mut model = Gpt2::new(&mut be, cfg.clone(), &init).unwrap();
    let logits = model.logits(&mut be, &inputs, b, t).unwrap();
    let logit_err = max_abs_diff(&logits, &f32s(&st, "logits"));
    assert!(logit_err < 1e-5, "logits differ by {logit_err}");

    let loss = model.forward(&mut be, &inputs, &targets, b, t).unwrap();
    let expected_loss = f32s(&st, "loss")[0] as f64;
    assert!((loss - expected_loss).abs() < 1e-5, "loss {loss} vs {expected_loss}");

    model.zero_grads(&mut be);
    model.backward(&mut be, 1.0 / (b * t) as f32).unwrap();
    let mut grads = vec![0f32; model.layout.total];
    ringtrain::backend::Backend::download(&mut be, model.grads, &mut grads).unwrap();
    let layout = ParamLayout::new(&cfg);
    for spec in &layout.specs {
        let want = f32s(&st, &format!("grad.transformer.{}", spec.name));
        let got = &grads[spec.offset..spec.offset + spec.len];
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let tol = 1e-6 + 1e-4 * w.abs();
            assert!((g - w).abs() <= tol, "grad {}[{i}]: {g} vs {w}", spec.name);
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
        let want = f32s(&st, &format!("updated.transformer.{}", spec.name));
        let err = max_abs_diff(&updated[spec.offset..spec.offset + spec.len], &want);
        worst = worst.max(err);
        assert!(err <= 0.1 * lr as f32, "updated {}: max diff {err}", spec.name);
    }
    eprintln!(
        "logits max diff {logit_err:e}, loss diff {:e}, updated max diff {worst:e}",
        (loss - expected_loss).abs()
    );
}
