//! Every op of every backend against the CPU reference (`CpuBackend<f32>`), and the CPU reference itself
//! against its f64 instance.
//!
//! `backend_tests!` expands each test body once per backend (`cpu::*`, `wgpu::*`). The `cpu` arm checks
//! `CpuBackend<f32>` against `CpuBackend<f64>`: the same readable ops, but with f64 arithmetic and the f64
//! GEMM, so an f32-only path (the single-precision GEMM, a rounding or an overflow in f32) that goes wrong
//! turns it red. A case places all of its
//! f32 operands in ONE buffer, each after a gap of [`GAP`] elements (odd offsets, so views never start on
//! a binding alignment, and several operands share a buffer as the model's activations do), runs the op on
//! the backend under test and on the reference, then compares the WHOLE buffer: outputs, inputs that must
//! stay untouched, and the gaps. Shapes are odd (not multiples of any tile or workgroup size), include
//! T = 1 and vocabularies of 256 and 50257.
//!
//! Tolerances, per element, `|got - want| <= abs + rel * |want|` (inputs are uniform in [-1, 1]):
//! - copies, fill, residual/add, scale, encoder forward/backward, AdamW: 1e-6 abs, 1e-6 rel (one or a few
//!   roundings; sqrt and division are not exactly rounded in WGSL);
//! - matmul: 1e-5 * sqrt(K) abs, 1e-5 rel (K-term dot products, summed in a different order than the CPU
//!   GEMM, possibly with fused multiply-adds);
//! - layer norm, attention, GELU: 2e-5 abs, 1e-4 rel (reductions in another order; exp and tanh are not
//!   exactly rounded on GPUs);
//! - cross-entropy: 2e-5 abs, 1e-5 rel for losses; 1e-7 abs, 1e-4 rel for the gradient (probabilities ~1/V);
//! - sum_squares: 1e-6 relative (f32 block sums, added in f64).
//!
//! When no wgpu adapter exists the wgpu tests print "SKIP: no wgpu adapter" and pass, except under `CI=true`,
//! where they fail.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain::backend::cpu::CpuBackend;
use ringtrain::backend::matmul_bench::MatmulBench;
use ringtrain::backend::testing::{open_or_skip, Device};
use ringtrain::backend::wgpu::{list_adapters, AdapterSelection, WgpuBackend};
use ringtrain::backend::{AdamWStep, AttentionShape, Backend, MatmulShape, TokenView, View, WeightLayout};
use std::sync::{Mutex, MutexGuard, OnceLock};

const GAP: usize = 37;

#[derive(Clone, Copy, Debug)]
struct Tol {
    abs: f32,
    rel: f32,
}

const EXACTISH: Tol = Tol { abs: 1e-6, rel: 1e-6 };
const TRANSCENDENTAL: Tol = Tol { abs: 2e-5, rel: 1e-4 };

fn matmul_tol(k: usize) -> Tol {
    Tol {
        abs: 1e-5 * (k as f32).sqrt(),
        rel: 1e-5,
    }
}

/// The operands of one op invocation.
#[derive(Clone, Default)]
struct Case {
    f: Vec<Vec<f32>>,
    t: Vec<Vec<u32>>,
}

impl Case {
    fn rand(mut self, rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Self {
        self.f
            .push((0..n).map(|_| rng.random_range(-1.0..1.0f32) * scale).collect());
        self
    }
    fn zeros(mut self, n: usize) -> Self {
        self.f.push(vec![0.0; n]);
        self
    }
    fn positive(mut self, rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Self {
        self.f.push((0..n).map(|_| rng.random_range(lo..hi)).collect());
        self
    }
    fn tokens(mut self, rng: &mut ChaCha8Rng, n: usize, v: usize) -> Self {
        // Few distinct ids, so that the embedding backward accumulates repeated tokens.
        let pool: Vec<u32> = (0..(n / 2).max(1)).map(|_| rng.random_range(0..v as u32)).collect();
        self.t
            .push((0..n).map(|_| pool[rng.random_range(0..pool.len())]).collect());
        self
    }
}

type Op<'a> = &'a dyn Fn(&mut dyn Backend, &[View], &[TokenView]);

thread_local! {
    /// When set, `check` compares against `CpuBackend<f64>` instead of the f32 reference (the `cpu` arm,
    /// whose backend under test is the f32 reference itself).
    static F64_REFERENCE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// When non-zero, `run` places every operand across a multiple of this many elements (the segment size
    /// of the `wgpu_segmented` backend), so that each view straddles two wgpu buffers.
    static STRADDLE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Where each operand starts: after a gap of `GAP`, or straddling the next multiple of `STRADDLE`.
fn placement(lens: &[usize]) -> (Vec<usize>, usize) {
    let seg = STRADDLE.with(|s| s.get());
    let mut starts = Vec::new();
    let mut at = 0;
    for &len in lens {
        let mut start = at + GAP;
        if let Some(k) = start.checked_div(seg) {
            let boundary = (k + 1) * seg;
            start = start.max(boundary.saturating_sub(len / 2));
        }
        starts.push(start);
        at = start + len;
    }
    (starts, at + GAP)
}

/// Lays the case out in one buffer (and one token buffer), runs `op`, returns the whole f32 buffer.
fn run(be: &mut dyn Backend, case: &Case, op: Op) -> Vec<f32> {
    let lens: Vec<usize> = case.f.iter().map(|x| x.len()).collect();
    let (starts, total) = placement(&lens);
    let whole = be.alloc(total).unwrap();
    let mut views = Vec::new();
    for (x, &at) in case.f.iter().zip(&starts) {
        let v = whole.sub(at, x.len());
        be.upload(v, x).unwrap();
        views.push(v);
    }
    let ttotal: usize = case.t.iter().map(|x| x.len() + 3).sum::<usize>() + 3;
    let twhole = be.alloc_tokens(ttotal).unwrap();
    let mut tviews = Vec::new();
    let mut at = 3;
    for x in &case.t {
        let v = twhole.sub(at, x.len());
        be.upload_tokens(v, x).unwrap();
        tviews.push(v);
        at += x.len() + 3;
    }
    op(be, &views, &tviews);
    let mut out = vec![0f32; total];
    be.download(whole, &mut out).unwrap();
    out
}

/// Runs `op` on `be` and on the reference and compares the whole buffers.
fn check(be: &mut dyn Backend, name: &str, case: &Case, tol: Tol, op: Op) {
    let want = if F64_REFERENCE.with(|f| f.get()) {
        run(&mut CpuBackend::<f64>::new(), case, op)
    } else {
        run(&mut CpuBackend::<f32>::new(), case, op)
    };
    let got = run(be, case, op);
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let err = (g - w).abs();
        let bound = tol.abs + tol.rel * w.abs();
        assert!(
            err <= bound || (g.is_nan() && w.is_nan()),
            "{name} on {}: element {i}: got {g}, want {w} (err {err:e} > {bound:e})",
            be.name()
        );
        worst = worst.max(err);
    }
    eprintln!("{name}: max abs err {worst:e}");
}

// ---------------------------------------------------------------- test bodies

fn encoder(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for (b, t, c, v) in [(3, 5, 37, 256), (1, 1, 8, 256), (2, 3, 8, 50257)] {
        let case = Case::default()
            .zeros(b * t * c)
            .rand(&mut rng, v * c, 1.0)
            .rand(&mut rng, (t + 2) * c, 1.0)
            .tokens(&mut rng, b * t, v);
        check(
            be,
            &format!("encoder_forward b{b} t{t} c{c} v{v}"),
            &case,
            EXACTISH,
            &|be, f, tk| be.encoder_forward(f[0], tk[0], f[1], f[2], b, t, c),
        );
        let case = Case::default()
            .rand(&mut rng, v * c, 1.0)
            .rand(&mut rng, (t + 2) * c, 1.0)
            .rand(&mut rng, b * t * c, 1.0)
            .tokens(&mut rng, b * t, v);
        check(
            be,
            &format!("encoder_backward b{b} t{t} c{c} v{v}"),
            &case,
            EXACTISH,
            &|be, f, tk| be.encoder_backward(f[0], f[1], f[2], tk[0], b, t, c),
        );
    }
}

fn layernorm(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (n, c) in [(7, 37), (1, 300), (5, 1)] {
        let case = Case::default()
            .zeros(n * c)
            .zeros(n)
            .zeros(n)
            .rand(&mut rng, n * c, 2.0)
            .rand(&mut rng, c, 1.0)
            .rand(&mut rng, c, 1.0);
        check(
            be,
            &format!("layernorm_forward n{n} c{c}"),
            &case,
            TRANSCENDENTAL,
            &|be, f, _| be.layernorm_forward(f[0], f[1], f[2], f[3], f[4], f[5], n, c),
        );
        // Backward needs a consistent mean/rstd: compute them with the reference first.
        let inp: Vec<f32> = (0..n * c).map(|_| rng.random_range(-2.0..2.0f32)).collect();
        let (mut mean, mut rstd) = (vec![0f32; n], vec![0f32; n]);
        for r in 0..n {
            let x = &inp[r * c..][..c];
            let mu = x.iter().sum::<f32>() / c as f32;
            let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / c as f32;
            mean[r] = mu;
            rstd[r] = 1.0 / (var + 1e-5).sqrt();
        }
        let mut case = Case::default()
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c, 1.0)
            .rand(&mut rng, c, 1.0)
            .rand(&mut rng, n * c, 1.0);
        case.f.push(inp);
        case = case.rand(&mut rng, c, 1.0);
        case.f.push(mean);
        case.f.push(rstd);
        check(
            be,
            &format!("layernorm_backward n{n} c{c}"),
            &case,
            TRANSCENDENTAL,
            &|be, f, _| be.layernorm_backward(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], n, c),
        );
    }
}

fn matmul(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let shapes = [(7, 37, 53), (1, 70, 130), (65, 67, 129), (130, 17, 3), (2, 1, 5)];
    for (n, c, oc) in shapes {
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for bias in [true, false] {
                let s = MatmulShape { n, c, oc, layout };
                let case = Case::default()
                    .rand(&mut rng, n * oc, 1.0)
                    .rand(&mut rng, n * c, 1.0)
                    .rand(&mut rng, c * oc, 1.0)
                    .rand(&mut rng, oc, 1.0);
                let name = format!("matmul_forward {n}x{c}x{oc} {layout:?} bias={bias}");
                check(be, &name, &case, matmul_tol(c), &|be, f, _| {
                    be.matmul_forward(f[0], f[1], f[2], bias.then_some(f[3]), s)
                });
                let case = Case::default()
                    .rand(&mut rng, n * c, 1.0)
                    .rand(&mut rng, c * oc, 1.0)
                    .rand(&mut rng, oc, 1.0)
                    .rand(&mut rng, n * oc, 1.0)
                    .rand(&mut rng, n * c, 1.0)
                    .rand(&mut rng, c * oc, 1.0);
                let name = format!("matmul_backward {n}x{c}x{oc} {layout:?} bias={bias}");
                check(be, &name, &case, matmul_tol(n.max(oc)), &|be, f, _| {
                    be.matmul_backward(f[0], f[1], bias.then_some(f[2]), f[3], f[4], f[5], s)
                });
            }
        }
    }
}

fn attention(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for (b, t, c, nh) in [(2, 5, 12, 3), (1, 1, 8, 2), (2, 17, 20, 4)] {
        let s = AttentionShape { b, t, c, nh };
        let case = Case::default()
            .zeros(b * t * c)
            .zeros(b * nh * t * t)
            .rand(&mut rng, b * t * 3 * c, 2.0);
        check(
            be,
            &format!("attention_forward {s:?}"),
            &case,
            TRANSCENDENTAL,
            &|be, f, _| be.attention_forward(f[0], f[1], f[2], s),
        );
        // Backward reads the forward's probabilities: build them with the reference.
        let qkv: Vec<f32> = (0..b * t * 3 * c).map(|_| rng.random_range(-2.0..2.0f32)).collect();
        let mut cpu = CpuBackend::<f32>::new();
        let (o, a, q) = (
            cpu.alloc(b * t * c).unwrap(),
            cpu.alloc(b * nh * t * t).unwrap(),
            cpu.alloc(qkv.len()).unwrap(),
        );
        cpu.upload(q, &qkv).unwrap();
        cpu.attention_forward(o, a, q, s);
        let att = cpu.slice(a).to_vec();
        let mut case = Case::default()
            .rand(&mut rng, b * t * 3 * c, 1.0)
            .rand(&mut rng, b * nh * t * t, 1.0)
            .rand(&mut rng, b * t * c, 1.0);
        case.f.push(qkv);
        case.f.push(att);
        check(
            be,
            &format!("attention_backward {s:?}"),
            &case,
            TRANSCENDENTAL,
            &|be, f, _| be.attention_backward(f[0], f[1], f[2], f[3], f[4], s),
        );
    }
}

fn gelu(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for n in [1, 1000, 4099] {
        let case = Case::default().zeros(n).rand(&mut rng, n, 6.0);
        check(be, &format!("gelu_forward n{n}"), &case, TRANSCENDENTAL, &|be, f, _| {
            be.gelu_forward(f[0], f[1])
        });
        let case = Case::default()
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 6.0)
            .rand(&mut rng, n, 1.0);
        check(
            be,
            &format!("gelu_backward n{n}"),
            &case,
            TRANSCENDENTAL,
            &|be, f, _| be.gelu_backward(f[0], f[1], f[2]),
        );
    }
}

fn elementwise(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for n in [1, 333, 70001] {
        let case = Case::default()
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 1.0)
            .rand(&mut rng, n, 1.0);
        check(be, &format!("residual_forward n{n}"), &case, EXACTISH, &|be, f, _| {
            be.residual_forward(f[0], f[1], f[2])
        });
        check(be, &format!("add_inplace n{n}"), &case, EXACTISH, &|be, f, _| {
            be.add_inplace(f[0], f[1])
        });
        check(be, &format!("scale n{n}"), &case, EXACTISH, &|be, f, _| {
            be.scale(f[1], -0.37)
        });
        check(be, &format!("fill n{n}"), &case, EXACTISH, &|be, f, _| {
            be.fill(f[2], 1.25)
        });
        check(be, &format!("copy n{n}"), &case, EXACTISH, &|be, f, _| {
            be.copy(f[0], f[2])
        });
    }
}

fn crossentropy(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (n, v) in [(7, 256), (1, 256), (3, 50257)] {
        let case = Case::default()
            .zeros(n)
            .rand(&mut rng, n * v, 4.0)
            .tokens(&mut rng, n, v);
        let tol = Tol { abs: 2e-5, rel: 1e-5 };
        check(
            be,
            &format!("crossentropy_forward n{n} v{v}"),
            &case,
            tol,
            &|be, f, tk| be.crossentropy_forward(f[0], f[1], tk[0], n, v),
        );
        let tol = Tol { abs: 1e-7, rel: 1e-4 };
        check(
            be,
            &format!("crossentropy_backward in place n{n} v{v}"),
            &case,
            tol,
            &|be, f, tk| be.crossentropy_backward(f[1], f[1], tk[0], n, v, 0.3),
        );
        let case = case.zeros(n * v);
        check(
            be,
            &format!("crossentropy_backward n{n} v{v}"),
            &case,
            tol,
            &|be, f, tk| be.crossentropy_backward(f[2], f[1], tk[0], n, v, 1.0 / 7.0),
        );
    }
}

fn sum_squares_and_adamw(be: &mut dyn Backend) {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for n in [1, 4095, 4097, 30011, 150001] {
        let x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0f32)).collect();
        let mut cpu = CpuBackend::<f32>::new();
        let want = {
            let v = cpu.alloc(n).unwrap();
            cpu.upload(v, &x).unwrap();
            cpu.sum_squares(v).unwrap()
        };
        let (starts, total) = placement(&[n]);
        let v = be.alloc(total).unwrap().sub(starts[0], n);
        be.upload(v, &x).unwrap();
        let got = be.sum_squares(v).unwrap();
        assert!((got - want).abs() <= 1e-6 * want, "sum_squares n{n}: {got} vs {want}");
        let case = Case::default()
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
        check(be, &format!("adamw n{n}"), &case, EXACTISH, &|be, f, _| {
            be.adamw(f[0], f[1], f[2], f[3], &step)
        });
    }
    let nan = be.alloc(5).unwrap();
    be.upload(nan, &[1.0, f32::NAN, 0.0, 2.0, 3.0]).unwrap();
    assert!(
        !be.sum_squares(nan).unwrap().is_finite(),
        "sum_squares must propagate NaN"
    );
}

// ---------------------------------------------------------------- backends

/// One wgpu backend shared by the tests of this binary (compiling the kernels once).
fn shared_wgpu() -> Option<MutexGuard<'static, WgpuBackend>> {
    static BE: OnceLock<Option<Mutex<WgpuBackend>>> = OnceLock::new();
    open_wgpu(&BE, |_| {})
}

/// Segment size of the `wgpu_segmented` backend, in elements (256 KiB buffers).
const SEGMENT: usize = 65536;

/// A wgpu backend whose allocations are split into 256 KiB buffers (bindings capped alike), as a
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

macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $name() {
                    let mut be = ringtrain::backend::cpu::CpuBackend::<f32>::new();
                    super::F64_REFERENCE.with(|f| f.set(true));
                    super::$name(&mut be);
                }
            )*
        }
        mod wgpu {
            $(
                #[test]
                fn $name() {
                    let Some(mut be) = super::shared_wgpu() else { return };
                    super::$name(&mut *be);
                }
            )*
        }
        /// Every view straddles two 256 KiB segments of its allocation.
        mod wgpu_segmented {
            $(
                #[test]
                fn $name() {
                    let Some(mut be) = super::segmented_wgpu() else { return };
                    super::STRADDLE.with(|s| s.set(super::SEGMENT));
                    super::$name(&mut *be);
                }
            )*
        }
    };
}

/// The per-row reductions again, with the kernels this adapter does not use by default.
mod wgpu_other_reductions {
    #[test]
    fn layernorm() {
        let Some(mut be) = super::other_reductions_wgpu() else {
            return;
        };
        super::layernorm(&mut *be);
    }

    #[test]
    fn crossentropy() {
        let Some(mut be) = super::other_reductions_wgpu() else {
            return;
        };
        super::crossentropy(&mut *be);
    }
}

backend_tests!(
    encoder,
    layernorm,
    matmul,
    attention,
    gelu,
    elementwise,
    crossentropy,
    sum_squares_and_adamw
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
    let be = &mut be;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (n, c, v) = (5, 24, 7001);
    for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
        let s = MatmulShape { n, c, oc: v, layout };
        let case = Case::default()
            .rand(&mut rng, n * v, 1.0)
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c * v, 1.0)
            .rand(&mut rng, v, 1.0);
        check(
            be,
            &format!("split matmul_forward {layout:?}"),
            &case,
            matmul_tol(c),
            &|be, f, _| be.matmul_forward(f[0], f[1], f[2], Some(f[3]), s),
        );
        let case = Case::default()
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c * v, 1.0)
            .rand(&mut rng, v, 1.0)
            .rand(&mut rng, n * v, 1.0)
            .rand(&mut rng, n * c, 1.0)
            .rand(&mut rng, c * v, 1.0);
        check(
            be,
            &format!("split matmul_backward {layout:?}"),
            &case,
            matmul_tol(v),
            &|be, f, _| be.matmul_backward(f[0], f[1], Some(f[2]), f[3], f[4], f[5], s),
        );
    }
    let s = MatmulShape {
        n: 20000,
        c: 9,
        oc: 11,
        layout: WeightLayout::InOut,
    };
    let case = Case::default()
        .rand(&mut rng, 20000 * 9, 1.0)
        .rand(&mut rng, 99, 1.0)
        .rand(&mut rng, 11, 1.0)
        .rand(&mut rng, 20000 * 11, 1.0)
        .rand(&mut rng, 20000 * 9, 1.0)
        .rand(&mut rng, 99, 1.0);
    check(
        be,
        "split matmul_backward long k",
        &case,
        matmul_tol(20000),
        &|be, f, _| be.matmul_backward(f[0], f[1], Some(f[2]), f[3], f[4], f[5], s),
    );
    let (b, t) = (2, 3);
    let case = Case::default()
        .zeros(b * t * c)
        .rand(&mut rng, v * c, 1.0)
        .rand(&mut rng, t * c, 1.0)
        .tokens(&mut rng, b * t, v);
    check(be, "split encoder_forward", &case, EXACTISH, &|be, f, tk| {
        be.encoder_forward(f[0], tk[0], f[1], f[2], b, t, c)
    });
    let case = Case::default()
        .rand(&mut rng, v * c, 1.0)
        .rand(&mut rng, t * c, 1.0)
        .rand(&mut rng, b * t * c, 1.0)
        .tokens(&mut rng, b * t, v);
    check(be, "split encoder_backward", &case, EXACTISH, &|be, f, tk| {
        be.encoder_backward(f[0], f[1], f[2], tk[0], b, t, c)
    });
    let (rows, vocab) = (4, 50257);
    let case = Case::default()
        .zeros(rows)
        .rand(&mut rng, rows * vocab, 4.0)
        .tokens(&mut rng, rows, vocab);
    check(
        be,
        "split crossentropy_forward",
        &case,
        Tol { abs: 2e-5, rel: 1e-5 },
        &|be, f, tk| be.crossentropy_forward(f[0], f[1], tk[0], rows, vocab),
    );
    check(
        be,
        "split crossentropy_backward",
        &case,
        Tol { abs: 1e-7, rel: 1e-4 },
        &|be, f, tk| be.crossentropy_backward(f[1], f[1], tk[0], rows, vocab, 0.25),
    );
    let s = AttentionShape {
        b: 3,
        t: 150,
        c: 8,
        nh: 2,
    };
    let case = Case::default()
        .zeros(3 * 150 * 8)
        .zeros(3 * 2 * 150 * 150)
        .rand(&mut rng, 3 * 150 * 24, 2.0);
    check(be, "split attention_forward", &case, TRANSCENDENTAL, &|be, f, _| {
        be.attention_forward(f[0], f[1], f[2], s)
    });
    let len = 100_003;
    let case = Case::default()
        .rand(&mut rng, len, 1.0)
        .rand(&mut rng, len, 1.0)
        .rand(&mut rng, len, 0.1)
        .positive(&mut rng, len, 0.0, 0.01);
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
    check(be, "split adamw", &case, EXACTISH, &|be, f, _| {
        be.adamw(f[0], f[1], f[2], f[3], &step)
    });
    check(be, "split scale", &case, EXACTISH, &|be, f, _| be.scale(f[0], 3.0));
    let x: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0f32)).collect();
    let mut cpu = CpuBackend::<f32>::new();
    let cv = cpu.alloc(len).unwrap();
    cpu.upload(cv, &x).unwrap();
    let want = cpu.sum_squares(cv).unwrap();
    let wv = be.alloc(len + 5).unwrap().sub(5, len);
    be.upload(wv, &x).unwrap();
    let got = be.sum_squares(wv).unwrap();
    assert!((got - want).abs() <= 1e-6 * want, "split sum_squares: {got} vs {want}");
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
