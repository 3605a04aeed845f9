//! What `ringtrain info` says about CUDA: each piece found or missing, so a user sees at once why
//! `--backend cuda` would fail.

use super::super::BackendError;
use super::api::{self, Library};

/// An error without the `cuda backend: ` its messages start with elsewhere.
fn plain(e: BackendError) -> String {
    let text = e.to_string();
    text.strip_prefix("cuda backend: ").unwrap_or(&text).to_string()
}

/// One line per piece: the driver and its CUDA version, each device (name, memory, compute capability),
/// NVRTC's version, cuBLAS.
pub(super) fn lines() -> Vec<String> {
    let mut lines = Vec::new();
    match api::driver_version() {
        Ok((major, minor)) => lines.push(format!("driver: found, CUDA {major}.{minor}")),
        Err(e) => lines.push(format!("driver: {}", plain(e))),
    }
    if Library::Driver.present() {
        match api::device_count() {
            Ok(0) => lines.push("devices: none".into()),
            Ok(count) => {
                for ordinal in 0..count {
                    lines.push(match api::device_info(ordinal) {
                        Ok(d) => format!(
                            "device {ordinal}: {}, {:.1} GiB, compute capability {}.{}",
                            d.name,
                            d.total_bytes as f64 / (1u64 << 30) as f64,
                            d.capability.0,
                            d.capability.1
                        ),
                        Err(e) => format!("device {ordinal}: {}", plain(e)),
                    });
                }
            }
            Err(e) => lines.push(format!("devices: {}", plain(e))),
        }
    }
    match api::nvrtc_version() {
        Ok((major, minor)) => lines.push(format!("nvrtc: found, version {major}.{minor}")),
        Err(e) => lines.push(format!("nvrtc: {}", plain(e))),
    }
    lines.push(match api::cublas_major() {
        Ok(major) => format!("cublas: found, version {major}"),
        Err(e) => format!("cublas: {}", plain(e)),
    });
    lines
}
