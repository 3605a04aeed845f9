//! The CPU backend's fused ops (bias + GELU after a matmul, residual add + layer norm, cross-entropy with its
//! backward) give the same bits as the ops they replace, in f32 and f64; and a training step through the
//! model's fused path (`Gpt2::forward_train`) gives the same loss and gradients as `forward` + `backward`.
//! Backends that do not override them run the default, which is the unfused sequence itself.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain::backend::cpu::{CpuBackend, Real};
use ringtrain::backend::{
    AddInplace, AddLayerNormForward, CrossEntropyBackward, CrossEntropyForward, CrossEntropyForwardBackward,
    GeluForward, LayerNormForward, LogitsShape, MatmulForward, MatmulGeluForward, RowsShape,
};
use ringtrain::backend::{Backend, MatmulShape, View, WeightLayout};
use ringtrain::model::{init::init_params, Gpt2, ModelConfig, ParamLayout};

fn random(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

fn upload<F: Real>(be: &mut CpuBackend<F>, values: &[f32]) -> View {
    let view = be.alloc(values.len()).unwrap();
    be.upload(view, values).unwrap();
    view
}

fn download<F: Real>(be: &mut CpuBackend<F>, view: View) -> Vec<u32> {
    let mut host = vec![0f32; view.len];
    be.download(view, &mut host).unwrap();
    host.iter().map(|x| x.to_bits()).collect()
}

fn fused_equal_unfused<F: Real>() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut be = CpuBackend::<F>::new();
    // n = 37 rows crosses the row blocks of the fused epilogue; oc = 3 * 40 is not a multiple of them.
    let (n, c, oc, v) = (37, 40, 120, 50);
    let shape = MatmulShape {
        n,
        c,
        oc,
        layout: WeightLayout::InOut,
    };
    let (inp, w, bias) = (random(&mut rng, n * c), random(&mut rng, c * oc), random(&mut rng, oc));
    let (inp, w, bias) = (upload(&mut be, &inp), upload(&mut be, &w), upload(&mut be, &bias));
    // Bias + GELU.
    let (pre_a, out_a, pre_b, out_b) = (
        be.alloc(n * oc).unwrap(),
        be.alloc(n * oc).unwrap(),
        be.alloc(n * oc).unwrap(),
        be.alloc(n * oc).unwrap(),
    );
    be.matmul_forward(
        MatmulForward {
            out: pre_a,
            inp,
            weight: w,
            bias: Some(bias),
            shape,
        }
        .checked(),
    );
    be.gelu_forward(GeluForward { out: out_a, inp: pre_a }.checked());
    be.matmul_gelu_forward(
        MatmulGeluForward {
            pre: pre_b,
            out: out_b,
            inp,
            weight: w,
            bias,
            shape,
        }
        .checked(),
    );
    assert_eq!(download(&mut be, pre_a), download(&mut be, pre_b), "pre-activation");
    assert_eq!(download(&mut be, out_a), download(&mut be, out_b), "GELU");
    // Residual add + layer norm.
    let (res, skip, lw, lb) = (
        random(&mut rng, n * c),
        random(&mut rng, n * c),
        random(&mut rng, c),
        random(&mut rng, c),
    );
    let (res_a, res_b) = (upload(&mut be, &res), upload(&mut be, &res));
    let (skip, lw, lb) = (upload(&mut be, &skip), upload(&mut be, &lw), upload(&mut be, &lb));
    let outs: Vec<View> = (0..6)
        .map(|i| be.alloc(if i % 3 == 0 { n * c } else { n }).unwrap())
        .collect();
    be.add_inplace(AddInplace { dst: res_a, src: skip }.checked());
    be.layernorm_forward(
        LayerNormForward {
            out: outs[0],
            mean: outs[1],
            rstd: outs[2],
            inp: res_a,
            weight: lw,
            bias: lb,
            shape: RowsShape { n, c },
        }
        .checked(),
    );
    be.add_layernorm_forward(
        AddLayerNormForward {
            residual: res_b,
            skip,
            out: outs[3],
            mean: outs[4],
            rstd: outs[5],
            weight: lw,
            bias: lb,
            shape: RowsShape { n, c },
        }
        .checked(),
    );
    assert_eq!(download(&mut be, res_a), download(&mut be, res_b), "residual");
    for i in 0..3 {
        assert_eq!(
            download(&mut be, outs[i]),
            download(&mut be, outs[i + 3]),
            "layer norm output {i}"
        );
    }
    // Cross-entropy forward and backward.
    let logits = random(&mut rng, n * v);
    let targets: Vec<u32> = (0..n).map(|i| (i * 7 % v) as u32).collect();
    let tokens = be.alloc_tokens(n).unwrap();
    be.upload_tokens(tokens, &targets).unwrap();
    let (logits_a, logits_b) = (upload(&mut be, &logits), upload(&mut be, &logits));
    let (loss_a, loss_b) = (be.alloc(n).unwrap(), be.alloc(n).unwrap());
    be.crossentropy_forward(
        CrossEntropyForward {
            losses: loss_a,
            logits: logits_a,
            targets: tokens,
            shape: LogitsShape { n, v },
        }
        .checked(),
    );
    be.crossentropy_backward(
        CrossEntropyBackward {
            dlogits: logits_a,
            logits: logits_a,
            targets: tokens,
            shape: LogitsShape { n, v },
            dloss: 0.125,
        }
        .checked(),
    );
    be.crossentropy_forward_backward(
        CrossEntropyForwardBackward {
            losses: loss_b,
            logits: logits_b,
            targets: tokens,
            shape: LogitsShape { n, v },
            dloss: 0.125,
        }
        .checked(),
    );
    assert_eq!(download(&mut be, loss_a), download(&mut be, loss_b), "losses");
    assert_eq!(
        download(&mut be, logits_a),
        download(&mut be, logits_b),
        "logit gradients"
    );
}

#[test]
fn fused_ops_equal_the_ops_they_replace_f32() {
    fused_equal_unfused::<f32>();
}

#[test]
fn fused_ops_equal_the_ops_they_replace_f64() {
    fused_equal_unfused::<f64>();
}

#[test]
fn the_fused_training_path_gives_the_same_loss_and_gradients() {
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let init = init_params(&cfg, &layout, 5);
    let (b, t) = (3, 24);
    let inputs: Vec<u32> = (0..b * t).map(|i| (i * 29 % 256) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 13 % 256) as u32).collect();
    let dloss = 1.0 / (b * t) as f32;
    let run = |fused: bool| {
        let mut be = CpuBackend::<f32>::new();
        let mut model = Gpt2::new(&mut be, cfg.clone(), &init).unwrap();
        model.zero_grads(&mut be);
        let loss = if fused {
            model
                .forward_train(&mut be, &inputs, &targets, b, t, Some(dloss), &mut |_, _| Ok(()))
                .unwrap()
        } else {
            model.forward(&mut be, &inputs, &targets, b, t).unwrap()
        };
        model.backward(&mut be, dloss).unwrap();
        (loss.to_bits(), download(&mut be, model.grads))
    };
    assert_eq!(run(true), run(false));
    // A backward with another weight than forward_train's is refused (the logits are gone).
    let mut be = CpuBackend::<f32>::new();
    let mut model = Gpt2::new(&mut be, cfg.clone(), &init).unwrap();
    model
        .forward_train(&mut be, &inputs, &targets, b, t, Some(dloss), &mut |_, _| Ok(()))
        .unwrap();
    assert!(model.backward(&mut be, dloss * 2.0).is_err());
}
