//! Checkpoints: Hugging Face GPT-2 directories and trainer state, written atomically.
