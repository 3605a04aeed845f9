//! Every op of every backend against the CPU reference, and the CPU reference itself against its f64
//! instance: the cases of [`ringtrain::backend::conformance`] (whose module doc gives the placement and the
//! tolerances), each asserted to pass, plus the wgpu paths that need a specially configured backend.
//!
//! `backend_tests!` expands one test per case group and backend (`cpu::*`, `wgpu::*`, `wgpu_segmented::*`,
//! `cuda::*`). When no wgpu adapter exists the wgpu tests print "SKIP: no wgpu adapter" and pass, except
//! under `CI=true`, where they fail. When no CUDA device can be opened the cuda tests print a SKIP notice
//! and pass, under `CI=true` too (CI has no NVIDIA GPU).

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain::backend::conformance::tolerance::{
    self, CROSSENTROPY_GRAD, CROSSENTROPY_LOSS, EXACTISH, TRANSCENDENTAL,
};
use ringtrain::backend::conformance::{
    adamw_on, attention_forward_backward, CaseResult, Group, Operands, Runner, Settings,
};
use ringtrain::backend::factory::{open_kind, BackendKind};
use ringtrain::backend::matmul_bench::MatmulBench;
use ringtrain::backend::testing::{open_or_skip, Device};
use ringtrain::backend::wgpu::{list_adapters, AdapterSelection, WgpuBackend};
use ringtrain::backend::{AdamWStep, AttentionSaving, AttentionShape, Backend, MatmulShape, WeightLayout};
use ringtrain::backend::{
    CrossEntropyBackward, CrossEntropyForward, EncoderBackward, EncoderForward, EncoderShape, LogitsShape,
    MatmulBackward, MatmulForward,
};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Prints every result, then fails listing the cases that did not pass.
fn assert_all_pass(backend: &str, results: &[CaseResult]) {
    assert!(!results.is_empty(), "no case ran on {backend}");
    for r in results {
        eprintln!("{r}");
    }
    let failed: Vec<String> = results.iter().filter(|r| !r.passed()).map(|r| r.to_string()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} cases failed on {backend}:\n{}",
        failed.len(),
        results.len(),
        failed.join("\n")
    );
}

/// Runs the cases of `group` on `be` and asserts that they all pass.
fn check_group(group: Group, be: &mut dyn Backend, settings: Settings) {
    let name = be.name();
    assert_all_pass(&name, &group.results(be, settings));
}

// ---------------------------------------------------------------- backends

/// One wgpu backend shared by the tests of this binary (compiling the kernels once).
fn shared_wgpu() -> Option<MutexGuard<'static, WgpuBackend>> {
    static BE: OnceLock<Option<Mutex<WgpuBackend>>> = OnceLock::new();
    open_wgpu(&BE, |_| {})
}

/// Segment size of the `wgpu_segmented` backend, in elements (1 MiB buffers: one gpt2-wide sequence of 1024 tokens fits a binding).
const SEGMENT: usize = 262_144;

/// A wgpu backend whose allocations are split into 1 MiB buffers (bindings capped alike), as a
/// tensor larger than `max_buffer_size` would be.
fn segmented_wgpu() -> Option<MutexGuard<'static, WgpuBackend>> {
    static BE: OnceLock<Option<Mutex<WgpuBackend>>> = OnceLock::new();
    open_wgpu(&BE, |be| be.set_max_buffer_bytes(SEGMENT as u64 * 4))
}

/// A wgpu backend whose layer norm and cross-entropy take the kernels this adapter does not use by
/// default (one workgroup per row with tree reductions, or one invocation per row on software adapters),
/// so that both are checked on every adapter.
fn other_reductions_wgpu() -> Option<MutexGuard<'static, WgpuBackend>> {
    static BE: OnceLock<Option<Mutex<WgpuBackend>>> = OnceLock::new();
    open_wgpu(&BE, |be| be.set_row_kernels(!be.row_kernels()))
}

fn open_wgpu(
    cell: &'static OnceLock<Option<Mutex<WgpuBackend>>>,
    configure: fn(&mut WgpuBackend),
) -> Option<MutexGuard<'static, WgpuBackend>> {
    let be = cell.get_or_init(|| {
        let mut be = open_or_skip(Device::Wgpu, WgpuBackend::new(AdapterSelection::any()))?;
        eprintln!("wgpu adapter: {}", be.name());
        configure(&mut be);
        Some(Mutex::new(be))
    });
    be.as_ref().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
}

/// CUDA device 0, or `None` after a SKIP notice where it cannot be opened (always a skip: CI has no NVIDIA
/// GPU, and a build without the `cuda` feature has no CUDA backend).
fn cuda() -> Option<Box<dyn Backend>> {
    let be = open_or_skip(Device::Cuda, open_kind(BackendKind::Cuda { device: 0 }))?;
    eprintln!("cuda backend: {}", be.name());
    Some(be)
}

macro_rules! backend_tests {
    ($($name:ident => $group:ident),* $(,)?) => {
        mod cpu {
            use ringtrain::backend::conformance::{Group, Reference, Settings};
            $(
                #[test]
                fn $name() {
                    let mut be = ringtrain::backend::cpu::CpuBackend::<f32>::new();
                    let settings = Settings { reference: Reference::F64, straddle: None };
                    super::check_group(Group::$group, &mut be, settings);
                }
            )*
        }
        mod wgpu {
            use ringtrain::backend::conformance::{Group, Settings};
            $(
                #[test]
                fn $name() {
                    let Some(mut be) = super::shared_wgpu() else { return };
                    super::check_group(Group::$group, &mut *be, Settings::default());
                }
            )*
        }
        /// Every view straddles two 1 MiB segments of its allocation.
        mod wgpu_segmented {
            use ringtrain::backend::conformance::{Group, Settings};
            $(
                #[test]
                fn $name() {
                    let Some(mut be) = super::segmented_wgpu() else { return };
                    let settings = Settings { straddle: Some(super::SEGMENT), ..Settings::default() };
                    super::check_group(Group::$group, &mut *be, settings);
                }
            )*
        }
        mod cuda {
            use ringtrain::backend::conformance::{Group, Settings};
            $(
                #[test]
                fn $name() {
                    let Some(mut be) = super::cuda() else { return };
                    super::check_group(Group::$group, &mut *be, Settings::default());
                }
            )*
        }
    };
}

/// The per-row reductions again, with the kernels this adapter does not use by default.
mod wgpu_other_reductions {
    use ringtrain::backend::conformance::{Group, Settings};

    #[test]
    fn layernorm() {
        let Some(mut be) = super::other_reductions_wgpu() else {
            return;
        };
        super::check_group(Group::Layernorm, &mut *be, Settings::default());
    }

    #[test]
    fn crossentropy() {
        let Some(mut be) = super::other_reductions_wgpu() else {
            return;
        };
        super::check_group(Group::Crossentropy, &mut *be, Settings::default());
    }
}

backend_tests!(
    encoder => Encoder,
    layernorm => Layernorm,
    matmul => Matmul,
    attention => Attention,
    gelu => Gelu,
    elementwise => Elementwise,
    crossentropy => Crossentropy,
    sum_squares_and_adamw => SumSquaresAndAdamw,
);

/// The splitting paths for tensors larger than a storage binding, exercised by capping the binding size
/// at 256 KiB: matmuls (both layouts, forward and backward), the embedding, cross-entropy over V = 50257,
/// attention, sum_squares and AdamW over views much larger than one window.
#[test]
fn wgpu_windows_split_large_tensors() {
    let Some(mut be) = open_or_skip(Device::Wgpu, WgpuBackend::new(AdapterSelection::any())) else {
        return;
    };
    be.set_max_binding_bytes(256 * 1024);
    let name = be.name();
    let mut results = Vec::new();
    split_cases(&mut Runner::new(&mut be, Settings::default(), &mut |r| results.push(r)));
    assert_all_pass(&name, &results);
}

/// The cases of [`wgpu_windows_split_large_tensors`].
fn split_cases(r: &mut Runner) {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (n, c, v) = (5, 24, 7001);
    for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
        let s = MatmulShape { n, c, oc: v, layout };
        let shape = format!("split {n}x{c}x{v} {layout:?}");
        // out [n, v], inp [n, c], weight [c*v], bias [v]
        let case = Operands::default()
            .rand(&mut rng, n * v, 1.0)
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c * v, 1.0)
            .rand(&mut rng, v, 1.0);
        r.check("matmul_forward", &shape, &case, tolerance::matmul(c), &|be, f, _| {
            be.matmul_forward(
                MatmulForward {
                    out: f[0],
                    inp: f[1],
                    weight: f[2],
                    bias: Some(f[3]),
                    shape: s,
                }
                .checked(),
            )
        });
        // dinp [n, c], dweight [c*v], dbias [v], dout [n, v], inp [n, c], weight [c*v]
        let case = Operands::default()
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c * v, 1.0)
            .rand(&mut rng, v, 1.0)
            .rand(&mut rng, n * v, 1.0)
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c * v, 1.0);
        r.check("matmul_backward", &shape, &case, tolerance::matmul(v), &|be, f, _| {
            be.matmul_backward(
                MatmulBackward {
                    dinp: f[0],
                    dweight: f[1],
                    dbias: Some(f[2]),
                    dout: f[3],
                    inp: f[4],
                    weight: f[5],
                    shape: s,
                }
                .checked(),
            )
        });
    }
    let s = MatmulShape {
        n: 20000,
        c: 9,
        oc: 11,
        layout: WeightLayout::InOut,
    };
    // dinp [20000, 9], dweight [9*11], dbias [11], dout [20000, 11], inp [20000, 9], weight [9*11]
    let case = Operands::default()
        .rand(&mut rng, 20000 * 9, 1.0)
        .rand(&mut rng, 99, 1.0)
        .rand(&mut rng, 11, 1.0)
        .rand(&mut rng, 20000 * 11, 1.0)
        .rand(&mut rng, 20000 * 9, 1.0)
        .rand(&mut rng, 99, 1.0);
    let tol = tolerance::matmul(20000);
    r.check("matmul_backward", "split long k 20000x9x11", &case, tol, &|be, f, _| {
        be.matmul_backward(
            MatmulBackward {
                dinp: f[0],
                dweight: f[1],
                dbias: Some(f[2]),
                dout: f[3],
                inp: f[4],
                weight: f[5],
                shape: s,
            }
            .checked(),
        )
    });
    let (b, t) = (2, 3);
    let shape = format!("split b{b} t{t} c{c} v{v}");
    // out [b*t, c], wte [v, c], wpe [t, c]; tokens [b*t]
    let case = Operands::default()
        .zeros(b * t * c)
        .rand(&mut rng, v * c, 1.0)
        .rand(&mut rng, t * c, 1.0)
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
    // dwte [v, c], dwpe [t, c], dout [b*t, c]; tokens [b*t]
    let case = Operands::default()
        .rand(&mut rng, v * c, 1.0)
        .rand(&mut rng, t * c, 1.0)
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
    let (rows, vocab) = (4, 50257);
    let shape = format!("split n{rows} v{vocab}");
    // losses [rows], logits [rows, vocab]; targets [rows]
    let case = Operands::default()
        .zeros(rows)
        .rand(&mut rng, rows * vocab, 4.0)
        .tokens(&mut rng, rows, vocab);
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
                    shape: LogitsShape { n: rows, v: vocab },
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
                    shape: LogitsShape { n: rows, v: vocab },
                    dloss: 0.25,
                }
                .checked(),
            )
        },
    );
    // qkv [3, 300, 192] is 2.6 windows; one sequence's fits one.
    let s = AttentionShape {
        b: 3,
        t: 300,
        c: 64,
        nh: 2,
    };
    let (bt, c) = (3 * 300, 64);
    let room = AttentionSaving::Probabilities.saved_len(s);
    // dqkv [bt, 3c], out [bt, c], saved, scratch, dout [bt, c], qkv [bt, 3c]
    let case = Operands::default()
        .rand(&mut rng, bt * 3 * c, 1.0)
        .zeros(bt * c)
        .unchecked(room)
        .unchecked(room)
        .rand(&mut rng, bt * c, 1.0)
        .rand(&mut rng, bt * 3 * c, 2.0);
    r.check(
        "attention_forward and backward",
        "split b3 t300 c64 nh2",
        &case,
        TRANSCENDENTAL,
        &|be, f, _| attention_forward_backward(be, s, [f[0], f[1], f[2], f[3], f[4], f[5]]),
    );
    let len = 100_003;
    let shape = format!("split n{len}");
    // params [len], grads [len], m [len], v [len]; decay runs crossing the windows' boundaries
    let case = Operands::default()
        .rand(&mut rng, len, 1.0)
        .rand(&mut rng, len, 1.0)
        .rand(&mut rng, len, 0.1)
        .positive(&mut rng, len, 0.0, 0.01)
        .token_values(vec![10, 60_000, 65_600, 70_000, 99_000, 100_003]);
    let step = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step_size: 1e-2,
        bias_correction2_sqrt: 0.3,
        grad_scale: 1.0,
    };
    r.check("adamw", &shape, &case, EXACTISH, &|be, f, t| {
        adamw_on(be, f, step, Some(t[0]))
    });
    r.check("scale", &shape, &case, EXACTISH, &|be, f, _| be.scale(f[0], 3.0));
    let x: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0f32)).collect(); // [len]
    r.check_sum_squares(&shape, &x);
}

/// Adapter discovery and selection: every adapter is listed with its limits; an index past the end wraps
/// around; asking for hardware only on a machine with only software adapters is a clear error.
#[test]
fn wgpu_adapters_listed_and_selected() {
    let adapters = list_adapters();
    for a in &adapters {
        eprintln!("{a}");
    }
    let found = if adapters.is_empty() {
        Err(anyhow::anyhow!("list_adapters() found none"))
    } else {
        Ok(())
    };
    if open_or_skip(Device::Wgpu, found).is_none() {
        return;
    }
    for (i, a) in adapters.iter().enumerate() {
        assert_eq!(a.index, i);
        assert!(a.max_storage_buffer_binding_size > 0 && a.max_buffer_size > 0);
    }
    let usable = adapters.iter().filter(|a| a.unsupported.is_none()).count();
    let be = WgpuBackend::new(AdapterSelection::any().with_index(usable)).unwrap();
    assert_eq!(
        be.adapter().name,
        WgpuBackend::new(AdapterSelection::any()).unwrap().adapter().name
    );
    if adapters.iter().all(|a| a.is_software) {
        let err = WgpuBackend::new(AdapterSelection::hardware())
            .err()
            .expect("no hardware adapter exists");
        assert!(format!("{err:#}").contains("hardware"), "{err:#}");
    }
}

#[test]
fn wgpu_bench_matmul_runs() {
    let Some(mut be) = shared_wgpu() else { return };
    let gflops = MatmulBench::new(&mut *be, 130, 70, 129)
        .unwrap()
        .gflops(&mut *be, 3)
        .unwrap();
    eprintln!("matmul 130x70x129: {gflops:.2} GFLOP/s");
    assert!(gflops.is_finite() && gflops > 0.0);
}

/// Prints matmul GFLOP/s for a GPT-2-like shape (run with `--ignored --nocapture`).
#[test]
#[ignore = "benchmark"]
fn wgpu_bench_matmul_gpt2_shape() {
    let Some(mut be) = shared_wgpu() else { return };
    for (m, k, n) in [(512, 768, 768), (512, 768, 3072), (1024, 768, 2304)] {
        let gflops = MatmulBench::new(&mut *be, m, k, n)
            .unwrap()
            .gflops(&mut *be, 5)
            .unwrap();
        eprintln!("{}: matmul {m}x{k}x{n}: {gflops:.2} GFLOP/s", be.name());
    }
}

/// Prints the cost of one small dispatch (run with `--ignored --nocapture`).
#[test]
#[ignore = "benchmark"]
fn wgpu_bench_dispatch_overhead() {
    let Some(mut be) = shared_wgpu() else { return };
    let v = be.alloc(64).unwrap();
    be.synchronize().unwrap();
    let start = std::time::Instant::now();
    for _ in 0..2000 {
        be.scale(v, 1.0);
    }
    be.synchronize().unwrap();
    eprintln!(
        "{}: {:.1} us per dispatch",
        be.name(),
        start.elapsed().as_secs_f64() / 2000.0 * 1e6
    );
}
