//! Helpers shared by the integration tests (each test crate that needs them declares `mod common;`).

#![allow(dead_code)]

pub mod udp_relay;

use std::path::PathBuf;
use std::process::{Child, Command, Output};

/// Runs the `ringtrain` binary built for these tests with `args`.
pub fn ringtrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args(args)
        .output()
        .expect("run ringtrain")
}

/// Runs a command that must fail cleanly: non-zero exit, an `error:` line containing every needle, no panic.
pub fn fails_with_all(args: &[&str], needles: &[&str]) {
    let out = ringtrain(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ringtrain {args:?} should fail");
    assert!(!stderr.contains("panicked"), "ringtrain {args:?} panicked:\n{stderr}");
    for needle in needles {
        assert!(
            stderr.contains("error:") && stderr.contains(needle),
            "ringtrain {args:?}: expected {needle:?} in\n{stderr}"
        );
    }
}

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

/// Whether this process runs with effective uid 0 (namespaces, slurmd). `Uid:` in /proc/self/status lists
/// the real, effective, saved and filesystem uids.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Runs `bash script args` from the repository with `RINGTRAIN_BIN` set to the binary under test and `env`
/// added; prints its output and how long it took, and returns it.
pub fn run_repo_script(script: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let started = std::time::Instant::now();
    let out = Command::new("bash")
        .arg(&path)
        .args(args)
        .env("RINGTRAIN_BIN", env!("CARGO_BIN_EXE_ringtrain"))
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    eprintln!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{script} took {:.1} s", started.elapsed().as_secs_f64());
    out
}

/// Per step of one rank: the agreed loss and the replica's fingerprint.
pub type Run = Vec<(f64, String)>;

/// Every rank's replica is the same after every step, and the losses follow `reference` (one worker on the
/// same global batch) within 1e-5.
pub fn assert_trains_like(ranks: &[Run], reference: &Run, what: &str) {
    for (rank, run) in ranks.iter().enumerate() {
        assert_eq!(run.len(), reference.len(), "{what}");
        for (step, ((loss, hash), (want, _))) in run.iter().zip(reference).enumerate() {
            assert_eq!(
                hash, &ranks[0][step].1,
                "{what}: rank {rank}'s replica differs at step {step}"
            );
            assert!(
                (loss - want).abs() <= 1e-5,
                "{what}: step {step}: loss {loss} against one worker's {want}"
            );
        }
    }
}

/// Pids of the direct children of `parent` (Linux `/proc`).
pub fn children_of(parent: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1));
        if ppid == Some(&parent.to_string()) {
            pids.push(pid);
        }
    }
    pids
}

/// The pid of the worker with `RANK=rank` that `launch` started.
pub fn worker_pid(launch: &Child, rank: usize) -> u32 {
    let wanted = format!("RANK={rank}");
    for pid in children_of(launch.id()) {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if environ.split(|&b| b == 0).any(|var| var == wanted.as_bytes()) {
            return pid;
        }
    }
    panic!("no worker with {wanted} under launch {}", launch.id());
}

/// `tiny` at 2 sequences of 32 tokens per rank for `steps` steps, without evaluation: the options of the
/// in-process runs that multi-rank tests compare with.
pub fn tiny_options(steps: u64) -> ringtrain::trainer::TrainOptions {
    let model = ringtrain::model::ModelConfig::tiny();
    ringtrain::trainer::TrainOptions {
        batch_size: 2,
        seq_len: 32,
        eval_every: 0,
        eval_batches: 0,
        ..ringtrain::trainer::TrainOptions::for_model(&model).with_steps(steps)
    }
}

/// Joins `hosts.len()` ranks of this process over QUIC on loopback (shared memory between ranks told they
/// share a host: rank `r`'s host is `hosts[r]`), under `collective` and job hash `job`, and runs `body` on
/// each rank's collective in a thread of its own. The results in rank order.
pub fn quic_ranks<R: Send>(
    hosts: &[&str],
    collective: ringtrain::collective::CollectiveChoice,
    job: u64,
    body: impl Fn(usize, ringtrain::collective::quic::QuicCollective) -> R + Sync,
) -> Vec<R> {
    use ringtrain::collective::quic::{QuicCollective, QuicConfig};
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let master = sock.local_addr().unwrap();
    let mut sock = Some(sock);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..hosts.len())
            .map(|rank| {
                let sock = if rank == 0 { sock.take() } else { None };
                let body = &body;
                s.spawn(move || {
                    let mut cfg = QuicConfig::new(rank, hosts.len(), master);
                    cfg.job_id = job;
                    cfg.config_hash = job;
                    cfg.secret = Some(b"in-process ranks of a test".to_vec());
                    cfg.timeout = std::time::Duration::from_secs(60);
                    cfg.rendezvous_timeout = std::time::Duration::from_secs(60);
                    cfg.transport = ringtrain::collective::shm::LinkTransport::Auto;
                    cfg.collective = collective;
                    cfg.host_id = Some(hosts[rank].to_string());
                    let q = match sock {
                        Some(sock) => QuicCollective::connect_with_socket(cfg, sock),
                        None => QuicCollective::connect(cfg),
                    }
                    .unwrap();
                    body(rank, q)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
