//! The one rule for tests that need a device, shared by the unit tests, the integration tests and the sim's
//! tests: when the device cannot be opened, a test skips with a printed notice, except that under `CI=true`
//! a missing wgpu adapter fails it (CI installs lavapipe, so a missing adapter there is a broken set-up,
//! not a machine without a GPU). A missing NVIDIA GPU always skips: CI never has one.

use std::fmt;

/// What a test needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Any wgpu adapter, software ones included.
    Wgpu,
    /// An NVIDIA GPU for the CUDA backend.
    Cuda,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Wgpu => "wgpu adapter",
            Device::Cuda => "NVIDIA GPU",
        })
    }
}

/// Whether this run is CI's (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The opened device, or `None` after printing `SKIP: no <device> (<why>)`. Panics instead of skipping
/// where the rule above says the test must fail.
pub fn open_or_skip<T>(device: Device, opened: anyhow::Result<T>) -> Option<T> {
    match opened {
        Ok(value) => Some(value),
        Err(e) => {
            assert!(
                !(in_ci() && device == Device::Wgpu),
                "CI=true but no {device} could be opened: {e:#}"
            );
            eprintln!("SKIP: no {device} ({e:#})");
            None
        }
    }
}

/// Whether a wgpu adapter exists, by the rule above: `false` after printing `SKIP: ...` where none does,
/// and a panic under `CI=true`. For tests that open their adapters elsewhere (the sim's ranks).
pub fn wgpu_available() -> bool {
    let found = if super::wgpu::list_adapters().is_empty() {
        Err(anyhow::anyhow!("list_adapters() found none"))
    } else {
        Ok(())
    };
    open_or_skip(Device::Wgpu, found).is_some()
}
