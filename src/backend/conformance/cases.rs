//! The cases of each [`Group`](super::Group): shapes, seeds and tolerances. Every group seeds its own
//! generator, and draws in a fixed order, so its inputs are the same on every backend and every run.

use super::harness::{Operands, Runner};
use super::tolerance::{self, CROSSENTROPY_GRAD, CROSSENTROPY_LOSS, EXACTISH, TRANSCENDENTAL};
use crate::backend::op_args::*;
use crate::backend::{AdamWStep, Backend, TokenView, View};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub(super) fn encoder(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for (b, t, c, v) in [(3, 5, 37, 256), (1, 1, 8, 256), (2, 3, 8, 50257)] {
        let shape = format!("b{b} t{t} c{c} v{v}");
        // out [b*t, c], wte [v, c], wpe [t+2, c]; tokens [b*t]
        let case = Operands::default()
            .zeros(b * t * c)
            .rand(&mut rng, v * c, 1.0)
            .rand(&mut rng, (t + 2) * c, 1.0)
            .tokens(&mut rng, b * t, v);
        r.check("encoder_forward", &shape, &case, EXACTISH, &|be, f, tk| {
            be.encoder_forward(
                EncoderForward {
                    out: f[0],
                    tokens: tk[0],
                    wte: f[1],
                    wpe: f[2],
                    shape: EncoderShape { b, t, c },
                }
                .checked(),
            )
        });
        // dwte [v, c], dwpe [t+2, c], dout [b*t, c]; tokens [b*t]
        let case = Operands::default()
            .rand(&mut rng, v * c, 1.0)
            .rand(&mut rng, (t + 2) * c, 1.0)
            .rand(&mut rng, b * t * c, 1.0)
            .tokens(&mut rng, b * t, v);
        r.check("encoder_backward", &shape, &case, EXACTISH, &|be, f, tk| {
            be.encoder_backward(
                EncoderBackward {
                    dwte: f[0],
                    dwpe: f[1],
                    dout: f[2],
                    tokens: tk[0],
                    shape: EncoderShape { b, t, c },
                }
                .checked(),
            )
        });
    }
}

pub(super) fn layernorm(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (n, c) in [(7, 37), (1, 300), (5, 1)] {
        let shape = format!("n{n} c{c}");
        // out [n, c], mean [n], rstd [n], inp [n, c], weight [c], bias [c]
        let case = Operands::default()
            .zeros(n * c)
            .zeros(n)
            .zeros(n)
            .rand(&mut rng, n * c, 2.0)
            .rand(&mut rng, c, 1.0)
            .rand(&mut rng, c, 1.0);
        r.check("layernorm_forward", &shape, &case, TRANSCENDENTAL, &|be, f, _| {
            be.layernorm_forward(
                LayerNormForward {
                    out: f[0],
                    mean: f[1],
                    rstd: f[2],
                    inp: f[3],
                    weight: f[4],
                    bias: f[5],
                    shape: RowsShape { n, c },
                }
                .checked(),
            )
        });
        // Backward needs a consistent mean/rstd: compute them on the host first.
        let inp: Vec<f32> = (0..n * c).map(|_| rng.random_range(-2.0..2.0f32)).collect(); // [n, c]
        let (mut mean, mut rstd) = (vec![0f32; n], vec![0f32; n]); // [n] each
        for row in 0..n {
            let x = &inp[row * c..][..c];
            let mu = x.iter().sum::<f32>() / c as f32;
            let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / c as f32;
            mean[row] = mu;
            rstd[row] = 1.0 / (var + 1e-5).sqrt();
        }
        // dinp [n, c], dweight [c], dbias [c], dout [n, c], inp [n, c], weight [c], mean [n], rstd [n]
        let case = Operands::default()
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c, 1.0)
            .rand(&mut rng, c, 1.0)
            .rand(&mut rng, n * c, 1.0)
            .values(inp)
            .rand(&mut rng, c, 1.0)
            .values(mean)
            .values(rstd);
        r.check("layernorm_backward", &shape, &case, TRANSCENDENTAL, &|be, f, _| {
            be.layernorm_backward(
                LayerNormBackward {
                    dinp: f[0],
                    dweight: f[1],
                    dbias: f[2],
                    dout: f[3],
                    inp: f[4],
                    weight: f[5],
                    mean: f[6],
                    rstd: f[7],
                    shape: RowsShape { n, c },
                }
                .checked(),
            )
        });
    }
}

/// A matmul's `(n, c, oc)`.
type MatmulDims = (usize, usize, usize);

pub(super) fn matmul(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let small = [(7, 37, 53), (1, 70, 130), (65, 67, 129), (130, 17, 3), (2, 1, 5)];
    let every_kind = [WeightLayout::InOut, WeightLayout::OutIn].map(|layout| [(layout, true), (layout, false)]);
    // ((n, c, oc), (layout, bias))
    let mut cases: Vec<(MatmulDims, (WeightLayout, bool))> = small
        .iter()
        .flat_map(|&shape| every_kind.iter().flatten().map(move |&kind| (shape, kind)))
        .collect();
    // A weight gradient summing 2048 tokens, which the GPU kernels split along k; gpt2's widths over a few
    // tokens: the qkv projection and the tied LM head (`[V, C]`, an odd 50257 wide). A segmented run skips
    // the widths: every straddling view is a copy there, and the plain run checks the kernels.
    cases.push(((2048, 48, 40), (WeightLayout::InOut, true)));
    if !r.straddles() {
        cases.extend([
            ((64, 768, 2304), (WeightLayout::InOut, true)),
            ((16, 768, 50257), (WeightLayout::OutIn, false)),
        ]);
    }
    for ((n, c, oc), (layout, bias)) in cases {
        {
            {
                let s = MatmulShape { n, c, oc, layout };
                let shape = format!("{n}x{c}x{oc} {layout:?} bias={bias}");
                // out [n, oc], inp [n, c], weight [c*oc], bias [oc]
                let case = Operands::default()
                    .rand(&mut rng, n * oc, 1.0)
                    .rand(&mut rng, n * c, 1.0)
                    .rand(&mut rng, c * oc, 1.0)
                    .rand(&mut rng, oc, 1.0);
                r.check("matmul_forward", &shape, &case, tolerance::matmul(c), &|be, f, _| {
                    be.matmul_forward(
                        MatmulForward {
                            out: f[0],
                            inp: f[1],
                            weight: f[2],
                            bias: bias.then_some(f[3]),
                            shape: s,
                        }
                        .checked(),
                    )
                });
                // dinp [n, c], dweight [c*oc], dbias [oc], dout [n, oc], inp [n, c], weight [c*oc]
                let case = Operands::default()
                    .rand(&mut rng, n * c, 1.0)
                    .rand(&mut rng, c * oc, 1.0)
                    .rand(&mut rng, oc, 1.0)
                    .rand(&mut rng, n * oc, 1.0)
                    .rand(&mut rng, n * c, 1.0)
                    .rand(&mut rng, c * oc, 1.0);
                let tol = tolerance::matmul(n.max(oc));
                r.check("matmul_backward", &shape, &case, tol, &|be, f, _| {
                    be.matmul_backward(
                        MatmulBackward {
                            dinp: f[0],
                            dweight: f[1],
                            dbias: bias.then_some(f[2]),
                            dout: f[3],
                            inp: f[4],
                            weight: f[5],
                            shape: s,
                        }
                        .checked(),
                    )
                });
            }
        }
    }
}

pub(super) fn attention(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    // Odd and 4-wide heads; then 64-wide heads over several of the GPU kernels' 64-row tiles (partial last
    // tile), and at gpt2's sequence lengths.
    let shapes = [
        (2, 5, 12, 3),
        (1, 1, 8, 2),
        (2, 17, 20, 4),
        (2, 65, 128, 2),
        (1, 256, 128, 2),
        (1, 1024, 64, 1),
    ];
    for (b, t, c, nh) in shapes {
        let s = AttentionShape { b, t, c, nh };
        let shape = format!("b{b} t{t} c{c} nh{nh}");
        // What each backend saves differs (probabilities, or each row's log-sum-exp): its place is sized for
        // the larger and not compared; the outputs are.
        let (saved_room, scratch_room) = (
            AttentionSaving::Probabilities.saved_len(s),
            AttentionSaving::Probabilities.scratch_len(s),
        );
        // out [b, t, c], saved, qkv [b, t, 3c]
        let case = Operands::default()
            .zeros(b * t * c)
            .unchecked(saved_room)
            .rand(&mut rng, b * t * 3 * c, 2.0);
        r.check("attention_forward", &shape, &case, TRANSCENDENTAL, &|be, f, _| {
            let saving = be.attention_saving();
            be.attention_forward(
                AttentionForward {
                    out: f[0],
                    saved: f[1].sub(0, saving.saved_len(s)),
                    qkv: f[2],
                    saving,
                    shape: s,
                }
                .checked(),
            )
        });
        // Backward reads what the same backend's forward saved: the case runs both.
        // dqkv [b, t, 3c], out [b, t, c], saved, scratch, dout [b, t, c], qkv [b, t, 3c]
        let case = Operands::default()
            .rand(&mut rng, b * t * 3 * c, 1.0)
            .zeros(b * t * c)
            .unchecked(saved_room)
            .unchecked(scratch_room)
            .rand(&mut rng, b * t * c, 1.0)
            .rand(&mut rng, b * t * 3 * c, 2.0);
        r.check("attention_backward", &shape, &case, TRANSCENDENTAL, &|be, f, _| {
            attention_forward_backward(be, s, [f[0], f[1], f[2], f[3], f[4], f[5]])
        });
    }
}

/// AdamW with `step` over the operands `[params, grads, m, v]` of a case, the weight decay inside
/// `decay_runs` only when given (else on every element).
pub fn adamw_on(be: &mut dyn Backend, f: &[View], step: AdamWStep, decay_runs: Option<TokenView>) {
    be.adamw(
        AdamWUpdate {
            params: f[0],
            grads: f[1],
            m: f[2],
            v: f[3],
            step,
            decay_runs,
        }
        .checked(),
    )
}

/// Attention's forward, then its backward, on the backend's own saved state: the operands `[dqkv, out,
/// saved room, scratch room, dout, qkv]` of a case whose rooms hold the larger saving (the probabilities).
pub fn attention_forward_backward(be: &mut dyn Backend, s: AttentionShape, f: [View; 6]) {
    let [dqkv, out, saved_room, scratch_room, dout, qkv] = f;
    let saving = be.attention_saving();
    let saved = saved_room.sub(0, saving.saved_len(s));
    be.attention_forward(
        AttentionForward {
            out,
            saved,
            qkv,
            saving,
            shape: s,
        }
        .checked(),
    );
    be.attention_backward(
        AttentionBackward {
            dqkv,
            scratch: scratch_room.sub(0, saving.scratch_len(s)),
            dout,
            qkv,
            out,
            saved,
            saving,
            shape: s,
        }
        .checked(),
    )
}

pub(super) fn gelu(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for n in [1, 1000, 4099] {
        let shape = format!("n{n}");
        // out [n], inp [n]
        let case = Operands::default().zeros(n).rand(&mut rng, n, 6.0);
        r.check("gelu_forward", &shape, &case, TRANSCENDENTAL, &|be, f, _| {
            be.gelu_forward(GeluForward { out: f[0], inp: f[1] }.checked())
        });
        // dinp [n], inp [n], dout [n]
        let case = Operands::default()
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 6.0)
            .rand(&mut rng, n, 1.0);
        r.check("gelu_backward", &shape, &case, TRANSCENDENTAL, &|be, f, _| {
            be.gelu_backward(
                GeluBackward {
                    dinp: f[0],
                    inp: f[1],
                    dout: f[2],
                }
                .checked(),
            )
        });
    }
}

pub(super) fn elementwise(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for n in [1, 333, 70001] {
        let shape = format!("n{n}");
        // three [n] operands, used in turn as outputs and inputs
        let case = Operands::default()
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 1.0);
        r.check("residual_forward", &shape, &case, EXACTISH, &|be, f, _| {
            be.residual_forward(
                ResidualForward {
                    out: f[0],
                    a: f[1],
                    b: f[2],
                }
                .checked(),
            )
        });
        r.check("add_inplace", &shape, &case, EXACTISH, &|be, f, _| {
            be.add_inplace(AddInplace { dst: f[0], src: f[1] }.checked())
        });
        r.check("scale", &shape, &case, EXACTISH, &|be, f, _| be.scale(f[1], -0.37));
        r.check("fill", &shape, &case, EXACTISH, &|be, f, _| be.fill(f[2], 1.25));
        r.check("copy", &shape, &case, EXACTISH, &|be, f, _| {
            be.copy(CopyInto { dst: f[0], src: f[2] }.checked())
        });
    }
}

pub(super) fn crossentropy(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (n, v) in [(7, 256), (1, 256), (3, 50257)] {
        let shape = format!("n{n} v{v}");
        // losses [n], logits [n, v]; targets [n]
        let case = Operands::default()
            .zeros(n)
            .rand(&mut rng, n * v, 4.0)
            .tokens(&mut rng, n, v);
        r.check(
            "crossentropy_forward",
            &shape,
            &case,
            CROSSENTROPY_LOSS,
            &|be, f, tk| {
                be.crossentropy_forward(
                    CrossEntropyForward {
                        losses: f[0],
                        logits: f[1],
                        targets: tk[0],
                        shape: LogitsShape { n, v },
                    }
                    .checked(),
                )
            },
        );
        let in_place = format!("{shape} in place");
        r.check(
            "crossentropy_backward",
            &in_place,
            &case,
            CROSSENTROPY_GRAD,
            &|be, f, tk| {
                be.crossentropy_backward(
                    CrossEntropyBackward {
                        dlogits: f[1],
                        logits: f[1],
                        targets: tk[0],
                        shape: LogitsShape { n, v },
                        dloss: 0.3,
                    }
                    .checked(),
                )
            },
        );
        // ... and dlogits [n, v] after them
        let case = case.zeros(n * v);
        r.check(
            "crossentropy_backward",
            &shape,
            &case,
            CROSSENTROPY_GRAD,
            &|be, f, tk| {
                be.crossentropy_backward(
                    CrossEntropyBackward {
                        dlogits: f[2],
                        logits: f[1],
                        targets: tk[0],
                        shape: LogitsShape { n, v },
                        dloss: 1.0 / 7.0,
                    }
                    .checked(),
                )
            },
        );
    }
}

/// Decay runs over `n` elements, as a model's layout gives them: an empty run, then runs that start at 0,
/// end at `n` and lie between.
pub fn adamw_runs(n: usize) -> Vec<u32> {
    [0, 0, 0, n / 7, n / 3, n / 2, n - n / 5, n].map(|x| x as u32).to_vec()
}

pub(super) fn sum_squares_and_adamw(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for n in [1, 4095, 4097, 30011, 150001] {
        let shape = format!("n{n}");
        let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0f32)).collect(); // [n]
        r.check_sum_squares(&shape, &x);
        // params [n], grads [n], m [n], v [n]
        let case = Operands::default()
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 0.1)
            .positive(&mut rng, n, 0.0, 0.01);
        let step = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step_size: 1e-3 / (1.0 - 0.9f32.powi(3)),
            bias_correction2_sqrt: (1.0 - 0.95f32.powi(3)).sqrt(),
            grad_scale: 0.5,
        };
        r.check("adamw", &shape, &case, EXACTISH, &|be, f, _| {
            adamw_on(be, f, step, None)
        });
        // One call over several tensors, the decay inside its runs only (a token operand).
        let case = case.token_values(adamw_runs(n));
        r.check("adamw with decay runs", &shape, &case, EXACTISH, &|be, f, t| {
            adamw_on(be, f, step, Some(t[0]))
        });
    }
    r.check_sum_squares_propagates_nan();
}
