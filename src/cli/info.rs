//! `ringtrain info`: the backends and adapters found, and what `--backend auto` would pick and why.

use super::select::{cuda_status, select_backend};
use crate::backend::wgpu::list_adapters;
use anyhow::Result;

pub fn run_info() -> Result<()> {
    println!("ringtrain {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu:  reference backend, {} threads (set RAYON_NUM_THREADS to change)",
        rayon::current_num_threads()
    );
    let adapters = list_adapters();
    if adapters.is_empty() {
        println!("wgpu: no adapter found (no Vulkan/Metal/DX12 driver; on Linux, mesa-vulkan-drivers adds lavapipe)");
    } else {
        println!("wgpu: {} adapter(s)", adapters.len());
        for a in &adapters {
            println!("  {a}");
        }
    }
    println!("cuda: {}", cuda_status());
    let local_rank = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (_, reason) = select_backend("auto", local_rank)?;
    println!("--backend {reason}");
    Ok(())
}
