//! The CUDA backend's op logic, kernels and GEMM layouts against the CPU reference, on the emulator.

use super::{Emulator, NO_COMPILER};
use crate::backend::conformance::{run_all, Settings};
use crate::backend::cuda::device::CudaBackend;
use crate::backend::Backend;

/// The emulated backend, or `None` with a notice where there is no C++ compiler (under `CI=true` that fails:
/// CI installs g++). A compiler that refuses the kernels fails the test.
fn emulated() -> Option<CudaBackend<Emulator>> {
    match Emulator::new() {
        Ok(emulator) => Some(CudaBackend::on(emulator)),
        Err(why) => {
            assert!(why.starts_with(NO_COMPILER), "{why}");
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true but {why}");
            println!("SKIP: no CUDA emulator: {why}");
            None
        }
    }
}

#[test]
fn every_conformance_case_passes_on_the_emulated_cuda_backend() {
    let Some(mut backend) = emulated() else { return };
    assert_eq!(backend.name(), "cuda (emulated on the CPU)");
    let mut failures = Vec::new();
    let mut cases = 0;
    run_all(&mut backend, Settings::default(), &mut |result| {
        cases += 1;
        if !result.passed() {
            failures.push(format!("{result:?}"));
        }
    });
    assert!(cases > 90, "only {cases} cases ran");
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `steps` AdamW steps of `tiny` (batch 2 of 17 tokens, clipping at 1) on `be`: the losses and the final
/// parameters. The batches count up with a per-sequence stride, so the loss falls.
fn train<B: Backend>(be: &mut B, steps: usize) -> (Vec<f64>, Vec<f32>) {
    use crate::model::{init::init_params, Gpt2, ModelConfig, ParamLayout};
    use crate::optim::adamw::clip_coefficient;
    use crate::optim::{AdamW, AdamWConfig};
    let cfg = ModelConfig::tiny();
    let (b, t, v) = (2, 17, cfg.vocab_size);
    let layout = ParamLayout::new(&cfg);
    let init = init_params(&cfg, &layout, 1234);
    let mut model = Gpt2::new(be, cfg.clone(), &init).unwrap();
    let mut opt = AdamW::new(be, AdamWConfig::default(), layout.total).unwrap();
    let mut losses = Vec::new();
    for s in 0..steps {
        let sequence = |i: usize, j: usize| ((s * 131 + i * 17 + j * (1 + (s * 7 + i * 3) % 5)) % v) as u32;
        let inputs: Vec<u32> = (0..b).flat_map(|i| (0..t).map(move |j| sequence(i, j))).collect();
        let targets: Vec<u32> = (0..b).flat_map(|i| (0..t).map(move |j| sequence(i, j + 1))).collect();
        losses.push(model.forward(be, &inputs, &targets, b, t).unwrap());
        model.zero_grads(be);
        model.backward(be, 1.0 / (b * t) as f32).unwrap();
        let coef = clip_coefficient(be.sum_squares(model.grads).unwrap().sqrt(), 1.0);
        opt.update_range(be, &layout, model.params, model.grads, 0, layout.total, 1e-3, coef)
            .unwrap();
    }
    be.synchronize().unwrap();
    (losses, model.download_params(be).unwrap())
}

/// The whole model (every op in the model's order, the embedding index, clipping, AdamW) trains on the
/// emulated CUDA backend like the CPU reference (losses within 5e-4, the wgpu end-to-end test's bound), and
/// two runs give the same bits.
#[test]
fn tiny_trains_like_cpu_and_repeats_on_the_emulated_cuda_backend() {
    let Some(mut first) = emulated() else { return };
    let Some(mut second) = emulated() else { return };
    let steps = 8;
    let (cpu_losses, _) = train(&mut crate::backend::cpu::CpuBackend::<f32>::new(), steps);
    let (losses, params) = train(&mut first, steps);
    for (s, (got, want)) in losses.iter().zip(&cpu_losses).enumerate() {
        assert!(
            (got - want).abs() <= 5e-4,
            "step {s}: emulated cuda loss {got} vs cpu {want}"
        );
    }
    assert!(losses[steps - 1] < losses[0], "loss did not fall: {losses:?}");
    let (again, params_again) = train(&mut second, steps);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&losses.iter().map(|&l| l as f32).collect::<Vec<_>>()),
        bits(&again.iter().map(|&l| l as f32).collect::<Vec<_>>())
    );
    assert!(bits(&params) == bits(&params_again), "two emulated runs differ");
}

/// `--matmul-precision tf32` reaches cuBLAS's math mode: on the emulator the GEMM inputs are rounded to
/// TF32, so a matmul moves off the fp32 result by no more than TF32's 2^-11 relative rounding of each input
/// allows, repeats bit for bit, and switching back gives the fp32 bits again.
#[test]
fn tf32_rounds_the_gemm_inputs_and_fp32_restores_them() {
    use crate::backend::{MatmulForward, MatmulPrecision, MatmulShape, WeightLayout};
    let Some(mut be) = emulated() else { return };
    let s = MatmulShape {
        n: 8,
        c: 64,
        oc: 16,
        layout: WeightLayout::InOut,
    };
    let values = |n: usize, seed: u32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 10007) as f32 / 5003.0 - 1.0)
            .collect()
    };
    let (inp, weight) = (values(s.n * s.c, 1), values(s.c * s.oc, 2));
    let run = |be: &mut CudaBackend<Emulator>, precision| -> Vec<f32> {
        be.set_matmul_precision(precision).unwrap();
        let [out, i, w] = [s.n * s.oc, s.n * s.c, s.c * s.oc].map(|len| be.alloc(len).unwrap());
        be.upload(i, &inp).unwrap();
        be.upload(w, &weight).unwrap();
        be.matmul_forward(
            MatmulForward {
                out,
                inp: i,
                weight: w,
                bias: None,
                shape: s,
            }
            .checked(),
        );
        let mut host = vec![0f32; out.len];
        be.download(out, &mut host).unwrap();
        host
    };
    let fp32 = run(&mut be, MatmulPrecision::Fp32);
    let tf32 = run(&mut be, MatmulPrecision::Tf32);
    assert_eq!(bits(&tf32), bits(&run(&mut be, MatmulPrecision::Tf32)), "tf32 repeats");
    assert_eq!(bits(&fp32), bits(&run(&mut be, MatmulPrecision::Fp32)), "fp32 again");
    assert_ne!(bits(&fp32), bits(&tf32), "tf32 rounds the inputs");
    // Each of the 64 products of inputs below 1 in size moves by at most about 2 * 2^-11.
    let worst = fp32.iter().zip(&tf32).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 64.0 * 2.0 / 2048.0, "{worst}");
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
