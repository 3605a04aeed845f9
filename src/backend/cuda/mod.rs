//! The CUDA backend: every op of [`Backend`] on an NVIDIA GPU, through cudarc's bindings to the driver API,
//! NVRTC and cuBLAS, all three loaded at run time so that `cargo build --features cuda` needs no CUDA.
//!
//! Where each part lives (all behind the `cuda` feature):
//! - `api.rs`: which CUDA libraries this machine has, and their status codes as [`BackendError`]s.
//! - `report.rs`: what `ringtrain info` says about CUDA (driver, devices, NVRTC).
//! - `compile.rs`: `kernels/*.cu` compiled by NVRTC to CUBIN for the device's architecture, and the on-disk
//!   cache of the results.
//! - `gpu.rs`: the [`gpu::Gpu`] trait, everything the ops ask of a device, so that the same op logic runs
//!   on the driver and, in tests, on an emulator that executes the kernels on the CPU (`emulator.rs`).
//! - `driver.rs`: the real device: the context, the two streams (compute, and copies out), the loaded
//!   kernels, cuBLAS.
//! - `device.rs`: the backend's state over a `Gpu`: allocations behind views, token host copies, scratch.
//! - `blas.rs`: the four matmul layouts as column-major GEMMs, and cuBLAS set up for repeatable fp32.
//! - `readback.rs`: read-backs that run on the copy stream while the compute stream goes on.
//! - `staging.rs`: uploads through a ring of pinned slots, so they stay asynchronous.
//! - `ops.rs`: the ops of [`Backend`], each a kernel launch or a GEMM in the order of `kernels/README.md`.
//!
//! Design points:
//! - **One compute stream.** Every op, copy and cuBLAS call goes on it in program order, so the ops need no
//!   events between them; ops do not return errors (the trait's rule), the first failure is kept and
//!   returned by the next synchronisation point.
//! - **Views are pointers.** A view becomes its buffer's device pointer plus the view's offset, so kernels
//!   never see offsets; they index in 32 bits, and a launch whose views hold 2^32 elements or more is refused
//!   with [`BackendError::ShapeUnsupported`].
//! - **Determinism.** No atomics, fixed reduction trees, the embedding backward grouped by token on the host
//!   (as the wgpu backend does), NVRTC with `--fmad=false`, cuBLAS without TF32 and with its own fixed
//!   workspace.

#[cfg(feature = "cuda")]
mod api;
#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod compile;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(all(feature = "cuda", test))]
mod emulator;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod readback;
#[cfg(feature = "cuda")]
mod report;
#[cfg(feature = "cuda")]
mod staging;

use super::Backend;
#[cfg(not(feature = "cuda"))]
use anyhow::bail;
use anyhow::Result;

#[cfg(feature = "cuda")]
use device::CudaBackend;

/// Lines on CUDA for `ringtrain info`: what this build has, and, with the `cuda` feature, which pieces this
/// machine has (driver version, devices with memory and compute capability, NVRTC and cuBLAS).
pub fn info_lines() -> Vec<String> {
    #[cfg(feature = "cuda")]
    {
        report::lines()
    }
    #[cfg(not(feature = "cuda"))]
    {
        vec!["not built: this build lacks the `cuda` cargo feature (cargo build --release --features cuda)".into()]
    }
}

/// The number of CUDA devices this process can use: 0 without the `cuda` feature, without the driver
/// library, or when the driver finds none. Never fails.
pub fn device_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        api::device_count().unwrap_or(0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Opens CUDA device `device` and compiles (or loads from the cache) every kernel. The error names what is
/// missing: the `cuda` feature, the driver, a GPU, NVRTC, cuBLAS, or the kernel and line NVRTC refused.
pub fn open(device: usize) -> Result<Box<dyn Backend>> {
    #[cfg(feature = "cuda")]
    {
        Ok(Box::new(CudaBackend::new(device)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        bail!("cuda backend (device {device}): not built; this build lacks the `cuda` cargo feature (build with --features cuda)")
    }
}
