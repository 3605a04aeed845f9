//! Which backend a run uses: `--backend auto|cpu|wgpu|cuda`, and the reasons, for `ringtrain info`.
//!
//! `auto` prefers CUDA (when built, with an NVIDIA GPU), then a hardware wgpu adapter, then the CPU
//! backend. A software Vulkan device such as lavapipe is slower than the CPU backend, so `auto` never
//! picks it; `--backend wgpu` does. LOCAL_RANK picks among several adapters.

use crate::backend::wgpu::{list_adapters, AdapterReport, AdapterSelection};
use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Wgpu(AdapterSelection),
}

/// Why CUDA is not available in this build.
pub fn cuda_status() -> &'static str {
    if cfg!(feature = "cuda") {
        "the `cuda` feature is on, but this version has no CUDA kernels yet"
    } else {
        "not built (and no CUDA kernels exist yet in this version)"
    }
}

/// Adapters that can run ringtrain's kernels.
fn usable(adapters: &[AdapterReport]) -> impl Iterator<Item = &AdapterReport> {
    adapters.iter().filter(|a| a.unsupported.is_none())
}

/// Whether this machine could have a hardware GPU at all. On Linux every hardware Vulkan driver needs a
/// device node (`/dev/dri/renderD*` for Mesa and AMD/Intel, `/dev/nvidia*`, `/dev/dxg` under WSL); without
/// one, `auto` skips loading the Vulkan drivers (which is slow, and noisy where only lavapipe exists).
fn may_have_gpu() -> bool {
    if !cfg!(target_os = "linux") {
        return true;
    }
    let dri = std::fs::read_dir("/dev/dri")
        .map(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("renderD"))
        })
        .unwrap_or(false);
    dri || std::path::Path::new("/dev/nvidia0").exists() || std::path::Path::new("/dev/dxg").exists()
}

/// Resolves `--backend` for the process with `local_rank`.
pub fn select_backend(name: &str, local_rank: usize) -> Result<(BackendKind, String)> {
    match name {
        "cpu" => Ok((BackendKind::Cpu, "cpu: requested".into())),
        "wgpu" => {
            let adapters = list_adapters();
            let count = usable(&adapters).count();
            if count == 0 {
                bail!("--backend wgpu: no usable wgpu adapter found (on Linux without a GPU, install mesa-vulkan-drivers for lavapipe); `ringtrain info` lists what was found");
            }
            let pick = usable(&adapters).nth(local_rank % count).expect("index below count");
            let selection = AdapterSelection::any().with_index(local_rank % count);
            Ok((
                BackendKind::Wgpu(selection),
                format!("wgpu: requested, adapter {}", pick.name),
            ))
        }
        "cuda" => bail!("--backend cuda is unavailable: {}", cuda_status()),
        "auto" => {
            if !may_have_gpu() {
                return Ok((
                    BackendKind::Cpu,
                    "auto: no GPU device node on this machine, so the CPU backend".into(),
                ));
            }
            let adapters = list_adapters();
            let hardware: Vec<&AdapterReport> = usable(&adapters).filter(|a| !a.is_software).collect();
            if hardware.is_empty() {
                return Ok((
                    BackendKind::Cpu,
                    "auto: no CUDA build and no hardware GPU adapter, so the CPU backend (software adapters such as lavapipe are slower than it)".into(),
                ));
            }
            let index = local_rank % hardware.len();
            let selection = AdapterSelection::hardware().with_index(index);
            Ok((
                BackendKind::Wgpu(selection),
                format!("auto: hardware adapter {}", hardware[index].name),
            ))
        }
        other => bail!("unknown --backend {other:?}: expected auto, cpu, wgpu or cuda"),
    }
}
