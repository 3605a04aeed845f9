//! The one place that makes backends: a [`BackendChoice`] (`auto`, `cpu`, `wgpu` or `cuda`) is resolved on
//! this machine into a [`Selection`] (which backend, which adapter, and why), and [`open`] makes it. Code
//! outside `backend/` names no concrete backend.
//!
//! `auto` prefers CUDA (when built with the `cuda` feature and the driver sees an NVIDIA GPU), then a
//! hardware wgpu adapter, then the CPU backend; when CUDA is picked but cannot open (NVRTC or cuBLAS
//! missing, say), [`open`] says why and moves on to the next. A software Vulkan device such as lavapipe is slower than the CPU backend, so `auto` never picks
//! it; asking for `wgpu` does. The local rank picks among several adapters.

use super::cpu::CpuBackend;
use super::wgpu::{list_adapters, AdapterReport, AdapterSelection, WgpuBackend};
use super::{cuda, Backend};
use anyhow::{bail, Result};

/// Which backend a run asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// The fastest one this machine has (see the module doc).
    #[default]
    Auto,
    Cpu,
    Wgpu,
    Cuda,
}

impl BackendChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Wgpu => "wgpu",
            BackendChoice::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BackendChoice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "wgpu" => Ok(BackendChoice::Wgpu),
            "cuda" => Ok(BackendChoice::Cuda),
            other => bail!("unknown backend {other:?}: expected auto, cpu, wgpu or cuda"),
        }
    }
}

/// A concrete backend to open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Wgpu(AdapterSelection),
    /// CUDA device `device`.
    Cuda {
        device: usize,
    },
}

/// A choice resolved on this machine: the backend to open and why it was picked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub kind: BackendKind,
    /// One line such as `auto: hardware adapter NVIDIA H100`.
    pub reason: String,
}

/// Lines on CUDA in this build and on this machine, for `ringtrain info`.
pub fn cuda_report() -> Vec<String> {
    cuda::info_lines()
}

/// Resolves `choice` for the process with `local_rank`, without opening anything.
pub fn select(choice: BackendChoice, local_rank: usize) -> Result<Selection> {
    if choice == BackendChoice::Auto && may_have_gpu() {
        let devices = cuda::device_count();
        if devices > 0 {
            let device = local_rank % devices;
            return Ok(Selection {
                kind: BackendKind::Cuda { device },
                reason: format!("auto: CUDA device {device} of {devices}"),
            });
        }
    }
    select_without_cuda(choice, local_rank)
}

/// [`select`] as if CUDA were absent: where `auto` goes when CUDA cannot open.
fn select_without_cuda(choice: BackendChoice, local_rank: usize) -> Result<Selection> {
    let selection = |kind, reason: String| Ok(Selection { kind, reason });
    match choice {
        BackendChoice::Cpu => selection(BackendKind::Cpu, "cpu: requested".into()),
        BackendChoice::Wgpu => {
            let adapters = list_adapters();
            let count = usable(&adapters).count();
            if count == 0 {
                bail!(
                    "no usable wgpu adapter found (on Linux without a GPU, install mesa-vulkan-drivers for lavapipe)"
                );
            }
            let pick = usable(&adapters).nth(local_rank % count).expect("index below count");
            selection(
                BackendKind::Wgpu(AdapterSelection::any().with_index(local_rank % count)),
                format!("wgpu: requested, adapter {}", pick.name),
            )
        }
        BackendChoice::Cuda => selection(
            BackendKind::Cuda { device: local_rank },
            format!("cuda: requested, device {local_rank}"),
        ),
        BackendChoice::Auto => {
            if !may_have_gpu() {
                return selection(
                    BackendKind::Cpu,
                    "auto: no GPU device node on this machine, so the CPU backend".into(),
                );
            }
            let adapters = list_adapters();
            let hardware: Vec<&AdapterReport> = usable(&adapters).filter(|a| !a.is_software).collect();
            if hardware.is_empty() {
                return selection(
                    BackendKind::Cpu,
                    "auto: no CUDA device and no hardware GPU adapter, so the CPU backend (software adapters such as lavapipe are slower than it)".into(),
                );
            }
            let index = local_rank % hardware.len();
            selection(
                BackendKind::Wgpu(AdapterSelection::hardware().with_index(index)),
                format!("auto: hardware adapter {}", hardware[index].name),
            )
        }
    }
}

/// Opens the backend `kind` names.
pub fn open_kind(kind: BackendKind) -> Result<Box<dyn Backend>> {
    Ok(match kind {
        BackendKind::Cpu => Box::new(CpuBackend::<f32>::new()),
        BackendKind::Wgpu(adapter) => Box::new(WgpuBackend::new(adapter)?),
        BackendKind::Cuda { device } => cuda::open(device)?,
    })
}

/// Resolves `choice` for the process with `local_rank` and opens it. Under `auto`, a CUDA device that
/// cannot open (a library missing, a kernel refused) is reported and the next backend is opened instead.
pub fn open(choice: BackendChoice, local_rank: usize) -> Result<(Box<dyn Backend>, Selection)> {
    let selection = select(choice, local_rank)?;
    match open_kind(selection.kind) {
        Ok(backend) => Ok((backend, selection)),
        Err(e) if choice == BackendChoice::Auto && matches!(selection.kind, BackendKind::Cuda { .. }) => {
            let mut next = select_without_cuda(choice, local_rank)?;
            tracing::warn!("--backend auto: CUDA found but unusable ({e:#}); {}", next.reason);
            next.reason = format!("{} (CUDA unusable: {e:#})", next.reason);
            let backend = open_kind(next.kind)?;
            Ok((backend, next))
        }
        Err(e) => Err(e),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_and_print() {
        for name in ["auto", "cpu", "wgpu", "cuda"] {
            assert_eq!(name.parse::<BackendChoice>().unwrap().to_string(), name);
        }
        let err = "nope".parse::<BackendChoice>().unwrap_err().to_string();
        assert!(
            err.contains("\"nope\"") && err.contains("auto, cpu, wgpu or cuda"),
            "{err}"
        );
    }

    #[test]
    fn cpu_opens_without_a_gpu() {
        let (be, selection) = open(BackendChoice::Cpu, 3).unwrap();
        assert_eq!(selection.kind, BackendKind::Cpu);
        assert!(be.name().starts_with("cpu"), "{}", be.name());
    }

    #[test]
    fn cuda_says_what_is_missing() {
        if cuda::device_count() > 0 {
            println!("SKIP: this machine has a CUDA device, so nothing is missing");
            return;
        }
        let err = format!("{:#}", open(BackendChoice::Cuda, 0).err().expect("no CUDA device here"));
        // With the feature, a machine without CUDA lacks the driver library, or its driver sees no GPU.
        let says_what = if cfg!(feature = "cuda") {
            err.contains("libcuda.so.1) was not found") || err.contains("finds no NVIDIA GPU")
        } else {
            err.contains("`cuda` cargo feature")
        };
        assert!(err.contains("cuda backend") && says_what, "{err}");
    }

    #[test]
    fn auto_opens_a_backend_where_cuda_is_missing() {
        let (_, selection) = open(BackendChoice::Auto, 0).unwrap();
        if cuda::device_count() == 0 {
            assert!(!matches!(selection.kind, BackendKind::Cuda { .. }), "{selection:?}");
        }
    }
}
