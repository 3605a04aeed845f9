//! A rank lost mid-training, as a user meets it under `ringtrain launch`: frozen with SIGSTOP or killed with
//! SIGKILL, with the ring links on shared memory (launch's default on one host) and on QUIC. Every other rank must exit non-zero within `--timeout` plus a few seconds, naming the lost rank
//! (not a healthy neighbour that was only waiting on it); `launch` then ends the rest, a stopped child
//! included, and exits non-zero; no partial checkpoint is left.

mod common;

use common::worker_pid;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT_S: u64 = 6;

fn steps_logged(metrics: &Path) -> usize {
    std::fs::read_to_string(metrics).map_or(0, |s| s.lines().count())
}

/// Starts 3 ranks with their ring links over `transport`, lets them train, sends `signal` to rank 2, and
/// checks how the job ends.
fn lose_rank_two(signal: &str, transport: &str) {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let ckpt = dir.path().join("ckpt");
    let timeout = TIMEOUT_S.to_string();
    let mut launch = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args([
            "launch",
            "--nproc",
            "3",
            "--",
            "train",
            "--steps",
            "100000",
            "--batch-size",
            "2",
        ])
        .args([
            "--seq-len",
            "16",
            "--eval-every",
            "0",
            "--threads",
            "1",
            "--timeout",
            &timeout,
            "--transport",
            transport,
        ])
        .args(["--save-every", "1000000", "--save"])
        .arg(&ckpt)
        .arg("--metrics")
        .arg(&metrics)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while steps_logged(&metrics) < 5 {
        assert!(started.elapsed() < Duration::from_secs(60), "the job never got going");
        assert!(launch.try_wait().unwrap().is_none(), "the job ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    let victim = worker_pid(&launch, 2);
    let status = Command::new("kill")
        .args([signal, &victim.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let lost_at = Instant::now();
    // Everyone must be done within the deadline plus a few seconds; a stopped rank never exits by itself.
    let limit = Duration::from_secs(TIMEOUT_S + 8);
    let status = loop {
        if let Some(status) = launch.try_wait().unwrap() {
            break status;
        }
        if lost_at.elapsed() > limit {
            let _ = Command::new("kill").args(["-KILL", &victim.to_string()]).status();
            let _ = launch.kill();
            panic!("the job was still running {limit:?} after rank 2 got {signal}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = lost_at.elapsed();
    let mut stderr = String::new();
    launch.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(!status.success(), "launch exited 0 after losing rank 2:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Both survivors say why they stopped, and blame rank 2 alone.
    // (launch's own closing line lists every rank that exited non-zero.)
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error:") && !l.contains("of the workers failed"))
        .collect();
    assert!(errors.len() >= 2, "expected an error from each survivor:\n{stderr}");
    for line in &errors {
        assert!(
            line.contains("rank 2"),
            "a survivor blamed someone else: {line}\n{stderr}"
        );
        // "rank 2 is dead: rank 0 lost its link to it: ..." blames rank 2, with the survivor that saw it first
        // as the witness (over shared memory the survivor sees the link's end at once); any other mention of
        // a healthy rank blames it.
        let (blamed, _witness) = line.split_once(" lost its link to it").unwrap_or((line, ""));
        let blamed = blamed
            .strip_suffix("rank 0")
            .or(blamed.strip_suffix("rank 1"))
            .unwrap_or(blamed);
        assert!(
            !blamed.contains("rank 0 ") && !blamed.contains("rank 1 "),
            "names a healthy rank: {line}"
        );
    }
    assert!(!ckpt.exists(), "a checkpoint appeared: {}", ckpt.display());
    eprintln!("rank 2 lost by {signal} over {transport}: job ended {took:.1?} later; survivors said {errors:?}");
}

#[test]
fn a_frozen_rank_is_named_by_every_survivor_and_ended_by_launch() {
    lose_rank_two("-STOP", "shm");
}

#[test]
fn a_killed_rank_is_named_by_every_survivor() {
    lose_rank_two("-KILL", "shm");
}

#[test]
fn a_frozen_rank_is_named_over_quic_links_too() {
    lose_rank_two("-STOP", "quic");
}

#[test]
fn a_killed_rank_is_named_over_quic_links_too() {
    lose_rank_two("-KILL", "quic");
}

/// The fault plan armed in real processes through `RINGTRAIN_INJECT_FAULT`: a rank crashed at the start of
/// a step (its connections closed without a goodbye, as a killed process's are) is named dead by both
/// survivors, and `launch` ends non-zero.
#[test]
fn a_rank_crashed_by_the_fault_plan_is_named_by_every_survivor() {
    let out = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args([
            "launch",
            "--nproc",
            "3",
            "--",
            "train",
            "--model",
            "tiny",
            "--n-layer",
            "1",
        ])
        .args([
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--steps",
            "8",
            "--eval-every",
            "0",
        ])
        .args(["--timeout", &TIMEOUT_S.to_string()])
        .env("RINGTRAIN_INJECT_FAULT", "kill=2:3")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("FAULT INJECTION ARMED (RINGTRAIN_INJECT_FAULT=kill=2:3)"),
        "{stderr}"
    );
    assert!(stderr.contains("error: rank 2: injected crash at step 3"), "{stderr}");
    let named = stderr
        .lines()
        .filter(|l| l.starts_with("error: rank 2 is dead"))
        .count();
    assert_eq!(named, 2, "both survivors name rank 2:\n{stderr}");
}
