//! `--backend NAME`: parsed and opened through the library's [factory](ringtrain::backend::factory), with errors
//! that name the flag.

use anyhow::{Context, Result};
use ringtrain::backend::factory::{self, BackendChoice, Selection};
use ringtrain::backend::Backend;

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
