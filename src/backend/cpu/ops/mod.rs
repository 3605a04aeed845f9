//! The reference ops: plain, readable Rust that specifies what every backend computes. Generic over the
//! float type so that gradient checks can run the very same code in f64.
//!
//! Parallelism (rayon) is only over independent outputs — rows, columns or sequences — and every sum runs in a
//! fixed order, so results are bit-identical run to run whatever the thread count.

mod adamw;
mod attention;
mod crossentropy;
mod elementwise;
mod encoder;
mod layernorm;
mod matmul;
mod reduce;

pub use adamw::{adamw, adamw_runs};
pub use attention::{attention_backward, attention_forward};
pub use crossentropy::{crossentropy_backward_inplace, crossentropy_forward, crossentropy_forward_backward};
pub use elementwise::{add_inplace, gelu_backward, gelu_forward, residual_forward, scale};
pub use encoder::{encoder_backward, encoder_forward};
pub use layernorm::{add_layernorm_forward, layernorm_backward, layernorm_forward, LAYERNORM_EPS};
pub use matmul::{matmul_backward, matmul_forward, matmul_gelu_forward};
pub use reduce::{sum_squares, SUM_BLOCK};

use super::real::Real;

/// Elements per rayon task in elementwise ops: enough work to amortise scheduling, small enough to split.
pub(crate) const ELEMENTWISE_GRAIN: usize = 4096;

pub(crate) fn c<F: Real>(x: f64) -> F {
    F::from_f64(x)
}
