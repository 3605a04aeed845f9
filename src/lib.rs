//! ringtrain: a data-parallel GPT-2 trainer. See ARCHITECTURE.md for the map of the crate.

pub mod backend;
pub mod collective;
pub mod data;
pub mod dist;
pub mod elastic;
pub mod fault_plan;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod trainer;
