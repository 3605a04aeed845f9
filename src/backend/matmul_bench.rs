//! Timing forward matmuls through the [`Backend`] trait, for `ringtrain bench kernels` and the backends'
//! tests: ops are queued, then `synchronize` waits for them, so a GPU backend is timed on the device.

use super::{Backend, MatmulForward, MatmulShape, View, WeightLayout};
use anyhow::Result;
use std::time::Instant;

/// `[m, k] @ [k, n]` forward matmuls on one backend's buffers, warmed up once when made.
pub struct MatmulBench {
    a: View,   // [m, k]
    w: View,   // [k, n], InOut
    out: View, // [m, n]
    shape: MatmulShape,
}

impl MatmulBench {
    pub fn new<B: Backend + ?Sized>(be: &mut B, m: usize, k: usize, n: usize) -> Result<Self> {
        let (a, w, out) = (be.alloc(m * k)?, be.alloc(k * n)?, be.alloc(m * n)?);
        be.fill(a, 0.5);
        be.fill(w, 0.25);
        let shape = MatmulShape {
            n: m,
            c: k,
            oc: n,
            layout: WeightLayout::InOut,
        };
        be.matmul_forward(
            MatmulForward {
                out,
                inp: a,
                weight: w,
                bias: None,
                shape,
            }
            .checked(),
        );
        be.synchronize()?;
        Ok(MatmulBench { a, w, out, shape })
    }

    /// `iters` matmuls queued, then synchronized: GFLOP/s (2·m·k·n per matmul).
    pub fn gflops<B: Backend + ?Sized>(&mut self, be: &mut B, iters: usize) -> Result<f64> {
        let started = Instant::now();
        for _ in 0..iters {
            be.matmul_forward(
                MatmulForward {
                    out: self.out,
                    inp: self.a,
                    weight: self.w,
                    bias: None,
                    shape: self.shape,
                }
                .checked(),
            );
        }
        be.synchronize()?;
        let secs = started.elapsed().as_secs_f64();
        let flops = 2.0 * (self.shape.n * self.shape.c * self.shape.oc) as f64 * iters as f64;
        Ok(flops / secs / 1e9)
    }
}
