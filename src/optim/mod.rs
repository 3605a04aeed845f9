//! The optimizer: AdamW with torch semantics, the learning-rate schedule and global-norm clipping.

pub mod adamw;
pub mod schedule;

pub use adamw::{AdamW, AdamWConfig};
pub use schedule::LrSchedule;
