//! The fault matrix (`--fault`): each fault injected in the virtual cluster shows its documented outcome,
//! under the transport it applies to, and none hangs. A fault a transport cannot inject is refused, naming
//! the transports that support it.

use ringtrain::backend::factory::BackendChoice;
use ringtrain::model::{ModelConfig, ParamLayout};
use ringtrain::trainer::buckets::BucketPlan;
use ringtrain::trainer::{OnNonFinite, TrainOptions, UpdateMode};
use ringtrain_sim::faults::parse_faults;
use ringtrain_sim::{run, SimConfig, SimReport, Transport};
use std::time::{Duration, Instant};

const WORKERS: usize = 3;
const DEADLINE: Duration = Duration::from_secs(10);

fn model() -> ModelConfig {
    ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    }
}

/// Three CPU workers of a one-layer tiny model for four steps, with the faults `specs` as `--fault` takes
/// them.
fn config(update: UpdateMode, transport: Transport, specs: &[&str]) -> SimConfig {
    let model = model();
    let options = TrainOptions {
        batch_size: 2,
        seq_len: 16,
        update,
        eval_every: 0,
        verify_every: 1,
        ..TrainOptions::for_model(&model).with_steps(4)
    };
    let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
    let faults = parse_faults(&specs).unwrap();
    SimConfig {
        workers: WORKERS,
        backends: vec![BackendChoice::Cpu],
        model,
        options,
        transport,
        faults,
        deadline: DEADLINE,
        split_replay: None,
    }
}

fn run_ok(cfg: &SimConfig) -> SimReport {
    let report = run(cfg).unwrap();
    assert_eq!(report.first_divergence(), None);
    report
}

/// The run's error (one line per failed rank) and how long it took to come.
fn run_err(cfg: &SimConfig) -> (Vec<String>, Duration) {
    let started = Instant::now();
    let err = run(cfg).expect_err("the fault should stop the run");
    let took = started.elapsed();
    (format!("{err:#}").lines().map(str::to_string).collect(), took)
}

#[test]
fn delay_and_reorder_change_no_bit() {
    let calm = run_ok(&config(UpdateMode::Sharded, Transport::Mem, &[]));
    let noisy = run_ok(&config(UpdateMode::Sharded, Transport::Mem, &["delay=1", "reorder=9"]));
    assert_eq!(calm.ranks, noisy.ranks);
}

#[test]
fn a_slow_worker_finishes_with_the_same_bits() {
    let calm = run_ok(&config(UpdateMode::Replicated, Transport::Mem, &[]));
    let slow = run_ok(&config(UpdateMode::Replicated, Transport::Mem, &["slow=2:2"]));
    assert_eq!(calm.ranks, slow.ranks);
}

/// A rank that computes slowly (not one that handles messages slowly) and one frozen for a while both
/// finish with the calm run's bits, under either transport, and each costs at least the time injected.
#[test]
fn a_slow_computing_or_briefly_frozen_rank_changes_no_bit() {
    for transport in [Transport::Mem, Transport::Quic] {
        let calm = run_ok(&config(UpdateMode::Sharded, transport, &[]));
        // Four steps of one micro-batch each: at least 4 x 30 ms on the slow rank.
        for (spec, at_least) in [("compute=1:30", 120), ("freeze=2:2:400", 400)] {
            let started = Instant::now();
            let faulty = run_ok(&config(UpdateMode::Sharded, transport, &[spec]));
            let took = started.elapsed();
            assert!(
                took >= Duration::from_millis(at_least),
                "{spec} {transport:?}: took {took:?}"
            );
            assert_eq!(calm.ranks, faulty.ranks, "{spec} {transport:?}");
        }
    }
}

/// A rank frozen past the collective deadline fails the job, which stops soon after the deadline: the
/// ranks waiting on it time out and tell the others, and the frozen rank hears it when it wakes.
#[test]
fn a_rank_frozen_past_the_deadline_fails_the_job_without_hanging() {
    let mut cfg = config(UpdateMode::Sharded, Transport::Mem, &["freeze=1:2:4000"]);
    cfg.deadline = Duration::from_secs(1);
    let (lines, took) = run_err(&cfg);
    assert!(!lines.is_empty());
    assert!(took < Duration::from_secs(8), "took {took:?}: {lines:#?}");
}

/// Every rank fails, each naming `rank`, well within the collective deadline.
fn assert_all_name(lines: &[String], took: Duration, rank: usize) {
    assert_eq!(lines.len(), WORKERS, "every rank fails: {lines:#?}");
    for line in lines {
        assert!(
            line.contains(&format!("rank {rank}")),
            "should name rank {rank}: {line}"
        );
    }
    assert!(took < DEADLINE, "took {took:?}, the deadline is {DEADLINE:?}");
}

#[test]
fn a_worker_removed_at_a_step_is_named_by_every_rank() {
    let (lines, took) = run_err(&config(UpdateMode::Sharded, Transport::Mem, &["kill=1:3"]));
    assert_all_name(&lines, took, 1);
    assert!(lines[1].contains("removal at step 3"), "{lines:#?}");
}

#[test]
fn quic_drop_and_kill_crash_the_rank_and_every_rank_names_it() {
    let (lines, took) = run_err(&config(UpdateMode::Sharded, Transport::Quic, &["drop=1:20"]));
    assert_all_name(&lines, took, 1);
    let (lines, took) = run_err(&config(UpdateMode::Replicated, Transport::Quic, &["kill=2:2"]));
    assert_all_name(&lines, took, 2);
    assert!(lines[2].contains("crash at step 2"), "{lines:#?}");
}

#[test]
fn quic_refuses_the_faults_only_the_memory_transport_injects() {
    for spec in ["delay=1", "reorder=3", "slow=1:5", "split=2"] {
        let err = run(&config(UpdateMode::Sharded, Transport::Quic, &[spec]))
            .unwrap_err()
            .to_string();
        let kind = spec.split('=').next().unwrap();
        assert!(
            err.contains(&format!("--fault {kind} is supported by --transport mem only")),
            "{spec}: {err}"
        );
    }
}

#[test]
fn a_nan_gradient_on_one_rank_is_skipped_by_every_rank_in_the_same_step() {
    for transport in [Transport::Mem, Transport::Quic] {
        let report = run_ok(&config(UpdateMode::Sharded, transport, &["nan=1:2"]));
        for trace in &report.ranks {
            assert_eq!(trace.skipped, vec![2], "{transport:?}");
            assert_eq!(trace.losses.len(), 4);
        }
    }
}

#[test]
fn an_inf_gradient_stops_every_rank_in_the_same_step_with_abort() {
    let mut cfg = config(UpdateMode::Replicated, Transport::Mem, &["inf=0:3"]);
    cfg.options.on_nonfinite = OnNonFinite::Abort;
    let (lines, _) = run_err(&cfg);
    assert_eq!(lines.len(), WORKERS, "{lines:#?}");
    for line in &lines {
        assert!(
            line.contains("step 3: non-finite") && line.contains("--on-nonfinite abort"),
            "each rank decides for itself: {line}"
        );
    }
}

#[test]
fn replicated_a_flipped_parameter_or_moment_is_named_by_the_replica_check() {
    for target in ["param:100", "moment"] {
        let flip = format!("flip=1:2:{target}");
        let (lines, _) = run_err(&config(UpdateMode::Replicated, Transport::Mem, &[&flip]));
        assert_eq!(lines.len(), WORKERS, "{flip}: {lines:#?}");
        for line in &lines {
            assert!(
                line.contains("step 3: replicas diverged: rank(s) [1]"),
                "{flip}: {line}"
            );
        }
    }
}

/// Rank `rank`'s shard of the flat parameters in `cfg`'s run.
fn shard(cfg: &SimConfig, rank: usize) -> Vec<std::ops::Range<usize>> {
    BucketPlan::new(&ParamLayout::new(&cfg.model), cfg.options.bucket_elems)
        .owned(UpdateMode::Sharded, &ringtrain::collective::Owner::flat(WORKERS, rank))
}

#[test]
fn sharded_a_flip_outside_the_rank_s_shard_heals_at_the_next_gather() {
    let probe = config(UpdateMode::Sharded, Transport::Mem, &[]);
    // Element 0 is in rank 0's shard, not in rank 1's.
    assert!(shard(&probe, 0)[0].contains(&0));
    assert!(!shard(&probe, 1).iter().any(|r| r.contains(&0)));
    let report = run_ok(&config(UpdateMode::Sharded, Transport::Mem, &["flip=1:2:param:0"]));
    let flipped = &report.ranks[1];
    let after = flipped.hash_after_flip.as_ref().expect("the flip happened");
    assert_ne!(after, &flipped.hashes[1], "the flip changed rank 1's replica");
    assert_ne!(after, &report.ranks[0].hashes[1]);
    // first_divergence() is None (run_ok): from step 3 on every replica is rank 0's again.
    assert_eq!(report.ranks[0].hashes.len(), 4);
}

#[test]
fn sharded_a_flip_inside_the_rank_s_shard_fails_its_checksum() {
    for target in ["param", "moment"] {
        let flip = format!("flip=1:2:{target}");
        let (lines, took) = run_err(&config(UpdateMode::Sharded, Transport::Mem, &[&flip]));
        let owner = lines
            .iter()
            .find(|l| l.contains("step 3: rank 1's shard"))
            .unwrap_or_else(|| panic!("{flip}: rank 1 reports its shard: {lines:#?}"));
        assert!(owner.contains("changed since its update of step 2"), "{owner}");
        // The others stop too, naming rank 1, without waiting for the deadline.
        assert_all_name(&lines, took, 1);
    }
}

#[test]
fn sharded_without_verify_every_a_flip_inside_the_shard_spreads_unseen() {
    let clean = run_ok(&config(UpdateMode::Sharded, Transport::Mem, &[]));
    let mut cfg = config(UpdateMode::Sharded, Transport::Mem, &["flip=1:2:param"]);
    cfg.options.verify_every = 0;
    // Every replica holds the same bits at every step (run_ok), yet not the clean run's: the gather copied
    // the corrupted owner's update to everyone. This is what the shard checksum is for.
    let report = run_ok(&cfg);
    assert_eq!(report.ranks[0].hashes[..2], clean.ranks[0].hashes[..2]);
    assert_ne!(report.ranks[0].hashes[2], clean.ranks[0].hashes[2]);
}
