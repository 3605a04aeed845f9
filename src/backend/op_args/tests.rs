use super::*;
use crate::backend::{AdamWStep, TokenView};

fn view(buf: usize, offset: usize, len: usize) -> View {
    View { buf, offset, len }
}

fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let err = std::panic::catch_unwind(f).expect_err("the check should fail");
    err.downcast_ref::<String>().cloned().unwrap_or_default()
}

fn layernorm(out: View) -> LayerNormForward {
    LayerNormForward {
        out,
        mean: view(1, 0, 3),
        rstd: view(1, 3, 3),
        inp: view(2, 0, 15),
        weight: view(3, 0, 5),
        bias: view(3, 5, 5),
        shape: RowsShape { n: 3, c: 5 },
    }
}

/// Operands that follow the shape pass; a wrong length names the op, the operand and the length the shape
/// needs.
#[test]
fn a_wrong_length_names_op_operand_and_need() {
    let _ = layernorm(view(0, 0, 15)).checked();
    let message = panic_message(|| {
        layernorm(view(0, 0, 14)).checked();
    });
    assert!(
        message.starts_with("layernorm_forward: out holds 14 elements, the shape needs 15"),
        "{message}"
    );
}

/// An output overlapping an input is refused; one overlapping nothing passes, even in the same buffer.
#[test]
fn outputs_alias_nothing() {
    let message = panic_message(|| {
        layernorm(view(2, 10, 15)).checked();
    });
    assert!(message.contains("output out overlaps inp"), "{message}");
    let _ = layernorm(view(2, 15, 15)).checked();
}

/// Cross-entropy's gradient may replace the logits exactly, but not overlap them in part.
#[test]
fn crossentropy_backward_may_write_over_its_logits() {
    let args = |dlogits| CrossEntropyBackward {
        dlogits,
        logits: view(0, 0, 8),
        targets: TokenView {
            buf: 0,
            offset: 0,
            len: 2,
        },
        shape: LogitsShape { n: 2, v: 4 },
        dloss: 0.5,
    };
    let _ = args(view(0, 0, 8)).checked();
    let _ = args(view(1, 0, 8)).checked();
    let message = panic_message(|| {
        args(view(0, 4, 8)).checked();
    });
    assert!(message.contains("output dlogits overlaps logits"), "{message}");
}

/// Attention refuses a width that is not whole heads before any length.
#[test]
fn attention_needs_whole_heads() {
    let shape = AttentionShape {
        b: 1,
        t: 2,
        c: 6,
        nh: 4,
    };
    let message = panic_message(|| {
        AttentionForward {
            out: view(0, 0, 12),
            saved: view(1, 0, 16),
            qkv: view(2, 0, 36),
            saving: AttentionSaving::Probabilities,
            shape,
        }
        .checked();
    });
    assert!(message.contains("not a whole number of heads"), "{message}");
}

/// Element-wise ops need equal lengths, and an absent bias is no operand.
#[test]
fn elementwise_lengths_and_optional_bias() {
    let message = panic_message(|| {
        AdamWUpdate {
            params: view(0, 0, 4),
            grads: view(1, 0, 4),
            m: view(2, 0, 3),
            v: view(3, 0, 4),
            step: AdamWStep {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                step_size: 0.1,
                bias_correction2_sqrt: 1.0,
                grad_scale: 1.0,
            },
            decay_runs: None,
        }
        .checked();
    });
    assert!(message.contains("m holds 3 elements, params holds 4"), "{message}");
    let shape = MatmulShape {
        n: 2,
        c: 3,
        oc: 4,
        layout: WeightLayout::InOut,
    };
    let _ = MatmulForward {
        out: view(0, 0, 8),
        inp: view(1, 0, 6),
        weight: view(2, 0, 12),
        bias: None,
        shape,
    }
    .checked();
}
