//! The command line: subcommands, progress, metrics and plots.

pub mod metrics;
pub mod plot;
pub mod progress;
