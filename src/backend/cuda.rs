//! The CUDA backend's place in the [factory](super::factory). This version has no CUDA kernels, so asking
//! for CUDA is an error that says what is missing: the `cuda` feature when it is off, the kernels when it is
//! on. The feature compiles one of the two stubs below.

use super::Backend;
use anyhow::{bail, Result};

/// One line on CUDA in this build, for `ringtrain info`.
#[cfg(not(feature = "cuda"))]
pub const STATUS: &str = "not built (and no CUDA kernels exist yet in this version)";
/// One line on CUDA in this build, for `ringtrain info`.
#[cfg(feature = "cuda")]
pub const STATUS: &str = "the `cuda` feature is on, but this version has no CUDA kernels yet";

/// Opens CUDA device `device`: always an error in this version, naming what is missing.
#[cfg(not(feature = "cuda"))]
pub fn open(device: usize) -> Result<Box<dyn Backend>> {
    bail!("cuda backend (device {device}): not built; it needs the `cuda` feature (and this version has no CUDA kernels yet)")
}

/// Opens CUDA device `device`: always an error in this version, naming what is missing.
#[cfg(feature = "cuda")]
pub fn open(device: usize) -> Result<Box<dyn Backend>> {
    bail!("cuda backend (device {device}): not implemented in this version (the `cuda` feature is on, but there are no CUDA kernels yet)")
}
