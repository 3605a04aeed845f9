//! Elastic jobs of real processes under `ringtrain launch`: a rank crashed by the fault plan, rank 0
//! crashed, and a rank killed with SIGKILL at a step nobody planned. The survivors re-form the ring over
//! QUIC, finish the steps and end with the bits of the same membership history replayed in one process
//! (the first group to the committed step, a checkpoint, the survivors resuming it: what
//! `sim/tests/elastic.rs` shows the sim's live shrink equals). A 2-rank job that loses one stops.

mod common;

use common::worker_pid;
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::collective::{Collective, CollectiveChoice};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::elastic::MembershipChange;
use ringtrain::metrics::{rank_metrics_path, read_metrics, StepMetrics};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{hash_f32, ModelSource, TrainOptions, Trainer, UpdateMode};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT_S: &str = "6";

/// The train flags of every job here (replicated unless a test says otherwise); `replay` trains the same
/// options in one process.
fn train_flags(steps: u64) -> Vec<String> {
    train_flags_in(UpdateMode::Replicated, steps)
}

fn train_flags_in(update: UpdateMode, steps: u64) -> Vec<String> {
    let flags = [
        "train",
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--eval-every",
        "0",
        "--update",
        update.as_str(),
        "--elastic",
        "--timeout",
        TIMEOUT_S,
        "--threads",
        "1",
    ];
    let mut flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
    flags.extend(["--steps".to_string(), steps.to_string()]);
    flags
}

/// One job at a time: each is 2-3 processes with a 2 s idle timeout, and the test harness runs tests in
/// parallel on CI's 2 cores.
static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_job() -> std::sync::MutexGuard<'static, ()> {
    ONE_JOB.lock().unwrap_or_else(|e| e.into_inner())
}

fn launch(nproc: usize, steps: u64, dir: &Path) -> Command {
    launch_with(nproc, steps, dir, &[])
}

/// [`launch`] with flags of `launch` itself.
fn launch_with(nproc: usize, steps: u64, dir: &Path, launch_flags: &[&str]) -> Command {
    launch_in(UpdateMode::Replicated, nproc, steps, dir, launch_flags)
}

/// [`launch_with`] under the update `update`.
fn launch_in(update: UpdateMode, nproc: usize, steps: u64, dir: &Path, launch_flags: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ringtrain"));
    cmd.args(["launch", "--nproc", &nproc.to_string()])
        .args(launch_flags)
        .arg("--")
        .args(train_flags_in(update, steps))
        .arg("--metrics")
        .arg(dir.join("m.jsonl"))
        .arg("--save")
        .arg(dir.join("ck"))
        .current_dir(dir);
    cmd
}

/// A launched job of `nproc` ranks once rank 0 has logged `logged` steps.
fn started_job(nproc: usize, steps: u64, dir: &Path, logged: usize) -> std::process::Child {
    started_job_in(UpdateMode::Replicated, nproc, steps, dir, logged)
}

fn started_job_in(update: UpdateMode, nproc: usize, steps: u64, dir: &Path, logged: usize) -> std::process::Child {
    let child = launch_in(update, nproc, steps, dir, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (metrics, started) = (dir.join("m.jsonl"), Instant::now());
    while std::fs::read_to_string(&metrics).map_or(0, |s| s.lines().count()) < logged {
        assert!(started.elapsed() < Duration::from_secs(60), "the job did not get going");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn options(update: UpdateMode, steps: u64) -> TrainOptions {
    TrainOptions {
        update,
        ..common::tiny_options(steps)
    }
}

fn trainer(
    options: &TrainOptions,
    source: ModelSource,
    comm: Box<dyn Collective>,
) -> Trainer<Box<dyn ringtrain::backend::Backend>> {
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    Trainer::new(be, source, data, options.clone(), comm).unwrap()
}

/// `first` ranks train to `committed`, save, and `then` ranks resume with the same global batch to `steps`:
/// the final parameters' fingerprint.
fn replay(steps: u64, first: usize, committed: u64, then: usize) -> String {
    replay_history(steps, &[(first, committed), (then, steps)])
}

/// A membership history done by hand: each phase's world trains to its step and saves, the next phase's
/// ranks resuming that checkpoint with the first phase's global batch. The final parameters' fingerprint.
fn replay_history(steps: u64, phases: &[(usize, u64)]) -> String {
    replay_history_in(UpdateMode::Replicated, steps, phases)
}

/// [`replay_history`] under the update `update` (no buddy mirrors: they do not change the bits).
fn replay_history_in(update: UpdateMode, steps: u64, phases: &[(usize, u64)]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let opts = TrainOptions {
        global_batch: Some(phases[0].0 * options(update, steps).batch_size),
        ..options(update, steps)
    };
    let mut hashes = Vec::new();
    for (i, &(world, until)) in phases.iter().enumerate() {
        let (from, to) = (
            dir.path().join(format!("ck{i}")),
            dir.path().join(format!("ck{}", i + 1)),
        );
        hashes = std::thread::scope(|s| {
            let handles: Vec<_> = mem_cluster(world, MemOptions::default())
                .into_iter()
                .map(|comm| {
                    let (opts, from, to) = (&opts, &from, &to);
                    s.spawn(move || {
                        let source = match i {
                            0 => ModelSource::Fresh(ModelConfig::tiny()),
                            _ => ModelSource::Resume(from.clone()),
                        };
                        let mut t = trainer(opts, source, Box::new(comm));
                        while t.step() < until {
                            t.train_step().unwrap();
                        }
                        t.save(to).unwrap();
                        t.param_hash().unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<String>>()
        });
    }
    assert!(hashes.windows(2).all(|w| w[0] == w[1]));
    hashes[0].clone()
}

/// The fingerprint of the parameters in the checkpoint the job saved.
fn saved_hash(dir: &Path) -> String {
    let read = ModelSource::Resume(dir.join("ck")).read(0).unwrap();
    hash_f32(&read.params)
}

/// The metrics member `member` wrote.
fn metrics_of(dir: &Path, member: usize) -> Vec<StepMetrics> {
    read_metrics(rank_metrics_path(&dir.join("m.jsonl"), member)).unwrap()
}

/// Sends `signal` (`-KILL`, `-STOP`, `-CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let sent = Command::new("kill").args([signal, &pid.to_string()]).status().unwrap();
    assert!(sent.success(), "kill {signal} {pid}");
}

/// The first membership change member `member` recorded.
fn first_change(dir: &Path, member: usize) -> MembershipChange {
    metrics_of(dir, member)
        .iter()
        .find_map(|m| m.membership.clone())
        .expect("a membership change")
}

/// A launched 3-rank job of `steps` steps with `fault` injected, which must complete: launch's stderr.
fn completed_with_fault(steps: u64, fault: &str, dir: &Path) -> String {
    completed_with_fault_in(UpdateMode::Replicated, steps, fault, dir)
}

fn completed_with_fault_in(update: UpdateMode, steps: u64, fault: &str, dir: &Path) -> String {
    let out = launch_in(update, 3, steps, dir, &[])
        .env("RINGTRAIN_INJECT_FAULT", fault)
        .output()
        .unwrap();
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{stderr}");
    stderr
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_crashed_rank_leaves_and_the_survivors_finish_with_the_replayed_bits() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let stderr = completed_with_fault(6, "kill=2:3", dir.path());
    assert!(stderr.contains("launch: rank 2 left the elastic job"), "{stderr}");
    assert!(
        stderr.contains("the elastic job completed on 2 rank(s); failed on the way: rank 2"),
        "{stderr}"
    );
    for member in [0, 1] {
        let m = metrics_of(dir.path(), member);
        assert_eq!(m.iter().map(|m| m.step).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 6]);
        let change = m[2].membership.as_ref().expect("step 3 records the change");
        assert_eq!((change.epoch, change.resumed_from_step), (1, 2));
        assert_eq!(change.members, vec![0, 1]);
        assert_eq!(change.lost, vec![(2, ringtrain::elastic::Cause::Dead)]);
        assert!(change.recovery_ms > 0.0 && change.recovery_ms < 10_000.0, "{change:?}");
        assert_eq!((m[1].world_size, m[2].world_size), (3, 2));
    }
    assert_eq!(saved_hash(dir.path()), replay(6, 3, 2, 2));
}

#[test]
fn rank_0_crashed_hands_rendezvous_and_checkpoints_to_the_lowest_survivor() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let stderr = completed_with_fault(5, "kill=0:2", dir.path());
    assert!(stderr.contains("re-forming as rank 0 of 2 (epoch 1)"), "{stderr}");
    let m = metrics_of(dir.path(), 1);
    assert_eq!(m.last().unwrap().step, 5);
    assert_eq!(m[1].membership.as_ref().unwrap().members, vec![1, 2]);
    // Member 1, rank 0 of the new ring, wrote the final checkpoint.
    assert_eq!(saved_hash(dir.path()), replay(5, 3, 1, 2));
}

/// A 3-rank job of `steps` steps whose rank `victim` gets `signal` once rank 0 has logged `logged` steps:
/// it must finish every step with the two others and the bits of the history replayed in one process.
/// Returns launch's stderr and the change the survivors recorded.
fn lose_a_rank_to(signal_name: &str, victim: usize, steps: u64, logged: usize) -> (String, MembershipChange) {
    lose_a_rank_in(UpdateMode::Replicated, signal_name, victim, steps, logged)
}

fn lose_a_rank_in(
    update: UpdateMode,
    signal_name: &str,
    victim: usize,
    steps: u64,
    logged: usize,
) -> (String, MembershipChange) {
    let dir = tempfile::tempdir().unwrap();
    let child = started_job_in(update, 3, steps, dir.path(), logged);
    signal(worker_pid(&child, victim), signal_name);
    let out = child.wait_with_output().unwrap();
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(metrics_of(dir.path(), 0).last().unwrap().step, steps, "{stderr}");
    let change = first_change(dir.path(), 0);
    let survivors: Vec<u32> = (0..3).filter(|&m| m != victim as u32).collect();
    assert_eq!(change.members, survivors);
    // The history: 3 ranks to the step the survivors continued from, then 2.
    let history = replay_history_in(update, steps, &[(3, change.resumed_from_step), (2, steps)]);
    assert_eq!(saved_hash(dir.path()), history);
    (stderr, change)
}

#[test]
fn a_rank_killed_with_sigkill_at_an_unplanned_step_is_survived() {
    let _one = one_job();
    // Some steps in, whichever they are.
    lose_a_rank_to("-KILL", 1, 300, 20);
}

#[test]
fn a_rank_frozen_with_sigstop_is_gone_on_without_and_launch_ends_it() {
    let _one = one_job();
    let (stderr, change) = lose_a_rank_to("-STOP", 2, 60, 5);
    assert!(stderr.contains("launch: rank 2 is stopped"), "{stderr}");
    eprintln!("membership change after SIGSTOP: {change:?}");
    // Found out by the QUIC idle timeout (a third of --timeout), then re-formed.
    assert!(change.recovery_ms < 6_000.0 + 2_000.0, "{change:?}");
}

/// A UDP port free on loopback now, for a rank 0 started by hand.
fn free_port() -> u16 {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap().port()
}

/// Rank `rank` of a 3-rank job of `steps` steps started by hand from the torchrun variables (rank 0 at
/// `port` on loopback), writing its metrics to `metrics` and checkpoints to `ck` in `dir` (the save
/// settings are part of the configuration every rank must share).
fn direct_rank(rank: usize, port: u16, steps: u64, dir: &Path, metrics: &str) -> Command {
    direct_rank_in(UpdateMode::Replicated, rank, port, steps, dir, metrics)
}

/// [`direct_rank`] under the update `update`.
fn direct_rank_in(update: UpdateMode, rank: usize, port: u16, steps: u64, dir: &Path, metrics: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ringtrain"));
    cmd.args(train_flags_in(update, steps))
        .arg("--metrics")
        .arg(dir.join(metrics))
        .arg("--save")
        .arg(dir.join("ck"))
        .envs([
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "3".to_string()),
            ("LOCAL_WORLD_SIZE", "3".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.to_string()),
        ])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// Three processes started by hand from the torchrun variables (no launcher), rank 1 crashed at step 2.
#[test]
fn ranks_started_directly_from_the_torchrun_variables_survive_a_crash() {
    let _one = one_job();
    let (dir, port) = (tempfile::tempdir().unwrap(), free_port());
    let children: Vec<_> = (0..3)
        .map(|rank| {
            direct_rank(rank, port, 5, dir.path(), "m.jsonl")
                .env("RINGTRAIN_INJECT_FAULT", "kill=1:2")
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    assert!(!outs[1].status.success());
    for rank in [0, 2] {
        assert!(outs[rank].status.success(), "rank {rank}: {}", stderr_of(&outs[rank]));
    }
    let change = metrics_of(dir.path(), 2)[1]
        .membership
        .clone()
        .expect("step 2 records the change");
    assert_eq!((change.members, change.resumed_from_step), (vec![0, 2], 1));
    assert_eq!(saved_hash(dir.path()), replay(5, 3, 1, 2));
}

/// A running job of 3 ranks started by hand with a known job id, and two processes that ask it to take
/// them in: one claiming member 1, which is running, and one started with another `--seed` (another
/// configuration). Rank 0 turns both away naming why, and the job finishes with the bits of 3 ranks that
/// never changed.
#[test]
fn joins_claiming_a_running_member_or_another_configuration_are_refused_and_change_nothing() {
    let _one = one_job();
    let (dir, port) = (tempfile::tempdir().unwrap(), free_port());
    let steps = 400;
    let start = |rank: usize, extra: &[&str], rejoin: bool| {
        let mut cmd = direct_rank(
            rank,
            port,
            steps,
            dir.path(),
            if rejoin { "intruder.jsonl" } else { "m.jsonl" },
        );
        cmd.args(extra).env("RINGTRAIN_JOB_ID", "4242");
        match rejoin {
            true => cmd.env("RINGTRAIN_ELASTIC_REJOIN", "1"),
            // Slowed (bits unchanged), so that the job is still running when the intruders knock.
            false => cmd.env("RINGTRAIN_INJECT_FAULT", "compute=0:20"),
        };
        cmd.spawn().unwrap()
    };
    let ranks: Vec<_> = (0..3).map(|rank| start(rank, &[], false)).collect();
    let started = Instant::now();
    while records_so_far(dir.path(), 0).len() < 20 {
        assert!(started.elapsed() < Duration::from_secs(60), "the job did not get going");
        std::thread::sleep(Duration::from_millis(20));
    }
    let claims_running = start(1, &[], true).wait_with_output().unwrap();
    let other_config = start(2, &["--seed", "7"], true).wait_with_output().unwrap();
    for (out, why) in [
        (&claims_running, "member 1 is already part of the running job"),
        (&other_config, "config hash mismatch"),
    ] {
        let stderr = stderr_of(out);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains(&format!("rank 0 at 127.0.0.1:{port} refused the join")) && stderr.contains(why),
            "{stderr}"
        );
    }
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "rank {rank}: {}", stderr_of(&out));
    }
    let m = metrics_of(dir.path(), 0);
    assert_eq!(m.last().unwrap().step, steps);
    assert!(m.iter().all(|m| m.membership.is_none() && m.world_size == 3));
    assert_eq!(saved_hash(dir.path()), replay_history(steps, &[(3, steps)]));
}

/// A rank frozen long enough to be gone on without, then woken: it finds it is no longer part of the job
/// and leaves without disturbing the others.
#[test]
fn a_frozen_rank_that_wakes_after_the_re_form_leaves_without_disturbing_the_job() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let steps = 400;
    let child = started_job(3, steps, dir.path(), 5);
    let frozen = worker_pid(&child, 2);
    signal(frozen, "-STOP");
    // Until the others have re-formed without it.
    let (metrics, started) = (dir.path().join("m.jsonl"), Instant::now());
    let reformed = |text: &str| text.contains("\"membership\"");
    while !reformed(&std::fs::read_to_string(&metrics).unwrap_or_default()) {
        assert!(started.elapsed() < Duration::from_secs(60), "no re-form");
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(frozen, "-CONT");
    let out = child.wait_with_output().unwrap();
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("launch: rank 2 left the elastic job"), "{stderr}");
    for line in stderr.lines().filter(|l| l.starts_with("error:")) {
        eprintln!("the woken rank: {line}");
    }
    let m = metrics_of(dir.path(), 0);
    assert_eq!(m.last().unwrap().step, steps, "{stderr}");
    let changes: Vec<_> = m.iter().filter_map(|m| m.membership.clone()).collect();
    assert_eq!(changes.len(), 1, "the woken rank changed nothing: {changes:?}");
    assert_eq!(
        saved_hash(dir.path()),
        replay(steps, 3, changes[0].resumed_from_step, 2)
    );
}

/// A 3-rank job of 300 steps under `launch --max-restarts 1` whose member `victim` crashes at step 10 and
/// is started again: it must rejoin, and the job end with its full world and the bits of the 3 → 2 → 3
/// history replayed in one process. Returns launch's stderr and the two changes member `reporter` recorded.
fn crashed_and_restarted(update: UpdateMode, victim: usize, reporter: usize) -> (String, Vec<MembershipChange>) {
    let dir = tempfile::tempdir().unwrap();
    let steps = 300;
    // One member slowed (bits unchanged), so that the job still runs when the restarted rank asks.
    let slowed = if victim == 0 { 1 } else { 0 };
    let out = launch_in(update, 3, steps, dir.path(), &["--max-restarts", "1"])
        .env("RINGTRAIN_INJECT_FAULT", format!("kill={victim}:10,compute={slowed}:5"))
        .output()
        .unwrap();
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("member {victim}: rejoined the running job at step")),
        "{stderr}"
    );
    let m = metrics_of(dir.path(), reporter);
    assert_eq!((m.last().unwrap().step, m.last().unwrap().world_size), (steps, 3));
    let changes: Vec<_> = m.iter().filter_map(|m| m.membership.clone()).collect();
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert_eq!(changes[1].joined, vec![victim as u32]);
    let (lost_at, joined_at) = (changes[0].resumed_from_step, changes[1].resumed_from_step);
    let history = replay_history_in(update, steps, &[(3, lost_at), (2, joined_at), (3, steps)]);
    assert_eq!(saved_hash(dir.path()), history);
    (stderr, changes)
}

/// `launch --max-restarts 1`: the crashed rank is started again, asks the running job to take it back, and is
/// admitted at a step boundary: the job ends with its full world and the bits of the history it went
/// through (3 ranks, then 2, then 3 again).
#[test]
fn a_crashed_rank_restarted_by_launch_rejoins_and_the_job_ends_with_the_full_world() {
    let _one = one_job();
    let (stderr, changes) = crashed_and_restarted(UpdateMode::Replicated, 2, 0);
    assert!(
        stderr.contains("launch: restarting rank 2 to rejoin the job (restart 1 of 1)"),
        "{stderr}"
    );
    assert_eq!(
        (changes[0].members.clone(), changes[1].members.clone()),
        (vec![0, 1], vec![0, 1, 2])
    );
}

/// The soak: `RINGTRAIN_SOAK_KILLS` (default 20) times, once the job is back to its full world, a rank
/// other than 0 is killed with SIGKILL and `launch --max-restarts` starts it again to rejoin. The job
/// finishes with its full world, nothing hangs, and the final parameters equal the whole history
/// (3 ranks, 2, 3, 2, ...) replayed in one process.
#[test]
fn soak_kills_and_rejoins_end_with_the_replayed_bits() {
    let _one = one_job();
    let kills: usize = std::env::var("RINGTRAIN_SOAK_KILLS").map_or(20, |v| v.parse().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let steps = 40 * kills as u64 + 200;
    let restarts = kills.to_string();
    let child = launch_with(3, steps, dir.path(), &["--max-restarts", &restarts])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut changes_seen = 0;
    for kill in 0..kills {
        // Back to the full world, a few steps after the last change.
        loop {
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "kill {kill}: the job did not recover"
            );
            let records = records_so_far(dir.path(), 0);
            let changes = records.iter().filter(|m| m.membership.is_some()).count();
            let full = records.last().is_some_and(|m| m.world_size == 3);
            let since = records.iter().rev().take_while(|m| m.membership.is_none()).count();
            if changes == changes_seen && full && since >= 5 {
                break;
            }
            assert!(
                records.last().is_none_or(|m| m.step < steps),
                "the job ended after {kill} kills"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        signal(worker_pid(&child, 1 + kill % 2), "-KILL");
        changes_seen += 2; // the loss, then the rejoin
    }
    let out = child.wait_with_output().unwrap();
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{stderr}");
    let m = metrics_of(dir.path(), 0);
    assert_eq!((m.last().unwrap().step, m.last().unwrap().world_size), (steps, 3));
    let changes: Vec<_> = m.iter().filter_map(|m| m.membership.clone()).collect();
    assert_eq!(changes.len(), 2 * kills, "{changes:?}");
    let mut phases: Vec<(usize, u64)> = Vec::new();
    let mut world = 3;
    for change in &changes {
        phases.push((world, change.resumed_from_step));
        world = change.members.len();
    }
    phases.push((world, steps));
    eprintln!(
        "soak: {kills} kills and rejoins in {:.1} s; history {phases:?}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(saved_hash(dir.path()), replay_history(steps, &phases));
}

#[test]
fn a_lone_survivor_of_two_stops_with_its_reason() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let out = launch(2, 6, dir.path())
        .env("RINGTRAIN_INJECT_FAULT", "kill=1:3")
        .output()
        .unwrap();
    let stderr = stderr_of(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("not a strict majority"), "{stderr}");
    assert!(stderr.contains("no rank completed the elastic job"), "{stderr}");
}

/// Sharded (ZeRO-1) with buddy mirrors: a crashed rank's optimizer chunk comes from the rank to its right,
/// and rank 0's loss too; the survivors end with the bits of the history replayed in one process.
#[test]
fn sharded_crashed_ranks_chunks_come_from_their_buddies() {
    let _one = one_job();
    for (fault, steps, survivors, committed) in [("kill=2:3", 6, [0u32, 1], 2), ("kill=0:2", 5, [1, 2], 1)] {
        let dir = tempfile::tempdir().unwrap();
        completed_with_fault_in(UpdateMode::Sharded, steps, fault, dir.path());
        let change = first_change(dir.path(), survivors[0] as usize);
        assert_eq!(change.members, survivors.to_vec(), "{fault}");
        assert_eq!(change.resumed_from_step, committed, "{fault}");
        let history = replay_history_in(UpdateMode::Sharded, steps, &[(3, committed), (2, steps)]);
        assert_eq!(saved_hash(dir.path()), history, "{fault}");
    }
}

/// Sharded: a rank frozen with SIGSTOP; its optimizer chunk comes from its buddy.
#[test]
fn sharded_a_rank_frozen_with_sigstop_is_gone_on_without() {
    let _one = one_job();
    let (stderr, change) = lose_a_rank_in(UpdateMode::Sharded, "-STOP", 2, 60, 5);
    assert!(stderr.contains("launch: rank 2 is stopped"), "{stderr}");
    assert!(change.recovery_ms < 6_000.0 + 2_000.0, "{change:?}");
}

#[test]
fn sharded_a_rank_killed_with_sigkill_at_an_unplanned_step_is_survived() {
    let _one = one_job();
    lose_a_rank_in(UpdateMode::Sharded, "-KILL", 2, 300, 20);
}

/// Sharded: the restarted rank rejoins, takes a chunk and a mirror of the re-cut state, and the job ends
/// with its full world and the replayed bits.
#[test]
fn sharded_a_crashed_rank_restarted_by_launch_rejoins() {
    let _one = one_job();
    let (_, changes) = crashed_and_restarted(UpdateMode::Sharded, 1, 0);
    assert_eq!(changes[1].members, vec![0, 2, 1]);
}

/// A 4-rank job under `--quorum any` that loses member 3 at step 3 and then `also` (a `regroup` fault) as
/// the survivors set out to re-form: the attempt of epoch 1 does not form, the rest try again without
/// the absent member and finish. Returns the change member `reporter` recorded.
fn lost_during_the_re_form(update: UpdateMode, also: &str, reporter: usize) -> (MembershipChange, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let steps = 6;
    let fault = format!("kill=3:3,{also}");
    let out = launch_in(update, 4, steps, dir.path(), &[])
        .args(["--quorum", "any"])
        .env("RINGTRAIN_INJECT_FAULT", &fault)
        .output()
        .unwrap();
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{fault}: {stderr}");
    let m = metrics_of(dir.path(), reporter);
    assert_eq!(
        m.iter().map(|m| m.step).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5, 6],
        "{fault}"
    );
    let change = first_change(dir.path(), reporter);
    let history = replay_history_in(update, steps, &[(4, 2), (2, steps)]);
    (change, saved_hash(dir.path()), history)
}

/// A survivor that dies on its way to the re-form's rendezvous: rank 0 of the attempt tells the others it
/// is missing when its rendezvous times out, and the rest form the ring of the next epoch.
#[test]
fn a_survivor_lost_on_its_way_to_the_re_form_is_left_out_and_the_job_finishes() {
    let _one = one_job();
    let (change, saved, history) = lost_during_the_re_form(UpdateMode::Replicated, "regroup=2:1", 0);
    use ringtrain::elastic::Cause;
    assert_eq!(change.lost, vec![(3, Cause::Dead), (2, Cause::Absent)]);
    assert_eq!(
        (change.epoch, change.members.clone(), change.resumed_from_step),
        (2, vec![0, 1], 2)
    );
    assert_eq!(saved, history);
}

/// The re-form's rank 0 itself dies before hosting the rendezvous: the others find nobody at its address,
/// leave it out, and the next lowest hosts the next attempt.
#[test]
fn a_re_form_whose_rank_0_is_lost_is_hosted_by_the_next_lowest() {
    let _one = one_job();
    let (change, saved, history) = lost_during_the_re_form(UpdateMode::Replicated, "regroup=0:1", 1);
    use ringtrain::elastic::Cause;
    assert_eq!(change.lost, vec![(3, Cause::Dead), (0, Cause::Absent)]);
    assert_eq!((change.epoch, change.members.clone()), (2, vec![1, 2]));
    assert_eq!(saved, history);
}

/// Sharded: the chunks of both lost members come from their buddies (member 3's from member 0, member
/// 1's from member 2) in the attempt that forms.
#[test]
fn sharded_a_survivor_lost_on_its_way_to_the_re_form_is_left_out() {
    let _one = one_job();
    let (change, saved, history) = lost_during_the_re_form(UpdateMode::Sharded, "regroup=1:1", 0);
    assert_eq!((change.epoch, change.members.clone()), (2, vec![0, 2]));
    assert_eq!(saved, history);
}

/// The `regroup` fault acts on an elastic re-form: a job without `--elastic` refuses it before starting.
#[test]
fn a_regroup_fault_without_elastic_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let flags: Vec<String> = train_flags(4).into_iter().filter(|f| f != "--elastic").collect();
    let out = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args(["launch", "--nproc", "2", "--"])
        .args(flags)
        .current_dir(dir.path())
        .env("RINGTRAIN_INJECT_FAULT", "regroup=1:1")
        .output()
        .unwrap();
    let stderr = stderr_of(&out);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("fault regroup=1:1 acts on an elastic re-form"),
        "{stderr}"
    );
}

/// Member 0, which hosted the job's first rendezvous, crashes and `launch --max-restarts 1` starts it
/// again: nobody answers at the master address any more, so it finds the running job at the other ranks'
/// listen ports (`RINGTRAIN_JOIN_ADDRS`, which launch gives every rank) and rejoins under member 1, now
/// rank 0. The job ends with the full world and the replayed bits.
#[test]
fn member_0_restarted_by_launch_rejoins_through_the_other_ranks() {
    let _one = one_job();
    let (_, changes) = crashed_and_restarted(UpdateMode::Replicated, 0, 1);
    assert_eq!(
        (changes[0].members.clone(), changes[1].members.clone()),
        (vec![1, 2], vec![1, 2, 0])
    );
}

/// Ranks started by hand with listen ports; member 0 crashes. A process restarted as member 0 is told only
/// member 2's address: member 2 (rank 1 of the running ring) points it to rank 0 (member 1), which admits
/// it; the job ends with the full world and the replayed bits.
#[test]
fn a_running_rank_that_is_not_rank_0_points_a_joiner_to_rank_0() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let (port, steps) = (free_port(), 300);
    let listen: Vec<u16> = (0..3).map(|r| if r == 0 { port } else { free_port() }).collect();
    let fault = "kill=0:5,compute=1:10";
    let children: Vec<_> = (0..3)
        .map(|rank| {
            let mut cmd = direct_rank(rank, port, steps, dir.path(), "m.jsonl");
            if rank > 0 {
                cmd.env("RINGTRAIN_LISTEN_PORT", listen[rank].to_string());
            }
            cmd.env("RINGTRAIN_INJECT_FAULT", fault).spawn().unwrap()
        })
        .collect();
    // Once the survivors run as a group of two, member 0 comes back knowing only member 2's address.
    let started = Instant::now();
    while !records_so_far(dir.path(), 1).iter().any(|m| m.membership.is_some()) {
        assert!(started.elapsed() < Duration::from_secs(60), "no re-form");
        std::thread::sleep(Duration::from_millis(20));
    }
    let joiner = direct_rank(0, port, steps, dir.path(), "joiner.jsonl")
        .env("RINGTRAIN_ELASTIC_REJOIN", "1")
        .env("RINGTRAIN_JOIN_ADDRS", format!("127.0.0.1:{}", listen[2]))
        .spawn()
        .unwrap();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    let joined = joiner.wait_with_output().unwrap();
    assert!(joined.status.success(), "{}", stderr_of(&joined));
    assert!(
        stderr_of(&joined).contains(&format!("127.0.0.1:{} says rank 0 of the running job is at", listen[2])),
        "{}",
        stderr_of(&joined)
    );
    for rank in [1, 2] {
        assert!(outs[rank].status.success(), "rank {rank}: {}", stderr_of(&outs[rank]));
    }
    let m = metrics_of(dir.path(), 1);
    let changes: Vec<_> = m.iter().filter_map(|m| m.membership.clone()).collect();
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert_eq!(changes[1].members, vec![1, 2, 0]);
    let (lost_at, joined_at) = (changes[0].resumed_from_step, changes[1].resumed_from_step);
    let history = replay_history(steps, &[(3, lost_at), (2, joined_at), (3, steps)]);
    assert_eq!(saved_hash(dir.path()), history);
}

/// The records member `member` has written so far (a line still being written is left out).
fn records_so_far(dir: &Path, member: usize) -> Vec<StepMetrics> {
    let path = rank_metrics_path(&dir.join("m.jsonl"), member);
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// A process that was never part of the job asks to join it as new member 7 (`RINGTRAIN_ELASTIC_JOIN=7`,
/// the job's flags with its global batch, no `WORLD_SIZE`: the elastic job hash holds the global batch,
/// not the world): the ranks take it in at a step boundary and the job ends on 4 ranks with the bits of
/// the 3 → 4 history replayed in one process. One started with another global batch is refused naming
/// the configuration, and changes nothing.
#[test]
fn a_new_member_joins_the_running_job() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let (port, steps) = (free_port(), 300);
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            direct_rank(rank, port, steps, dir.path(), "m.jsonl")
                .env("RINGTRAIN_JOB_ID", "4343")
                // Slowed (bits unchanged), so that the job is still running when the new member asks.
                .env("RINGTRAIN_INJECT_FAULT", "compute=0:10")
                .spawn()
                .unwrap()
        })
        .collect();
    let started = Instant::now();
    while records_so_far(dir.path(), 0).len() < 10 {
        assert!(started.elapsed() < Duration::from_secs(60), "the job did not get going");
        std::thread::sleep(Duration::from_millis(20));
    }
    let new_member = |global_batch: &str| {
        direct_rank(0, port, steps, dir.path(), "m.jsonl")
            .args(["--global-batch", global_batch])
            .env("RINGTRAIN_JOB_ID", "4343")
            .env("RINGTRAIN_ELASTIC_JOIN", "7")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("LOCAL_WORLD_SIZE")
            .output()
            .unwrap()
    };
    let other_batch = new_member("4");
    assert!(!other_batch.status.success());
    let why = stderr_of(&other_batch);
    assert!(why.contains("config hash mismatch"), "{why}");
    // The job's 3 ranks x 2 sequences.
    let joined = new_member("6");
    assert!(joined.status.success(), "{}", stderr_of(&joined));
    assert!(
        stderr_of(&joined).contains("member 7: rejoined the running job at step"),
        "{}",
        stderr_of(&joined)
    );
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "rank {rank}: {}", stderr_of(&out));
    }
    let m = metrics_of(dir.path(), 0);
    let changes: Vec<_> = m.iter().filter_map(|m| m.membership.clone()).collect();
    assert_eq!(changes.len(), 1, "{changes:?}");
    assert_eq!(
        (changes[0].members.clone(), changes[0].joined.clone()),
        (vec![0, 1, 2, 7], vec![7])
    );
    assert_eq!(m.last().unwrap().world_size, 4);
    // The new member wrote its own metrics file.
    assert_eq!(metrics_of(dir.path(), 7).last().unwrap().step, steps);
    let joined_at = changes[0].resumed_from_step;
    assert_eq!(
        saved_hash(dir.path()),
        replay_history(steps, &[(3, joined_at), (4, steps)])
    );
}

/// 4 ranks started by hand as 2 hosts of 2 (`RINGTRAIN_HOST_ID`), `--collective auto`: the replicated
/// update runs the two-level ring; member 3 crashes, the 3 left are hosts of 2 and 1, and the re-formed
/// job runs the flat ring. The bits equal the same history replayed in this process: 4 ranks on two
/// levels to the committed step, then 3 on a flat ring. Sharded, the same hosts run the flat ring from the
/// start (the buddy mirrors live there) and survive the same crash.
#[test]
fn elastic_jobs_across_two_level_hosts_re_form_and_keep_the_replayed_bits() {
    let _one = one_job();
    let hosts = ["a", "a", "b", "b"];
    for update in [UpdateMode::Replicated, UpdateMode::Sharded] {
        let dir = tempfile::tempdir().unwrap();
        let (port, steps) = (free_port(), 6);
        let children: Vec<_> = (0..4)
            .map(|rank| {
                direct_rank_in(update, rank, port, steps, dir.path(), "m.jsonl")
                    .args(["--collective", "auto"])
                    .envs([
                        ("WORLD_SIZE", "4"),
                        ("LOCAL_WORLD_SIZE", "2"),
                        ("RINGTRAIN_HOST_ID", hosts[rank]),
                    ])
                    .env("RINGTRAIN_INJECT_FAULT", "kill=3:3")
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
        for (rank, out) in outs.iter().enumerate().take(3) {
            assert!(out.status.success(), "{update:?} rank {rank}: {}", stderr_of(out));
        }
        let rank0 = stderr_of(&outs[0]);
        let change = first_change(dir.path(), 0);
        assert_eq!((change.members.clone(), change.resumed_from_step), (vec![0, 1, 2], 2));
        let first = match update {
            UpdateMode::Replicated => CollectiveChoice::Auto,
            UpdateMode::Sharded => {
                assert!(
                    rank0.contains("the flat ring (an elastic run of the sharded update"),
                    "{rank0}"
                );
                CollectiveChoice::Flat
            }
        };
        let replayed = replay_two_level_then_flat(update, first, &hosts, steps, 2);
        assert_eq!(saved_hash(dir.path()), replayed, "{update:?}");
        if first == CollectiveChoice::Auto {
            // The two levels add in another order than the flat ring: the bits tell which ring ran.
            let flat_first = replay_two_level_then_flat(update, CollectiveChoice::Flat, &hosts, steps, 2);
            assert_ne!(replayed, flat_first);
        }
    }
}

/// 4 ranks on the hosts `hosts` (`first`: the ring they form, which must be two levels for `auto`) train to
/// `committed` and save; 3 ranks on a flat ring resume it with the same global batch to `steps`. The final
/// parameters' fingerprint.
fn replay_two_level_then_flat(
    update: UpdateMode,
    first: CollectiveChoice,
    hosts: &[&str],
    steps: u64,
    committed: u64,
) -> String {
    let dir = tempfile::tempdir().unwrap();
    let opts = TrainOptions {
        global_batch: Some(hosts.len() * options(update, steps).batch_size),
        collective: first,
        ..options(update, steps)
    };
    let ck = dir.path().join("ck");
    common::quic_ranks(hosts, first, 4242, |rank, q| {
        assert_eq!(q.layout().is_some(), first == CollectiveChoice::Auto, "rank {rank}");
        let mut t = trainer(&opts, ModelSource::Fresh(ModelConfig::tiny()), Box::new(q));
        while t.step() < committed {
            t.train_step().unwrap();
        }
        // Every rank takes part in gathering a sharded checkpoint; rank 0 writes it.
        t.save(&ck).unwrap();
    });
    let flat = TrainOptions {
        collective: CollectiveChoice::Auto,
        ..opts.clone()
    };
    let hashes: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(3, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let (flat, ck) = (&flat, &ck);
                s.spawn(move || {
                    let mut t = trainer(flat, ModelSource::Resume(ck.clone()), Box::new(comm));
                    while t.step() < steps {
                        t.train_step().unwrap();
                    }
                    t.param_hash().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(hashes.windows(2).all(|w| w[0] == w[1]));
    hashes[0].clone()
}

/// A restarted member that dies during its state transfer (`drop=2:1`: after its first message in the
/// group that admitted it, inside the catch-up): the running ranks re-form again without it and finish
/// with the bits of a job that never took it back.
#[test]
fn a_joiner_killed_during_its_state_transfer_leaves_a_job_that_finishes() {
    let _one = one_job();
    let dir = tempfile::tempdir().unwrap();
    let (port, steps) = (free_port(), 300);
    let children: Vec<_> = (0..3)
        .map(|rank| {
            direct_rank(rank, port, steps, dir.path(), "m.jsonl")
                .env("RINGTRAIN_INJECT_FAULT", "kill=2:3,compute=0:10")
                .spawn()
                .unwrap()
        })
        .collect();
    let started = Instant::now();
    while !records_so_far(dir.path(), 0).iter().any(|m| m.membership.is_some()) {
        assert!(started.elapsed() < Duration::from_secs(60), "no re-form");
        std::thread::sleep(Duration::from_millis(20));
    }
    let joiner = direct_rank(2, port, steps, dir.path(), "joiner.jsonl")
        .env("RINGTRAIN_ELASTIC_REJOIN", "1")
        .env("RINGTRAIN_INJECT_FAULT", "drop=2:1")
        .output()
        .unwrap();
    assert!(!joiner.status.success(), "{}", stderr_of(&joiner));
    assert!(
        stderr_of(&joiner).contains("injected crash after 1 messages"),
        "{}",
        stderr_of(&joiner)
    );
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for rank in [0, 1] {
        assert!(outs[rank].status.success(), "rank {rank}: {}", stderr_of(&outs[rank]));
    }
    let m = metrics_of(dir.path(), 0);
    assert_eq!((m.last().unwrap().step, m.last().unwrap().world_size), (steps, 2));
    let changes: Vec<_> = m.iter().filter_map(|m| m.membership.clone()).collect();
    // The loss, then the failed admission recorded with the re-form that followed it.
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert_eq!(changes[1].members, vec![0, 1]);
    assert_eq!(changes[1].joined, Vec::<u32>::new());
    let lost_at = changes[0].resumed_from_step;
    assert_eq!(saved_hash(dir.path()), replay(steps, 3, lost_at, 2));
}
