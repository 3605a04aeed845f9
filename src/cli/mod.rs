//! The command line: subcommands, progress, metrics and plots.

pub mod args;
pub mod bench_allreduce;
pub mod bench_kernels;
pub mod eval;
pub mod info;
pub mod launch;
pub mod plot;
pub mod progress;
pub mod sample;
pub mod select;
pub mod train;
