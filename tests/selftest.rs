//! `ringtrain selftest` end to end: the CPU backend passes every conformance case against the f64 reference
//! and prints one row per case, wgpu passes on whatever adapter exists (lavapipe in CI), and CUDA either
//! passes or says what is missing.

mod common;
use common::{fails_with_all, ringtrain};
use ringtrain::backend::conformance::{self, Reference, Settings};
use ringtrain::backend::cpu::CpuBackend;
use ringtrain::backend::factory::{open_kind, BackendKind};
use ringtrain::backend::testing::wgpu_available;

/// How many cases the library's suite has (counted on the CPU backend, which takes a fraction of a second).
fn case_count() -> usize {
    let mut count = 0;
    let settings = Settings {
        reference: Reference::F64,
        straddle: None,
    };
    conformance::run_all(&mut CpuBackend::<f32>::new(), settings, &mut |_| count += 1);
    count
}

/// Runs `ringtrain selftest --backend NAME` (and `extra`), asserts success, and returns stdout after checking
/// that it holds one PASS row per case and the summary line naming `backend_prefix`.
fn passes(backend: &str, extra: &[&str], backend_prefix: &str) -> String {
    let mut args = vec!["selftest", "--backend", backend];
    args.extend_from_slice(extra);
    let out = ringtrain(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ringtrain {args:?} failed:\n{stdout}\n{stderr}");
    let cases = case_count();
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("op "))
        .skip(1)
        .take_while(|l| !l.starts_with("selftest:"))
        .collect();
    assert_eq!(rows.len(), cases, "one row per case expected:\n{stdout}");
    for row in &rows {
        let columns: Vec<&str> = row.split_whitespace().collect();
        assert!(columns.contains(&"PASS") && !columns.contains(&"FAIL"), "{row}");
    }
    let summary = format!("selftest: {cases}/{cases} passed on {backend_prefix}");
    assert!(stdout.contains(&summary), "{summary:?} missing:\n{stdout}");
    stdout
}

#[test]
fn selftest_cpu_passes_against_f64_and_prints_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("selftest.json");
    let stdout = passes("cpu", &["--json", json.to_str().unwrap()], "cpu");
    assert!(stdout.contains("reference: cpu f64"), "{stdout}");
    for op in [
        "encoder_backward",
        "layernorm_backward",
        "matmul_backward",
        "attention_backward",
        "gelu_backward",
        "residual_forward",
        "crossentropy_backward",
        "adamw",
        "sum_squares",
    ] {
        assert!(stdout.lines().any(|l| l.starts_with(op)), "no {op} row:\n{stdout}");
    }
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cases = case_count();
    assert_eq!(doc["total"], cases);
    assert_eq!(doc["passed"], cases);
    let listed = doc["cases"].as_array().unwrap();
    assert_eq!(listed.len(), cases);
    assert!(
        listed.iter().all(|c| c["passed"] == true && c["op"].is_string()),
        "{doc}"
    );
}

#[test]
fn selftest_wgpu_passes() {
    if !wgpu_available() {
        return;
    }
    let stdout = passes("wgpu", &[], "wgpu");
    assert!(stdout.contains("reference: cpu f32"), "{stdout}");
}

/// Without a CUDA device (always in CI, and in builds without the `cuda` feature) the command fails with the
/// reason the backend gives; with one, every case passes.
#[test]
fn selftest_cuda_passes_or_says_what_is_missing() {
    match open_kind(BackendKind::Cuda { device: 0 }) {
        Ok(_) => {
            passes("cuda", &[], "");
        }
        Err(e) => {
            let reason = format!("{e:#}");
            eprintln!("no CUDA device: {reason}");
            fails_with_all(&["selftest", "--backend", "cuda"], &["--backend cuda", &reason]);
        }
    }
}
