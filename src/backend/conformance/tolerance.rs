//! How far a backend's element may be from the reference's, per kind of op (the module doc of
//! [`super`] says why each bound is what it is).

/// Per element, `|got - want| <= abs + rel * |want|`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub abs: f32,
    pub rel: f32,
}

impl Tolerance {
    /// The bound for an element whose reference value is `want`, in f32 as the comparison runs.
    pub fn bound(self, want: f32) -> f32 {
        self.abs + self.rel * want.abs()
    }
}

/// Copies, fill, residual/add, scale, the encoder and AdamW: one or a few roundings.
pub const EXACTISH: Tolerance = Tolerance { abs: 1e-6, rel: 1e-6 };

/// Layer norm, attention, GELU: reductions in another order, exp and tanh not exactly rounded.
pub const TRANSCENDENTAL: Tolerance = Tolerance { abs: 2e-5, rel: 1e-4 };

/// Cross-entropy losses.
pub const CROSSENTROPY_LOSS: Tolerance = Tolerance { abs: 2e-5, rel: 1e-5 };

/// Cross-entropy gradients: probabilities of about 1/V, so a tiny absolute bound.
pub const CROSSENTROPY_GRAD: Tolerance = Tolerance { abs: 1e-7, rel: 1e-4 };

/// `sum_squares`: f32 block sums added in f64, compared relatively.
pub const SUM_SQUARES: Tolerance = Tolerance { abs: 0.0, rel: 1e-6 };

/// A matmul whose dot products have `k` terms, summed in another order than the CPU GEMM's.
pub fn matmul(k: usize) -> Tolerance {
    Tolerance {
        abs: 1e-5 * (k as f32).sqrt(),
        rel: 1e-5,
    }
}
