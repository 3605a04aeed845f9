//! Which backend a run uses: `--backend auto|cpu|wgpu|cuda`, and the reasons, for `ringtrain info`.

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
}

/// One line per backend: is it usable here, and why (not).
pub fn backend_report() -> Vec<(String, bool, String)> {
    vec![
        (
            "cpu".into(),
            true,
            format!("reference backend, {} threads (rayon)", rayon::current_num_threads()),
        ),
        (
            "wgpu".into(),
            false,
            "not part of this build yet: the WGSL backend is tracked as issue #3".into(),
        ),
        (
            "cuda".into(),
            false,
            if cfg!(feature = "cuda") {
                "the `cuda` feature is on, but no CUDA backend is implemented in this version".into()
            } else {
                "not built (build with --features cuda)".into()
            },
        ),
    ]
}

/// Resolves `--backend`. `auto` prefers CUDA, then a hardware wgpu adapter, then the CPU; only the CPU
/// exists in this build, so it picks the CPU and says so in `ringtrain info`.
pub fn select_backend(name: &str) -> Result<(BackendKind, String)> {
    match name {
        "auto" => Ok((
            BackendKind::Cpu,
            "auto: no GPU backend in this build, using the CPU reference backend".into(),
        )),
        "cpu" => Ok((BackendKind::Cpu, "cpu: requested".into())),
        "wgpu" | "cuda" => {
            let reason = backend_report()
                .into_iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, _, r)| r)
                .unwrap_or_default();
            bail!("--backend {name} is unavailable: {reason}")
        }
        other => bail!("unknown --backend {other:?}: expected auto, cpu, wgpu or cuda"),
    }
}
