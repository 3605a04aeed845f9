//! The GPT-2 model: configuration, flat parameter layout, initialisation, forward/backward, checkpoints.

pub mod config;
pub mod layout;

pub use config::ModelConfig;
pub use layout::{ParamLayout, ParamSpec};
pub mod checkpoint;
pub mod gpt2;
pub mod init;

pub use gpt2::Gpt2;
