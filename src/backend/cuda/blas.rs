//! The matmuls as column-major GEMMs, and cuBLAS to run them, set up so that fp32 results are fp32 and
//! repeat bit for bit:
//! - `CUBLAS_DEFAULT_MATH`, which for fp32 computes in fp32 and never turns on TF32 (TF32 needs
//!   `CUBLAS_TF32_TENSOR_OP_MATH`), what PyTorch uses with `allow_tf32 = False`;
//! - a fixed workspace of its own, set once, so cuBLAS never picks algorithms by what memory it can get;
//! - one stream, the backend's compute stream.
//!
//! Row-major through column-major: a row-major `X [r, k]` is the column-major `X^T [k, r]` with leading
//! dimension `k`, so a row-major `C = A @ B` is the column-major `C^T = B^T @ A^T`: the operands are passed
//! swapped. cuBLAS sums `k` in its own order, so results agree with the other backends within the
//! conformance tolerances, not bit for bit.

use super::super::{BackendError, MatmulShape, WeightLayout};
use super::api::check_blas;
use super::gpu::{Addr, Gemm, Op};
use cudarc::cublas::sys as cublas;
use cudarc::driver::sys as cu;

/// Workspace bytes: what NVIDIA recommends for Hopper, enough for every fp32 GEMM algorithm.
const WORKSPACE_BYTES: usize = 32 << 20;

/// `out [n, oc] = inp [n, c] @ W`, W per `s.layout` (row-major), as a column-major GEMM.
pub(super) fn forward(out: Addr, inp: Addr, weight: Addr, s: MatmulShape) -> Gemm {
    // out^T [oc, n] = W^T [oc, c] @ inp^T [c, n]. InOut W [c, oc] is column-major [oc, c] already; OutIn
    // W [oc, c] is column-major [c, oc], transposed.
    let (op_a, lda) = match s.layout {
        WeightLayout::InOut => (Op::N, s.oc),
        WeightLayout::OutIn => (Op::T, s.c),
    };
    Gemm {
        op_a,
        op_b: Op::N,
        m: s.oc,
        n: s.n,
        k: s.c,
        a: weight,
        lda,
        b: inp,
        ldb: s.c,
        beta: 0.0,
        c: out,
        ldc: s.oc,
    }
}

/// `dinp [n, c] = dout [n, oc] @ W^T` (overwritten).
pub(super) fn backward_input(dinp: Addr, dout: Addr, weight: Addr, s: MatmulShape) -> Gemm {
    // dinp^T [c, n] = W [c, oc] @ dout^T [oc, n]. InOut W is column-major [oc, c]: transposed; OutIn W is
    // column-major [c, oc]: as is.
    let (op_a, lda) = match s.layout {
        WeightLayout::InOut => (Op::T, s.oc),
        WeightLayout::OutIn => (Op::N, s.c),
    };
    Gemm {
        op_a,
        op_b: Op::N,
        m: s.c,
        n: s.n,
        k: s.oc,
        a: weight,
        lda,
        b: dout,
        ldb: s.oc,
        beta: 0.0,
        c: dinp,
        ldc: s.c,
    }
}

/// `dweight += inp^T @ dout` in the weight's layout.
pub(super) fn backward_weight(dweight: Addr, inp: Addr, dout: Addr, s: MatmulShape) -> Gemm {
    match s.layout {
        // dW [c, oc] row-major is column-major [oc, c] = dout^T [oc, n] @ inp [n, c]: dout column-major is
        // [oc, n] as is, inp column-major is [c, n], transposed.
        WeightLayout::InOut => Gemm {
            op_a: Op::N,
            op_b: Op::T,
            m: s.oc,
            n: s.c,
            k: s.n,
            a: dout,
            lda: s.oc,
            b: inp,
            ldb: s.c,
            beta: 1.0,
            c: dweight,
            ldc: s.oc,
        },
        // dW [oc, c] row-major is column-major [c, oc] = inp^T [c, n] @ dout [n, oc].
        WeightLayout::OutIn => Gemm {
            op_a: Op::N,
            op_b: Op::T,
            m: s.c,
            n: s.oc,
            k: s.n,
            a: inp,
            lda: s.c,
            b: dout,
            ldb: s.oc,
            beta: 1.0,
            c: dweight,
            ldc: s.c,
        },
    }
}

/// A cuBLAS handle on the compute stream, with its workspace.
pub(super) struct Blas {
    handle: cublas::cublasHandle_t,
    workspace: cu::CUdeviceptr,
}

impl Blas {
    /// A handle on `stream` (the context must be current).
    pub(super) fn new(stream: cu::CUstream) -> Result<Self, BackendError> {
        let mut handle: cublas::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: cuBLAS loads (checked by the caller); `handle` is a valid out-pointer.
        check_blas(
            unsafe { cublas::cublasCreate_v2(&mut handle) },
            "creating a cuBLAS handle",
        )?;
        let mut blas = Blas { handle, workspace: 0 };
        // SAFETY: the context is current; `workspace` is a valid out-pointer.
        super::api::check(
            unsafe { cu::cuMemAlloc_v2(&mut blas.workspace, WORKSPACE_BYTES) },
            "allocating cuBLAS's workspace",
        )?;
        // SAFETY: the handle is live; the stream belongs to the current context; the workspace holds
        // WORKSPACE_BYTES and lives as long as the handle.
        unsafe {
            check_blas(
                cublas::cublasSetStream_v2(handle, stream as cublas::cudaStream_t),
                "setting cuBLAS's stream",
            )?;
            check_blas(
                cublas::cublasSetMathMode(handle, cublas::cublasMath_t::CUBLAS_DEFAULT_MATH),
                "setting cuBLAS's math mode",
            )?;
            check_blas(
                cublas::cublasSetWorkspace_v2(handle, blas.workspace as *mut _, WORKSPACE_BYTES),
                "setting cuBLAS's workspace",
            )?;
        }
        Ok(blas)
    }

    /// `CUBLAS_TF32_TENSOR_OP_MATH` (fp32 GEMMs round their inputs to TF32 on tensor cores, what PyTorch's
    /// `allow_tf32 = True` does), or back to `CUBLAS_DEFAULT_MATH`. With the fixed workspace, results still
    /// repeat bit for bit.
    pub(super) fn set_tf32(&self, on: bool) -> Result<(), BackendError> {
        let mode = match on {
            true => cublas::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
            false => cublas::cublasMath_t::CUBLAS_DEFAULT_MATH,
        };
        // SAFETY: the handle is live and its context current (the caller binds it).
        check_blas(
            unsafe { cublas::cublasSetMathMode(self.handle, mode) },
            "setting cuBLAS's math mode",
        )
    }

    /// Queues `g` on the handle's stream.
    pub(super) fn run(&self, g: &Gemm) -> Result<(), BackendError> {
        // cuBLAS refuses a leading dimension of 0, which a degenerate shape (c or oc of 0) would give.
        let (lda, ldb, ldc) = (g.lda.max(1), g.ldb.max(1), g.ldc.max(1));
        let dims = [g.m, g.n, g.k, lda, ldb, ldc];
        if dims.iter().any(|&d| d > i32::MAX as usize) {
            return Err(BackendError::ShapeUnsupported {
                op: "matmul".into(),
                detail: format!("needs dimensions below 2^31 for cuBLAS, got {dims:?}"),
            });
        }
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let op = |o| match o {
            Op::N => cublas::cublasOperation_t::CUBLAS_OP_N,
            Op::T => cublas::cublasOperation_t::CUBLAS_OP_T,
        };
        let alpha = 1.0f32;
        // SAFETY: the handle is live and on the compute stream; the addresses hold the column-major
        // operands `g` describes (the ops checked the views' lengths against the shape); alpha and beta are
        // host scalars (the default pointer mode) valid for the call.
        let status = unsafe {
            cublas::cublasSgemm_v2(
                self.handle,
                op(g.op_a),
                op(g.op_b),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &alpha,
                g.a as *const f32,
                lda as i32,
                g.b as *const f32,
                ldb as i32,
                &g.beta,
                g.c as *mut f32,
                ldc as i32,
            )
        };
        check_blas(status, "cuBLAS sgemm")
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle and workspace were made by `new` and are released once; the driver waited for
        // its streams before dropping this.
        unsafe {
            cublas::cublasDestroy_v2(self.handle);
            if self.workspace != 0 {
                cu::cuMemFree_v2(self.workspace);
            }
        }
    }
}
