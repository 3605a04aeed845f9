//! The op conformance suite: every op of a backend against the CPU reference (`CpuBackend<f32>`), or the
//! CPU reference itself against its f64 instance. The integration tests (`tests/conformance.rs`) and
//! `ringtrain selftest` run the same cases from here; each case returns a [`CaseResult`] instead of
//! panicking, so a user sees every op that is off, not only the first.
//!
//! A case places all of its f32 operands in ONE buffer, each after a gap of [`GAP`] elements (odd offsets, so
//! views never start on a binding alignment, and several operands share a buffer as the model's activations
//! do), runs the op on the backend under test and on the reference, then compares the WHOLE buffer: outputs,
//! inputs that must stay untouched, and the gaps. Shapes are odd (not multiples of any tile or workgroup
//! size), include T = 1 and vocabularies of 256 and 50257. Each [`Group`] draws its inputs from its own
//! seeded generator, so a case's inputs do not depend on which other groups run.
//!
//! [`Reference::F64`] compares against `CpuBackend<f64>`: the same readable ops, but with f64 arithmetic and
//! the f64 GEMM, so an f32-only path of the CPU backend (the single-precision GEMM, a rounding or an
//! overflow in f32) that goes wrong is caught. [`Settings::straddle`] places every operand across a multiple
//! of a segment size, so that each view straddles two buffers of a backend that splits allocations.
//!
//! Tolerances ([`tolerance`]), per element, `|got - want| <= abs + rel * |want|` (inputs are uniform in
//! [-1, 1]):
//! - copies, fill, residual/add, scale, encoder forward/backward, AdamW: 1e-6 abs, 1e-6 rel (one or a few
//!   roundings; sqrt and division are not exactly rounded in WGSL);
//! - matmul: 1e-5 * sqrt(K) abs, 1e-5 rel (K-term dot products, summed in a different order than the CPU
//!   GEMM, possibly with fused multiply-adds);
//! - layer norm, attention, GELU: 2e-5 abs, 1e-4 rel (reductions in another order; exp and tanh are not
//!   exactly rounded on GPUs);
//! - cross-entropy: 2e-5 abs, 1e-5 rel for losses; 1e-7 abs, 1e-4 rel for the gradient (probabilities ~1/V);
//! - sum_squares: 1e-6 relative (f32 block sums, added in f64).

mod cases;
mod harness;
pub mod tolerance;

pub use cases::{adamw_on, attention_forward_backward};
pub use harness::{placement, Op, Operands, Runner, GAP};
pub use tolerance::Tolerance;

use super::Backend;
use std::fmt;

/// What the backend under test is compared with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reference {
    /// `CpuBackend<f32>`: for every backend other than the CPU one.
    #[default]
    F32,
    /// `CpuBackend<f64>`: for the CPU backend itself.
    F64,
}

/// How a suite run compares and places its operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    pub reference: Reference,
    /// When set, every operand is placed across a multiple of this many elements (the segment size of a
    /// backend whose allocations are split into several buffers).
    pub straddle: Option<usize>,
}

/// The element furthest along (or past) its bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Worst {
    /// Index into the whole buffer (gaps included); 0 for a scalar result.
    pub index: usize,
    pub got: f64,
    pub want: f64,
    /// `|got - want|`, 0 where both are NaN.
    pub err: f64,
    /// `tolerance.abs + tolerance.rel * |want|`.
    pub bound: f64,
    pub tolerance: Tolerance,
}

/// What decided a case.
#[derive(Clone, Debug, PartialEq)]
pub enum Finding {
    /// The elements were compared: `mismatches` were out of tolerance, and `worst` is the one with the largest
    /// error relative to its bound.
    Elements { worst: Worst, mismatches: usize },
    /// A property without an element-wise tolerance, such as a NaN propagating.
    Property { holds: bool, what: String },
    /// The backend, or the reference, returned an error; nothing was compared.
    Error(String),
}

/// The outcome of one case.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseResult {
    /// The backend method, e.g. `matmul_forward`.
    pub op: String,
    /// The shape and variant, e.g. `7x37x53 InOut bias=true`.
    pub shape: String,
    pub finding: Finding,
}

impl CaseResult {
    pub fn passed(&self) -> bool {
        match &self.finding {
            Finding::Elements { mismatches, .. } => *mismatches == 0,
            Finding::Property { holds, .. } => *holds,
            Finding::Error(_) => false,
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::Elements { worst: w, mismatches } => {
                let relation = if w.err <= w.bound { "<=" } else { ">" };
                write!(
                    f,
                    "err {:.2e} {relation} {:.2e} at [{}] (got {:.8e}, want {:.8e})",
                    w.err, w.bound, w.index, w.got, w.want
                )?;
                if *mismatches > 0 {
                    write!(f, "; {mismatches} element(s) out of tolerance")?;
                }
                Ok(())
            }
            Finding::Property { what, .. } => f.write_str(what),
            Finding::Error(e) => write!(f, "error: {e}"),
        }
    }
}

impl fmt::Display for CaseResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.passed() { "PASS" } else { "FAIL" };
        write!(f, "{} {}: {verdict}, {}", self.op, self.shape, self.finding)
    }
}

/// The cases, grouped by the ops they test; each group has its own seeded inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    Encoder,
    Layernorm,
    Matmul,
    Attention,
    Gelu,
    Elementwise,
    Crossentropy,
    SumSquaresAndAdamw,
}

impl Group {
    pub const ALL: [Group; 8] = [
        Group::Encoder,
        Group::Layernorm,
        Group::Matmul,
        Group::Attention,
        Group::Gelu,
        Group::Elementwise,
        Group::Crossentropy,
        Group::SumSquaresAndAdamw,
    ];

    /// Runs this group's cases on `be`, handing each result to `sink` as soon as it is known.
    pub fn run(self, be: &mut dyn Backend, settings: Settings, sink: &mut dyn FnMut(CaseResult)) {
        let mut runner = Runner::new(be, settings, sink);
        match self {
            Group::Encoder => cases::encoder(&mut runner),
            Group::Layernorm => cases::layernorm(&mut runner),
            Group::Matmul => cases::matmul(&mut runner),
            Group::Attention => cases::attention(&mut runner),
            Group::Gelu => cases::gelu(&mut runner),
            Group::Elementwise => cases::elementwise(&mut runner),
            Group::Crossentropy => cases::crossentropy(&mut runner),
            Group::SumSquaresAndAdamw => cases::sum_squares_and_adamw(&mut runner),
        }
    }

    /// This group's results, in order.
    pub fn results(self, be: &mut dyn Backend, settings: Settings) -> Vec<CaseResult> {
        let mut results = Vec::new();
        self.run(be, settings, &mut |r| results.push(r));
        results
    }
}

/// Every group's cases on `be`, each result handed to `sink` as soon as it is known.
pub fn run_all(be: &mut dyn Backend, settings: Settings, sink: &mut dyn FnMut(CaseResult)) {
    for group in Group::ALL {
        group.run(be, settings, sink);
    }
}
