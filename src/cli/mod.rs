//! The `ringtrain` binary's command line (not part of the library): flags and TOML into the trainer's options,
//! the subcommands, progress and plots.

pub mod args;
pub mod backend;
pub mod bench_allreduce;
pub mod bench_kernels;
pub mod eval;
pub mod info;
pub mod launch;
pub mod plot;
pub mod progress;
pub mod sample;
pub mod selftest;
pub mod tokenize;
pub mod train;
