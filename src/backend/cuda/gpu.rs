//! The seam between the CUDA backend's op logic and the device that runs it: [`Gpu`] is everything the ops
//! ask of a device (memory, copies, kernel launches, GEMMs, read-backs). The driver (`driver.rs`) is the real
//! one; the tests also run the same ops on an emulator that executes `kernels/*.cu` on the CPU, so that the
//! op logic, the kernels and the GEMM layouts are checked without a GPU.

use super::super::BackendError;

/// A device address.
pub(super) type Addr = u64;

/// One kernel parameter, of the size the kernel declares.
#[derive(Clone, Copy, Debug)]
pub(super) enum Param {
    /// A pointer (`float*`, `const u32*`).
    Ptr(Addr),
    /// A `u32` size.
    U32(u32),
    /// A `float` scalar.
    F32(f32),
}

/// cuBLAS's operation on an operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    /// As stored.
    N,
    /// Transposed.
    T,
}

/// One column-major fp32 GEMM: `C [m, n] = op(A) [m, k] @ op(B) [k, n] + beta * C` (alpha 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Gemm {
    pub(super) op_a: Op,
    pub(super) op_b: Op,
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) a: Addr,
    pub(super) lda: usize,
    pub(super) b: Addr,
    pub(super) ldb: usize,
    /// 0 (overwrite) or 1 (accumulate).
    pub(super) beta: f32,
    pub(super) c: Addr,
    pub(super) ldc: usize,
}

/// What the CUDA ops need of a device. Work is queued in call order; errors may surface at the call or at
/// the next call that waits.
pub(super) trait Gpu {
    /// e.g. `device 0: NVIDIA H200, sm_90, 139.8 GiB`.
    fn describe(&self) -> String;
    /// `words` zero-filled 4-byte words (at least one, so every buffer has an address).
    fn alloc(&mut self, words: usize, what: &str) -> Result<Addr, BackendError>;
    /// Frees an allocation once every queued use of it (read-backs included) is done.
    fn free(&mut self, addr: Addr) -> Result<(), BackendError>;
    /// Copies `src` to `dst` in queue order; `src` may change once this returns.
    fn write(&mut self, dst: Addr, src: &[u8]) -> Result<(), BackendError>;
    /// Copies `dst.len()` bytes from `src` after all queued work, and waits for them.
    fn read(&mut self, src: Addr, dst: &mut [u8]) -> Result<(), BackendError>;
    /// Sets `words` words at `dst` to `bits`.
    fn fill(&mut self, dst: Addr, bits: u32, words: usize) -> Result<(), BackendError>;
    /// Copies `bytes` from `src` to `dst` (no overlap).
    fn copy(&mut self, dst: Addr, src: Addr, bytes: usize) -> Result<(), BackendError>;
    /// Runs `kernel` on `blocks` blocks of `threads` threads (at most 256) with `params` in its parameter
    /// order.
    fn launch(&mut self, kernel: &'static str, blocks: u32, threads: u32, params: &[Param])
        -> Result<(), BackendError>;
    fn gemm(&mut self, gemm: &Gemm) -> Result<(), BackendError>;
    /// Whether the GEMMs from now on round their inputs to TF32 (tensor cores) instead of computing in fp32.
    fn set_tf32(&mut self, on: bool) -> Result<(), BackendError>;
    /// Starts copying `words` floats at `src` out, after the work queued so far, without waiting; returns
    /// a ticket.
    fn begin_read(&mut self, src: Addr, words: usize) -> Result<u64, BackendError>;
    fn read_ready(&mut self, ticket: u64) -> Result<bool, BackendError>;
    /// Waits for read `ticket` and moves its floats into `host`.
    fn finish_read(&mut self, ticket: u64, host: &mut Vec<f32>) -> Result<(), BackendError>;
    /// Waits for all queued work.
    fn synchronize(&mut self) -> Result<(), BackendError>;
    /// Free device memory in bytes, where known.
    fn free_memory(&self) -> Option<u64>;
}
