//! Limits: the window and buffer caps, and llvmpipe's loop budget, on every kind of kernel choice.

use super::{assert_close, run, wgpu_or_skip};
use crate::backend::cpu::CpuBackend;
use crate::backend::wgpu::loop_budget::{attention_iterations, SOFTWARE_LOOP_BUDGET};
use crate::backend::{AttentionForward, MatmulBackward, StepShape};
use crate::backend::{AttentionShape, Backend, BackendError, MatmulShape, View, WeightLayout};

#[test]
fn tiny_buffer_caps_still_leave_room_for_a_reduction_block() {
    for bytes in [0, 1, 4096, 16_384, 16_500] {
        let Some(be) = wgpu_or_skip(Some(bytes)) else { return };
        assert!(
            be.max_window_elems() >= crate::backend::wgpu::SUM_BLOCK,
            "cap {bytes}: windows of {} elements",
            be.max_window_elems()
        );
    }
}

/// Records attention's forward over fresh zeroed buffers of shape `s`.
fn record_forward(be: &mut dyn Backend, s: AttentionShape) {
    let saving = be.attention_saving();
    let (out, saved, qkv) = (
        be.alloc(s.b * s.t * s.c).unwrap(),
        be.alloc(saving.saved_len(s)).unwrap(),
        be.alloc(s.b * s.t * 3 * s.c).unwrap(),
    );
    let shape = s;
    be.attention_forward(
        AttentionForward {
            out,
            saved,
            qkv,
            saving,
            shape,
        }
        .checked(),
    );
}

/// The flash attention kernels' loops stay under the 65535 iterations after which llvmpipe silently stops a
/// shader's loops at GPT-2's length (their values at T = 1024 are a conformance case); on a software adapter
/// a shape past the counted budget is refused, its error returned by the next synchronisation, instead of
/// computed partly.
#[test]
fn attention_fits_the_software_loop_budget_at_gpt2_length() {
    assert!(attention_iterations(1024) < SOFTWARE_LOOP_BUDGET);
    let Some(mut be) = wgpu_or_skip(None) else { return };
    if be.adapter().is_software {
        let long = AttentionShape {
            b: 1,
            t: 4096,
            c: 64,
            nh: 1,
        };
        record_forward(&mut be, long);
        let err = be.synchronize().expect_err("T = 4096 exceeds the loop budget");
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::ShapeUnsupported { op, .. }) if op == "attention"),
            "{err:#}"
        );
        assert!(format!("{err:#}").contains("stops a shader's loops"), "{err:#}");
        be.synchronize().expect("a refusal is reported once");
    }
}

/// Heads wider than the kernels keep in registers are refused by name, up front and per op.
#[test]
fn attention_refuses_heads_past_the_kernels_width() {
    let Some(mut be) = wgpu_or_skip(None) else { return };
    let wide = AttentionShape {
        b: 1,
        t: 8,
        c: 256,
        nh: 2,
    };
    record_forward(&mut be, wide);
    let err = be.synchronize().expect_err("128-wide heads");
    assert!(format!("{err:#}").contains("heads are 128 wide"), "{err:#}");
    let step = StepShape {
        batch: 1,
        seq_len: 8,
        width: 256,
        heads: 2,
        vocab: 100,
    };
    let err = be.check_step_shape(step).expect_err("refused up front");
    assert!(format!("{err:#}").contains("heads are 128 wide"), "{err:#}");
}

/// A training run whose shapes exceed llvmpipe's loop budget is refused before any work, with the limit
/// named; GPT-2's own shapes at a modest batch are accepted. Hardware adapters accept both.
#[test]
fn step_shapes_past_the_software_loop_budget_are_refused_up_front() {
    let Some(be) = wgpu_or_skip(None) else { return };
    be.check_step_shape(gpt2_shape(8)).expect("GPT-2 at 8 x 1024 tokens");
    // 72 x 1024 tokens: past the loop budget (65535), within the 32-bit indices (the logits reach them
    // from about 85,400 tokens).
    let big = be.check_step_shape(gpt2_shape(72));
    if be.adapter().is_software {
        let err = big.expect_err("72 x 1024 tokens exceed the budget");
        assert!(
            matches!(err.downcast_ref(), Some(BackendError::ShapeUnsupported { .. })),
            "{err:#}"
        );
        let text = format!("{err:#}");
        assert!(
            text.contains("stops a shader's loops") && text.contains("batch size 72 and sequence length 1024"),
            "{text}"
        );
        assert!(!text.contains("--"), "no command-line flags in backend errors: {text}");
    } else {
        big.expect("hardware adapters have no loop budget");
    }
}

/// With only the kernels a hardware adapter runs, a weight gradient summing 70000 tokens (the tiled
/// kernel's split-K, 16 slices of 4376 terms) matches the CPU on every adapter: its fixed-count inner loops
/// do not count against llvmpipe's budget (counted one by one they would run over 350 K iterations per
/// slice). A software adapter still refuses a training shape past its budget (the embedding backward's
/// loop over tokens); hardware adapters take it.
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
    // dinp, dweight, dout, inp, weight
    let lens = [s.n * s.c, s.c * s.oc, s.n * s.oc, s.n * s.c, s.c * s.oc];
    let op = move |be: &mut dyn Backend, v: &[View]| {
        be.matmul_backward(
            MatmulBackward {
                dinp: v[0],
                dweight: v[1],
                dbias: None,
                dout: v[2],
                inp: v[3],
                weight: v[4],
                shape: s,
            }
            .checked(),
        )
    };
    let want = run(&mut CpuBackend::<f32>::new(), &lens, 3, 11, &op);
    let got = run(&mut be, &lens, 3, 11, &op);
    assert_close("k = 70000 weight gradient", &got, &want, 1e-3, 1e-4);
    let step = be.check_step_shape(gpt2_shape(72));
    if be.adapter().is_software {
        let err = step.expect_err("72 x 1024 tokens exceed the budget");
        assert!(format!("{err:#}").contains("embedding backward"), "{err:#}");
    } else {
        step.unwrap();
    }
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

/// GPT-2's step at `batch` sequences of 1024 tokens.
fn gpt2_shape(batch: usize) -> crate::backend::StepShape {
    crate::backend::StepShape {
        batch,
        seq_len: 1024,
        width: 768,
        heads: 12,
        vocab: 50257,
    }
}

/// Past the shaders' 32-bit indices (GPT-2's logits at 128 x 1024 tokens), every adapter refuses the step
/// up front, naming the tensor.
#[test]
fn step_shapes_past_32_bit_indices_are_refused_on_every_adapter() {
    let Some(be) = wgpu_or_skip(None) else { return };
    let err = be
        .check_step_shape(gpt2_shape(128))
        .expect_err("128 x 1024 x 50257 logits");
    let text = format!("{err:#}");
    assert!(text.contains("the logits") && text.contains("32-bit indices"), "{text}");
    assert!(!text.contains("--"), "no command-line flags in backend errors: {text}");
}
