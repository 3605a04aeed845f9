//! `bench/device/run.sh`, the one command that checks an NVIDIA machine, run here in its mode that skips the
//! GPU parts (`--no-gpu`) against the binaries under test: it must report every check it knows, the CUDA,
//! NVIDIA-Vulkan and GPU benchmark ones skipped with the reason, and pass the rest (info, the CPU self-test,
//! the sim's bit-identity, the figure plumbing, and the wgpu self-test on lavapipe, required under `CI=true`).
//!
//! `ringtrain-sim` is looked for beside `ringtrain` in the target folder, where `cargo test --workspace`
//! builds it. Alone (`cargo test -p ringtrain --test device_script`) the sim may be missing: the test then
//! skips with a notice, except under `CI=true`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

/// Every check run.sh reports, in its order.
const CHECKS: [&str; 21] = [
    "gpu",
    "binaries",
    "cuda_libs",
    "cuda_driver",
    "vulkan_loader",
    "vulkan_nvidia",
    "info",
    "selftest_cuda",
    "bench_step_cuda",
    "torch_step",
    "torch_matmul",
    "torch_step_tf32",
    "bench_step_cuda_tf32",
    "profile_cuda",
    "selftest_wgpu",
    "bench_step_wgpu",
    "matmul_cuda",
    "matmul_wgpu",
    "sim",
    "selftest_cpu",
    "bench_step_cpu",
];

/// The checks that need an NVIDIA GPU, skipped in the no-GPU mode.
const GPU_CHECKS: [&str; 13] = [
    "gpu",
    "cuda_driver",
    "vulkan_nvidia",
    "selftest_cuda",
    "bench_step_cuda",
    "torch_step",
    "torch_matmul",
    "torch_step_tf32",
    "bench_step_cuda_tf32",
    "profile_cuda",
    "bench_step_wgpu",
    "matmul_cuda",
    "matmul_wgpu",
];

struct Row {
    status: String,
    figure: String,
    note: String,
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Runs run.sh in its no-GPU mode with the binaries of `bin_dir`; returns its output and results.tsv by check.
fn run_script(bin_dir: &Path) -> (Output, BTreeMap<String, Row>) {
    let out_dir = tempfile::tempdir().unwrap();
    let runtime_dir = tempfile::tempdir().unwrap(); // lavapipe's XDG_RUNTIME_DIR
    let started = Instant::now();
    let output = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/device/run.sh"))
        .args(["--no-gpu", "--budget", "240", "--bin"])
        .arg(bin_dir)
        .arg("--out")
        .arg(out_dir.path())
        .env("XDG_RUNTIME_DIR", runtime_dir.path())
        .env_remove("PEAK_TFLOPS")
        .output()
        .expect("running bench/device/run.sh");
    eprintln!("run.sh took {:.1} s", started.elapsed().as_secs_f64());
    let tsv = std::fs::read_to_string(out_dir.path().join("results.tsv")).expect("results.tsv");
    let mut lines = tsv.lines();
    assert_eq!(lines.next(), Some("check\tstatus\tfigure\tnote"), "results.tsv header");
    let mut rows = BTreeMap::new();
    for line in lines {
        let fields: Vec<&str> = line.split('\t').collect();
        assert_eq!(fields.len(), 4, "results.tsv line {line:?}");
        let row = Row {
            status: fields[1].into(),
            figure: fields[2].into(),
            note: fields[3].into(),
        };
        assert!(["pass", "fail", "skipped"].contains(&fields[1]), "status of {line:?}");
        assert!(
            rows.insert(fields[0].to_string(), row).is_none(),
            "{} reported twice",
            fields[0]
        );
    }
    let log = std::fs::read_to_string(out_dir.path().join("log.txt")).expect("log.txt");
    assert!(log.contains("=== summary"), "log.txt lacks the summary:\n{log}");
    (output, rows)
}

fn show(output: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn without_a_gpu_the_script_skips_the_cuda_parts_and_passes_the_rest() {
    let ringtrain = PathBuf::from(env!("CARGO_BIN_EXE_ringtrain"));
    let bin_dir = ringtrain.parent().unwrap();
    if !bin_dir.join("ringtrain-sim").exists() {
        assert!(!in_ci(), "CI=true but {} has no ringtrain-sim", bin_dir.display());
        eprintln!(
            "SKIP without_a_gpu_the_script_skips_the_cuda_parts_and_passes_the_rest: no ringtrain-sim in {} \
             (cargo build --profile test -p ringtrain-sim)",
            bin_dir.display()
        );
        return;
    }
    let (output, rows) = run_script(bin_dir);
    let context = show(&output);
    assert!(output.status.success(), "run.sh failed:\n{context}");
    assert_eq!(
        rows.len(),
        CHECKS.len(),
        "checks reported: {:?}\n{context}",
        rows.keys()
    );
    for check in CHECKS {
        let row = rows
            .get(check)
            .unwrap_or_else(|| panic!("{check} not reported\n{context}"));
        assert_ne!(row.status, "fail", "{check}: {}\n{context}", row.note);
        if GPU_CHECKS.contains(&check) {
            assert_eq!(row.status, "skipped", "{check}\n{context}");
            assert!(row.note.contains("--no-gpu given"), "{check}'s reason: {}", row.note);
        }
    }
    for check in ["binaries", "info", "selftest_cpu", "sim", "bench_step_cpu"] {
        assert_eq!(rows[check].status, "pass", "{check}: {}\n{context}", rows[check].note);
    }
    let (cpu, sim, step) = (&rows["selftest_cpu"], &rows["sim"], &rows["bench_step_cpu"]);
    assert!(
        cpu.figure
            .split_once('/')
            .is_some_and(|(a, b)| a == b && a.parse::<u32>().is_ok_and(|n| n > 0)),
        "selftest_cpu figure {:?}",
        cpu.figure
    );
    assert_eq!(sim.figure, "bit-identical");
    assert!(
        step.figure.ends_with(" tok/s") && step.note.starts_with("MFU "),
        "bench_step_cpu: {} / {}",
        step.figure,
        step.note
    );
    // wgpu runs on lavapipe where it exists, and CI has it.
    let wgpu = &rows["selftest_wgpu"];
    if in_ci() || wgpu.status == "pass" {
        assert_eq!(wgpu.status, "pass", "selftest_wgpu: {}\n{context}", wgpu.note);
        assert!(sim.note.starts_with("backends cpu,wgpu,cpu:"), "sim: {}", sim.note);
    } else {
        eprintln!("NOTE: selftest_wgpu skipped here: {}", wgpu.note);
        assert!(wgpu.note.contains("no wgpu adapter"), "selftest_wgpu: {}", wgpu.note);
    }
}

#[test]
fn without_binaries_the_script_fails_and_says_how_to_make_them() {
    let empty = tempfile::tempdir().unwrap();
    let (output, rows) = run_script(empty.path());
    let context = show(&output);
    assert_eq!(output.status.code(), Some(1), "{context}");
    let binaries = &rows["binaries"];
    assert_eq!(binaries.status, "fail", "{context}");
    assert!(binaries.note.contains("pack.sh"), "{}", binaries.note);
    for check in ["info", "selftest_cpu", "sim", "bench_step_cpu"] {
        assert_eq!(rows[check].status, "skipped", "{check}\n{context}");
        assert!(
            rows[check].note.contains("see binaries"),
            "{check}: {}",
            rows[check].note
        );
    }
    assert_eq!(rows.len(), CHECKS.len(), "{context}");
}
