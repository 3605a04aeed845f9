//! `ringtrain info`: the backends and adapters found, and what `--backend auto` would pick and why.

use anyhow::Result;
use ringtrain::backend::factory::{cuda_report, select, BackendChoice};
use ringtrain::backend::wgpu::list_adapters;

pub fn run_info() -> Result<()> {
    println!("ringtrain {}", env!("CARGO_PKG_VERSION"));
    println!(
        "cpu:  reference backend, {} cores (train uses them all, or --threads N; launch divides them among its ranks)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
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
    println!("cuda:");
    for line in cuda_report() {
        println!("  {line}");
    }
    let local_rank = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let auto = select(BackendChoice::Auto, local_rank)?;
    println!("--backend {}", auto.reason);
    Ok(())
}
