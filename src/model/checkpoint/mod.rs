//! Checkpoints: Hugging Face GPT-2 directories and trainer state, written atomically.
//!
//! A checkpoint directory holds:
//! - `config.json`: a Hugging Face `GPT2Config` (see [`hf_config_json`]);
//! - `model.safetensors`: the parameters under `transformer.<name>` keys, F32, Conv1D weights `[in, out]`,
//!   the tied `lm_head` not stored, so `GPT2LMHeadModel.from_pretrained(dir)` loads it as is;
//! - `trainer_state.safetensors` (optional): the AdamW moments and the counters needed to resume.
//!
//! Loading is strict about shapes and names and lenient about the harmless differences between Hugging Face
//! checkpoints (key prefix, `attn.bias` buffers, a stored copy of the tied head, F16/BF16 weights).
//! Every check that depends on the file runs before the parameter buffer is allocated, so a hostile file
//! cannot make the loader allocate more than the file itself holds.
//!
//! [`save_checkpoint`] replaces a checkpoint directory atomically; see [`atomic`] for the scheme.

mod atomic;
mod hf_config;
mod model_files;
mod tensor_io;
mod trainer_state;

pub use atomic::{check_save_target, resolve_checkpoint_dir, save_checkpoint, save_checkpoint_with_hook, SaveStage};
pub use hf_config::{config_from_hf_json, hf_config_json};
pub use model_files::{load_model, load_model_bytes, save_model_files};
pub use trainer_state::{load_trainer_state, load_trainer_state_bytes, save_trainer_state, TrainerState};

/// The Hugging Face model configuration.
pub const CONFIG_FILE: &str = "config.json";
/// The model parameters.
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer moments and resume counters.
pub const TRAINER_STATE_FILE: &str = "trainer_state.safetensors";
/// The key prefix Hugging Face's `GPT2LMHeadModel` puts before every transformer parameter.
pub const HF_PREFIX: &str = "transformer.";

/// Every file name a checkpoint we write can contain. A directory holding anything else is not ours, so
/// [`save_checkpoint`] refuses to replace or delete it.
pub(crate) const CHECKPOINT_FILES: [&str; 3] = [CONFIG_FILE, MODEL_FILE, TRAINER_STATE_FILE];
