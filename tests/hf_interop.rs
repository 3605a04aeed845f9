//! A checkpoint written by `ringtrain train` loads in Hugging Face transformers
//! (`GPT2LMHeadModel.from_pretrained`) and gives the same logits within 1e-4, checked by
//! `scripts/hf_check.py`. Skips with a notice where python3, torch or transformers is missing.

use std::process::Command;

fn python_has_transformers() -> bool {
    Command::new("python3")
        .args(["-c", "import torch, transformers"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[test]
fn trained_checkpoint_matches_transformers_logits() {
    if !python_has_transformers() {
        eprintln!("SKIP: python3 with torch and transformers not found (pip install -r scripts/requirements.txt)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let dump = dir.path().join("logits.safetensors");
    let bin = env!("CARGO_BIN_EXE_ringtrain");
    let train = Command::new(bin)
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "20",
            "--eval-every",
            "0",
            "--save",
        ])
        .arg(&ck)
        .output()
        .unwrap();
    assert!(train.status.success(), "{}", String::from_utf8_lossy(&train.stderr));
    let eval = Command::new(bin)
        .args(["eval", "--data", "synthetic", "--batches", "1", "--checkpoint"])
        .arg(&ck)
        .arg("--dump-logits")
        .arg(&dump)
        .output()
        .unwrap();
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/hf_check.py");
    let check = Command::new("python3")
        .arg(script)
        .arg(&ck)
        .arg("--expect")
        .arg(&dump)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    eprintln!("{out}{}", String::from_utf8_lossy(&check.stderr));
    assert!(check.status.success() && out.contains("PASS"), "hf_check failed");
}
