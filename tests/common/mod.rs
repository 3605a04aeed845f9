//! Helpers shared by the integration tests (each test crate that needs them declares `mod common;`).

#![allow(dead_code)]

use std::path::PathBuf;

/// The PyTorch golden state for `tiny` kept in the repository (`tests/fixtures/gpt2-tiny-pytorch`, written
/// by `scripts/make_reference.py`). Panics when it is missing: it is part of the repository, so a missing
/// dump means a broken checkout, never a reason to pass.
pub fn pytorch_reference_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2-tiny-pytorch");
    for file in ["expected.safetensors", "model/config.json", "model/model.safetensors"] {
        assert!(
            dir.join(file).is_file(),
            "the PyTorch reference dump is incomplete: {} is missing (regenerate it with scripts/make_reference.py)",
            dir.join(file).display()
        );
    }
    dir
}
