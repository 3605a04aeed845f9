//! `--backend NAME`: parsed and opened through the library's [factory](ringtrain::backend::factory), with errors
//! that name the flag.

use anyhow::{Context, Result};
use ringtrain::backend::factory::{self, BackendChoice, Selection};
use ringtrain::backend::{Backend, BackendError};

/// `--backend name`; a missing flag is `auto`.
pub fn parse_backend(name: Option<&str>) -> Result<BackendChoice> {
    name.map_or(Ok(BackendChoice::Auto), str::parse).context("--backend")
}

/// Opens the backend `choice` names for the process with `local_rank`.
pub fn open_backend(choice: BackendChoice, local_rank: usize) -> Result<(Box<dyn Backend>, Selection)> {
    factory::open(choice, local_rank).map_err(|e| match choice {
        BackendChoice::Wgpu => e.context("--backend wgpu (`ringtrain info` lists the adapters found)"),
        _ => e.context(format!("--backend {choice}")),
    })
}

/// Adds what the user can change on the command line to a backend error that a flag can avoid: a shape
/// the backend refuses, or device memory running out.
pub fn with_flag_hints(e: anyhow::Error) -> anyhow::Error {
    let hint = match e.downcast_ref::<BackendError>() {
        Some(BackendError::ShapeUnsupported { .. }) => {
            "this backend cannot run this shape: use --backend cpu, or a smaller --batch-size or --seq-len"
        }
        Some(BackendError::OutOfMemory { .. }) => {
            "the device is out of memory: use a smaller --batch-size or --seq-len (or --grad-accum to keep the global batch)"
        }
        _ => return e,
    };
    e.context(hint)
}
