//! Feeds arbitrary bytes to `ringtrain train --config FILE` as the TOML file, up to the validated training
//! options: parse, merge with (no) flags, build the model shape, resolve the options. It must return an error
//! or options, never panic. Run: `cd fuzz && cargo +nightly fuzz run config_read`.
#![no_main]

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

/// The parser lives in the binary crate; compiling its source here fuzzes that code itself.
#[allow(dead_code)]
#[path = "../../src/cli/args.rs"]
mod args;

/// One file per fuzzing process, rewritten for every input (the parser reads a path).
fn config_path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| std::env::temp_dir().join(format!("ringtrain-fuzz-config-{}.toml", std::process::id())))
}

fuzz_target!(|data: &[u8]| {
    // Rewritten in place: truncating on open costs milliseconds on some file systems.
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(config_path())
        .expect("opening the config file");
    file.write_all(data).expect("writing the config file");
    file.set_len(data.len() as u64).expect("sizing the config file");
    drop(file);
    let flags = args::TrainArgs {
        config: Some(config_path().clone()),
        ..Default::default()
    };
    if let Ok(merged) = flags.merged_with_file() {
        if let Ok(model) = merged.model_config() {
            let _ = merged.resolve(&model, 1);
        }
    }
});
