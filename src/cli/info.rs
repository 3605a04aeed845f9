//! `ringtrain info`: the backends found, and what `--backend auto` would pick and why.

use super::select::{backend_report, select_backend};
use anyhow::Result;

pub fn run_info() -> Result<()> {
    println!("ringtrain {}", env!("CARGO_PKG_VERSION"));
    println!("backends:");
    for (name, usable, why) in backend_report() {
        println!("  {name:<5} {} {why}", if usable { "yes" } else { "no " });
    }
    let (_, reason) = select_backend("auto")?;
    println!("--backend {reason}");
    println!(
        "cpu threads: {} (set RAYON_NUM_THREADS to change)",
        rayon::current_num_threads()
    );
    Ok(())
}
