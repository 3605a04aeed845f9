//! A NaN or +Inf gradient on one rank of a real 3-process job under `ringtrain launch`, injected with
//! `RINGTRAIN_INJECT_FAULT` into one element of that rank's local gradient before synchronisation. Every
//! rank must see it in the same step, because the skip decision comes from the all-reduced norm:
//! - `--on-nonfinite skip`: every rank reports that step skipped, the update is skipped everywhere (the
//!   verified replica hash of that step equals the previous step's; replicated runs hash the moments too),
//!   training goes on with finite losses and identical replicas, and the job exits 0;
//! - `--on-nonfinite abort`: every rank exits non-zero naming the step, launch exits non-zero, well before
//!   any collective deadline, and the only checkpoint is the one saved before the fault.
//!
//! Tiny buckets (`--bucket-mb 0.0004`, 104 elements) give the final layer norm a bucket of its own, which
//! backward's first report completes: with `--overlap on` it is read back and sent while backward goes on,
//! so an injection written after that read would never travel (and these tests would fail); with `off` it
//! is read back after backward.

use ringtrain::metrics::{read_metrics, StepMetrics};
use ringtrain::model::checkpoint::{load_model, load_trainer_state};
use ringtrain::model::ParamLayout;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const RANKS: usize = 3;
const STEPS: u64 = 5;
/// The step (1-based) at which the fault fires.
const FAULT_STEP: u64 = 3;
/// Collective deadline: long, so that a job ending quickly shows detection did not wait for it.
const TIMEOUT_S: u64 = 30;

/// One launched job and what it left.
struct Job {
    status: ExitStatus,
    stderr: String,
    metrics: Vec<StepMetrics>,
    ckpt: PathBuf,
    /// From rank 0's metrics line of the step before the fault to the end of `launch` (abort runs).
    after_last_good_step: Option<Duration>,
    _dir: tempfile::TempDir,
}

/// Runs `launch --nproc 3 -- train` on a 1-layer tiny model with `fault` armed and `flags` added.
fn launch(fault: &str, flags: &[&str]) -> Job {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let ckpt = dir.path().join("ckpt");
    let (steps, timeout) = (STEPS.to_string(), TIMEOUT_S.to_string());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args(["launch", "--nproc", &RANKS.to_string(), "--", "train"])
        .args([
            "--model",
            "tiny",
            "--n-layer",
            "1",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
        ])
        .args([
            "--steps",
            &steps,
            "--eval-every",
            "0",
            "--threads",
            "1",
            "--timeout",
            &timeout,
        ])
        .args(["--verify-every", "1", "--bucket-mb", "0.0004", "--save-every", "2"])
        .args(flags)
        .arg("--metrics")
        .arg(&metrics)
        .arg("--save")
        .arg(&ckpt)
        .env("RINGTRAIN_INJECT_FAULT", fault)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read stderr on the side so that a chatty job cannot block on a full pipe.
    let mut pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        pipe.read_to_string(&mut s).unwrap();
        s
    });
    let started = Instant::now();
    let mut last_good: Option<Instant> = None;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if last_good.is_none() && lines(&metrics) >= FAULT_STEP as usize - 1 {
            last_good = Some(Instant::now());
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the job with {fault} was still running after 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let ended = Instant::now();
    let stderr = reader.join().unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("FAULT INJECTION ARMED"),
        "no rank said the fault was armed:\n{stderr}"
    );
    Job {
        status,
        metrics: read_metrics(&metrics).unwrap_or_default(),
        after_last_good_step: last_good.map(|t| ended - t),
        stderr,
        ckpt,
        _dir: dir,
    }
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// A skip run: every rank reports the fault step skipped and no other; the update was skipped everywhere;
/// training went on with identical replicas and finite losses. `norm` is how the skip line shows the norm.
fn skipped_everywhere(fault: &str, norm: &str, flags: &[&str]) {
    let job = launch(fault, &[&["--on-nonfinite", "skip"], flags].concat());
    let err = &job.stderr;
    assert!(job.status.success(), "{fault} {flags:?}: launch failed:\n{err}");
    let m = &job.metrics;
    assert_eq!(m.len(), STEPS as usize, "{err}");
    // The ranks share one stderr, so lines of different ranks may meet; each rank's line is written whole.
    for rank in 0..RANKS {
        let said = format!(
            "rank {rank}: step {FAULT_STEP}: non-finite loss ({}) or gradient norm ({norm}), update skipped (--on-nonfinite skip)",
            m[FAULT_STEP as usize - 1].loss
        );
        assert!(err.contains(&said), "rank {rank} did not say {said:?}:\n{err}");
        assert_eq!(
            err.matches(&format!("rank {rank}: step ")).count(),
            1,
            "rank {rank} should report one skipped step:\n{err}"
        );
    }
    let skipped: Vec<u64> = m.iter().filter(|r| r.skipped).map(|r| r.step).collect();
    assert_eq!(skipped, vec![FAULT_STEP], "rank 0's metrics");
    // Only the gradient was poisoned: every loss, the fault step's included, is finite, and so is every
    // other step's norm.
    assert!(m.iter().all(|r| r.loss.is_finite()), "{m:?}");
    assert!(
        m.iter().filter(|r| !r.skipped).all(|r| r.grad_norm.is_finite()),
        "{m:?}"
    );
    assert!(!m[FAULT_STEP as usize - 1].grad_norm.is_finite());
    // --verify-every 1 compared every rank's hash at every step (a mismatch aborts the job), so these are
    // every replica's: the skipped step changed nothing, the next one trained again.
    let hash = |step: u64| m[step as usize - 1].param_hash.clone().expect("verified every step");
    assert_eq!(
        hash(FAULT_STEP),
        hash(FAULT_STEP - 1),
        "the skipped step changed the state"
    );
    assert_ne!(
        hash(FAULT_STEP + 1),
        hash(FAULT_STEP),
        "training stopped after the skip"
    );
    // The final checkpoint holds finite parameters and moments, and counts the skipped step.
    let (cfg, params) = load_model(&job.ckpt).unwrap();
    let state = load_trainer_state(&job.ckpt, &ParamLayout::new(&cfg)).unwrap();
    assert_eq!(state.step, STEPS);
    assert!(params.iter().chain(&state.m).chain(&state.v).all(|x| x.is_finite()));
    // The optimizer took one step fewer than the loop.
    assert_eq!(state.extra["optimizer_step"], (STEPS - 1).to_string());
}

#[test]
fn a_nan_on_rank_1_is_skipped_by_every_rank_sharded_overlapped() {
    skipped_everywhere("nonfinite=1:3:nan", "NaN", &["--update", "sharded", "--overlap", "on"]);
}

#[test]
fn an_inf_on_rank_2_is_skipped_by_every_rank_sharded_not_overlapped() {
    skipped_everywhere("nonfinite=2:3:inf", "inf", &["--update", "sharded", "--overlap", "off"]);
}

#[test]
fn a_nan_on_rank_2_is_skipped_by_every_rank_replicated_not_overlapped() {
    skipped_everywhere("nonfinite=2:3", "NaN", &["--update", "replicated", "--overlap", "off"]);
}

#[test]
fn an_inf_on_rank_1_is_skipped_by_every_rank_replicated_overlapped() {
    skipped_everywhere(
        "nonfinite=1:3:inf",
        "inf",
        &["--update", "replicated", "--overlap", "on"],
    );
}

/// An abort run: every rank stops at the fault step naming it, quickly, and the checkpoint is the one
/// saved before the fault.
fn aborted_everywhere(fault: &str, flags: &[&str]) {
    let job = launch(fault, &[&["--on-nonfinite", "abort"], flags].concat());
    let err = &job.stderr;
    assert!(!job.status.success(), "{fault}: launch exited 0:\n{err}");
    // Each rank's error names the step: its own decision, or (when a faster rank's abort reached it
    // before its last scalar message) `rank R aborted the job: <that rank's error>`.
    let reason = format!("step {FAULT_STEP}: non-finite loss (");
    assert_eq!(
        err.matches(&reason).count(),
        RANKS,
        "one error per rank naming step {FAULT_STEP}:\n{err}"
    );
    assert_eq!(err.matches("; stopping (--on-nonfinite abort)").count(), RANKS, "{err}");
    assert!(err.contains(&format!("{RANKS} of the workers failed")), "{err}");
    // Rank 0 wrote the steps before the fault and not the fault step.
    assert_eq!(job.metrics.len(), FAULT_STEP as usize - 1, "{err}");
    // The checkpoint saved at step 2 (--save-every 2) is the only one: no save ran after the fault, not
    // even half of one.
    let (cfg, _) = load_model(&job.ckpt).unwrap();
    let state = load_trainer_state(&job.ckpt, &ParamLayout::new(&cfg)).unwrap();
    assert_eq!(state.step, FAULT_STEP - 1);
    let mut left: Vec<String> = std::fs::read_dir(job.ckpt.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let mut want = vec!["ckpt".to_string(), "m.jsonl".to_string()];
    want.extend((1..RANKS).map(|r| format!("m.rank{r}.jsonl")));
    assert_eq!(left, want, "the checkpoint and each rank's metrics file");
    // Every other rank wrote the same steps to its own file.
    for r in 1..RANKS {
        let theirs = read_metrics(job.ckpt.parent().unwrap().join(format!("m.rank{r}.jsonl"))).unwrap();
        let steps = |m: &[StepMetrics]| m.iter().map(|x| (x.step, x.loss.to_bits())).collect::<Vec<_>>();
        assert_eq!(steps(&theirs), steps(&job.metrics), "rank {r}'s metrics");
    }
    // Detection is the fault step's own scalar all-reduce, not a deadline.
    let took = job.after_last_good_step.expect("step 2 was logged");
    assert!(
        took < Duration::from_secs(TIMEOUT_S / 2),
        "the job took {took:?} to stop after the last good step"
    );
    eprintln!("{fault} {flags:?}: every rank stopped; launch ended {took:.2?} after step 2's metrics line");
}

#[test]
fn a_nan_on_rank_1_stops_every_rank_at_that_step() {
    aborted_everywhere("nonfinite=1:3:nan", &["--update", "sharded"]);
}

#[test]
fn an_inf_on_rank_2_stops_every_rank_at_that_step() {
    aborted_everywhere("nonfinite=2:3:inf", &["--update", "replicated"]);
}

#[test]
fn a_bad_fault_spec_is_refused_naming_the_variable() {
    for (spec, needle) in [
        ("nonfinite=1", "expected nonfinite=RANK:STEP[:nan|inf]"),
        ("nonfinite=1:3:zero", "is not nan or inf"),
        ("nonfinite=0:9", "step 9 is not among the run's steps 1..=2"),
        ("nonfinite=1:1", "rank 1 does not exist in a job of 1 rank(s)"),
        ("kill=0:1", "acts on the ring, and a job of one rank has none"),
        ("delay=5,delay=6", "given twice"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
            .args([
                "train",
                "--model",
                "tiny",
                "--n-layer",
                "1",
                "--seq-len",
                "8",
                "--steps",
                "2",
            ])
            .env("RINGTRAIN_INJECT_FAULT", spec)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{spec}: accepted");
        assert!(
            stderr.contains("error: RINGTRAIN_INJECT_FAULT=") && stderr.contains(needle),
            "{spec}: {stderr}"
        );
    }
}
