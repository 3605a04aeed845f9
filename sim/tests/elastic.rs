//! Elastic membership in the sim: a worker killed, frozen or dropped mid-collective leaves, the survivors
//! re-form and finish, and a joiner is taken in; the final bits are those of the same membership history
//! replayed the slow way (the run stopped at the last committed step, checkpointed, and resumed on the
//! new membership).

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::mem::{mem_cluster, single_rank, MemOptions};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::elastic::{Cause, ElasticRules, Membership, Quorum};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, Quiet, TrainOptions, Trainer, UpdateMode};
use ringtrain_sim::cluster::{Cluster, ClusterRun};
use std::path::Path;
use std::time::Duration;

const STEPS: u64 = 6;

fn elastic(workers: usize, rules: ElasticRules) -> Cluster {
    elastic_on(UpdateMode::Replicated, workers, rules)
}

fn elastic_on(update: UpdateMode, workers: usize, rules: ElasticRules) -> Cluster {
    Cluster::new(workers)
        .update(update)
        .elastic(rules)
        .timeout(Duration::from_secs(20))
}

/// An elastic sharded cluster (buddy mirrors).
fn sharded(workers: usize) -> Cluster {
    elastic_on(UpdateMode::Sharded, workers, ElasticRules::default())
}

/// The options of `cluster`'s run, as its workers train them.
fn options_of(cluster: &Cluster) -> TrainOptions {
    let mut options = cluster.config(STEPS).unwrap().options;
    options.eval_batches = 0;
    options.elastic = None;
    options
}

fn trainer(
    options: &TrainOptions,
    source: ModelSource,
    comm: Box<dyn ringtrain::collective::Collective>,
) -> Trainer<Box<dyn ringtrain::backend::Backend>> {
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    Trainer::new(be, source, data, options.clone(), comm).unwrap()
}

/// The membership history done the slow way: `first` workers train up to `committed` steps and save,
/// then `then` workers resume from that checkpoint (the same global batch) and train to the end. Returns
/// the final parameter fingerprint of every worker of the second group.
fn replay(options: &TrainOptions, first: usize, committed: u64, then: usize, dir: &Path) -> Vec<String> {
    let global = options
        .global_batch
        .unwrap_or(first * options.batch_size * options.grad_accum);
    std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(first, MemOptions::default())
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let mut t = trainer(options, ModelSource::Fresh(ModelConfig::tiny()), Box::new(comm));
                    while t.step() < committed {
                        t.train_step().unwrap();
                    }
                    t.save(dir).unwrap();
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
    });
    let resumed = TrainOptions {
        global_batch: Some(global),
        ..options.clone()
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(then, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let resumed = &resumed;
                s.spawn(move || {
                    let mut t = trainer(resumed, ModelSource::Resume(dir.to_path_buf()), Box::new(comm));
                    t.run(&mut Quiet).unwrap();
                    t.param_hash().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The members that finished the run, and every change of membership the first of them recorded.
fn survivors(run: &ClusterRun) -> Vec<u32> {
    run.report
        .ranks
        .iter()
        .filter(|r| r.left.is_none())
        .map(|r| r.member)
        .collect()
}

#[test]
fn a_killed_worker_leaves_and_the_survivors_end_with_the_bits_of_a_restart_on_fewer_ranks() {
    let cluster = elastic(3, ElasticRules::default()).fault("kill=2:3").unwrap();
    let run = cluster.run(STEPS).unwrap();
    assert!(run.replicas_identical(), "{:?}", run.first_divergence());
    assert_eq!(survivors(&run), vec![0, 1]);
    let killed = &run.report.ranks[2];
    assert!(
        killed.left.as_deref().unwrap().contains("injected removal at step 3"),
        "{:?}",
        killed.left
    );
    assert_eq!(killed.steps, vec![1, 2]);
    for member in [0, 1] {
        let changes = &run.report.ranks[member].memberships;
        assert_eq!(changes.len(), 1, "{changes:?}");
        let change = &changes[0];
        assert_eq!((change.epoch, change.resumed_from_step), (1, 2));
        assert_eq!(change.lost, vec![(2, Cause::Dead)]);
        assert_eq!(change.members, vec![0, 1]);
        assert!(change.recovery_ms > 0.0);
        assert_eq!(run.report.ranks[member].steps, (1..=STEPS).collect::<Vec<_>>());
    }
    // The same global batch, so the same loss as one worker up to the reduction's rounding.
    assert!(run.max_loss_gap_to_single_worker() < 1e-5);

    let dir = tempfile::tempdir().unwrap();
    let replayed = replay(&options_of(&cluster), 3, 2, 2, dir.path());
    assert_eq!(replayed, vec![run.final_hash().to_string(); 2]);
}

#[test]
fn rank_0_killed_hands_its_place_to_the_lowest_survivor() {
    let cluster = elastic(3, ElasticRules::default()).fault("kill=0:2").unwrap();
    let run = cluster.run(STEPS).unwrap();
    assert!(run.replicas_identical());
    assert_eq!(survivors(&run), vec![1, 2]);
    let change = &run.report.ranks[1].memberships[0];
    assert_eq!((change.members.clone(), change.resumed_from_step), (vec![1, 2], 1));
    let dir = tempfile::tempdir().unwrap();
    let replayed = replay(&options_of(&cluster), 3, 1, 2, dir.path());
    assert_eq!(replayed, vec![run.final_hash().to_string(); 2]);
}

#[test]
fn a_lone_survivor_of_two_stops_unless_the_quorum_is_any() {
    let err = elastic(2, ElasticRules::default())
        .fault("kill=1:2")
        .unwrap()
        .run(4)
        .unwrap_err();
    let err = format!("{err:#}");
    assert!(
        err.contains("not a strict majority") && err.contains("--quorum any"),
        "{err}"
    );
    assert!(err.contains("committed up to step 1"), "{err}");

    let any = ElasticRules {
        quorum: Quorum::Any,
        min_ranks: 1,
    };
    let cluster = elastic(2, any).fault("kill=1:2").unwrap();
    let run = cluster.run(4).unwrap();
    assert_eq!(survivors(&run), vec![0]);
    assert_eq!(run.report.ranks[0].steps, vec![1, 2, 3, 4]);

    let floor = ElasticRules {
        quorum: Quorum::Majority,
        min_ranks: 3,
    };
    let err = elastic(3, floor).fault("kill=1:2").unwrap().run(4).unwrap_err();
    assert!(format!("{err:#}").contains("fewer than --min-ranks 3"), "{err:#}");
}

#[test]
fn a_frozen_worker_is_left_behind_and_refused_when_it_wakes() {
    // Frozen for 5 s against a 2 s deadline: its neighbours time out, the stall travels round the ring,
    // and the board waits the detection time for members only timed out on before it goes on.
    let cluster = elastic(4, ElasticRules::default())
        .timeout(Duration::from_secs(2))
        .fault("freeze=1:2:5000")
        .unwrap();
    let run = cluster.run(4).unwrap();
    assert!(run.replicas_identical());
    assert_eq!(survivors(&run), vec![0, 2, 3]);
    let frozen = run.report.ranks[1].left.as_deref().unwrap();
    assert!(frozen.contains("no longer part of the job"), "{frozen}");
    assert_eq!(run.report.ranks[0].memberships[0].lost, vec![(1, Cause::Frozen)]);
}

/// `cluster` (3 workers) run for `steps` with worker 1 dying after `msgs` messages: the survivors, 0 and 2,
/// must finish identical.
fn worker_1_dropped_after(cluster: Cluster, msgs: usize, steps: u64) -> ClusterRun {
    let run = cluster.fault(&format!("drop=1:{msgs}")).unwrap().run(steps).unwrap();
    assert!(
        run.replicas_identical(),
        "drop after {msgs}: {:?}",
        run.first_divergence()
    );
    assert_eq!(survivors(&run), vec![0, 2], "drop after {msgs}");
    run
}

#[test]
fn deaths_anywhere_in_a_step_leave_survivors_that_agree() {
    // Worker 1 dies after each number of sent messages in turn: before, inside and after each of a step's
    // collectives (the gradient's all-reduce, the scalars, the replica check). Its first 2 messages are the
    // start's fingerprint exchange, before the run: a death there fails the start, as in any job. Every run
    // finishes with identical survivors that agree on the step they continued from. (Whether a death in a
    // step's last collective leaves one survivor a step ahead depends on timing; `catch_up` below makes
    // that case on purpose.)
    // 3 steps send 24 messages after the start's 2 (8 per step: 4 for the all-reduce of the one bucket, 2
    // for the scalars, 2 for the replica check).
    for msgs in 2..26 {
        let run = worker_1_dropped_after(elastic(3, ElasticRules::default()), msgs, 3);
        let (a, b) = (&run.report.ranks[0], &run.report.ranks[2]);
        assert!(
            a.final_hash.is_some() && a.final_hash == b.final_hash,
            "drop after {msgs}"
        );
        if let (Some(x), Some(y)) = (a.memberships.first(), b.memberships.first()) {
            assert_eq!(x.resumed_from_step, y.resumed_from_step, "drop after {msgs}");
        }
    }
}

/// Survivors one step apart, made on purpose: one resumes the checkpoint of step 3, the other that of step
/// 2, and they re-form. Both continue from step 3 with the state of the one ahead, and end with the bits of
/// a run that never lost step 3.
#[test]
fn a_survivor_behind_catches_up_from_the_one_ahead() {
    let cluster = elastic(2, ElasticRules::default());
    let options = options_of(&cluster);
    let dir = tempfile::tempdir().unwrap();
    let (at2, at3) = (dir.path().join("at2"), dir.path().join("at3"));
    std::thread::scope(|s| {
        for comm in mem_cluster(2, MemOptions::default()) {
            let (options, at2, at3) = (&options, &at2, &at3);
            s.spawn(move || {
                let mut t = trainer(options, ModelSource::Fresh(ModelConfig::tiny()), Box::new(comm));
                for (step, dir) in [(2, at2), (3, at3)] {
                    while t.step() < step {
                        t.train_step().unwrap();
                    }
                    t.save(dir).unwrap();
                }
            });
        }
    });
    let membership = Membership {
        epoch: 1,
        members: vec![0, 1],
    };
    // Each starts on its own (one rank) with the job's global batch, as a joiner does.
    let alone = TrainOptions {
        global_batch: Some(2 * options.batch_size),
        ..options.clone()
    };
    let hashes: Vec<(u64, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(2, MemOptions::default())
            .into_iter()
            .zip([&at3, &at2])
            .map(|(comm, ckpt)| {
                let (alone, membership) = (&alone, &membership);
                s.spawn(move || {
                    let mut t = trainer(alone, ModelSource::Resume(ckpt.clone()), single_rank());
                    let resumed = t.reform(Box::new(comm), membership.clone()).unwrap();
                    assert_eq!(resumed, 3);
                    t.run(&mut Quiet).unwrap();
                    (t.step(), t.param_hash().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(hashes[0], hashes[1]);
    assert_eq!(hashes[0].0, STEPS);
    // The same as two ranks that never stopped.
    let straight = replay(&options, 2, 3, 2, &dir.path().join("straight"));
    assert_eq!(straight[0], hashes[0].1);
}

#[test]
fn a_joiner_takes_the_state_and_the_run_ends_with_the_bits_of_a_restart_on_more_ranks() {
    let cluster = elastic(2, ElasticRules::default()).fault("join=3").unwrap();
    let run = cluster.run(STEPS).unwrap();
    assert!(run.replicas_identical(), "{:?}", run.first_divergence());
    assert_eq!(survivors(&run), vec![0, 1, 2]);
    let joiner = &run.report.ranks[2];
    assert_eq!(joiner.steps, (3..=STEPS).collect::<Vec<_>>());
    let change = &joiner.memberships[0];
    assert_eq!((change.joined.clone(), change.resumed_from_step), (vec![2], 2));
    assert_eq!(run.report.ranks[0].memberships[0].joined, vec![2]);
    assert!(run.max_loss_gap_to_single_worker() < 1e-5);
    let dir = tempfile::tempdir().unwrap();
    let replayed = replay(&options_of(&cluster), 2, 2, 3, dir.path());
    assert_eq!(replayed, vec![run.final_hash().to_string(); 3]);
}

#[test]
fn a_loss_then_a_join_keeps_the_replicas_identical() {
    let run = elastic(3, ElasticRules::default())
        .fault("kill=1:3")
        .unwrap()
        .fault("join=5")
        .unwrap()
        .run(STEPS)
        .unwrap();
    assert!(run.replicas_identical(), "{:?}", run.first_divergence());
    assert_eq!(survivors(&run), vec![0, 2, 3]);
    let changes = &run.report.ranks[0].memberships;
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert_eq!(
        (changes[0].members.clone(), changes[1].members.clone()),
        (vec![0, 2], vec![0, 2, 3])
    );
    // Without --elastic a join is refused, as is one before the first step.
    let err = Cluster::new(2).fault("join=3").unwrap().run(4).unwrap_err();
    assert!(format!("{err:#}").contains("needs --elastic"), "{err:#}");
    let err = elastic(2, ElasticRules::default())
        .fault("join=1")
        .unwrap()
        .run(4)
        .unwrap_err();
    assert!(format!("{err:#}").contains("bigger start"), "{err:#}");
}

#[test]
fn a_joiner_lost_during_its_state_transfer_is_dropped_and_the_job_finishes() {
    // The joiner (member 2) dies after its first message in the group that admitted it: inside the
    // catch-up that hands it the state. The members re-form again without it and finish.
    let cluster = elastic(2, ElasticRules::default())
        .fault("join=3")
        .unwrap()
        .fault("drop=2:1")
        .unwrap();
    let run = cluster.run(STEPS).unwrap();
    assert!(run.replicas_identical(), "{:?}", run.first_divergence());
    assert_eq!(survivors(&run), vec![0, 1]);
    assert!(run.report.ranks[2]
        .left
        .as_deref()
        .unwrap()
        .contains("injected failure"));
    let change = &run.report.ranks[0].memberships[0];
    assert_eq!((change.epoch, change.members.clone()), (2, vec![0, 1]));
    assert_eq!(change.lost, vec![(2, Cause::Dead)]);
    // Nothing of the failed join remains: the bits of two workers that never stopped.
    let dir = tempfile::tempdir().unwrap();
    let straight = replay(&options_of(&cluster), 2, 2, 2, dir.path());
    assert_eq!(straight, vec![run.final_hash().to_string(); 2]);
}

#[test]
fn a_loss_under_auto_split_overlap_off_or_accumulation_still_ends_identical() {
    // `auto` re-measures on the new group (from the even split); overlap off and several micro-batches per
    // rank take the same re-form.
    let runs = [
        elastic(3, ElasticRules::default())
            .batch(1)
            .batch_split(6, "auto")
            .unwrap(),
        elastic(3, ElasticRules::default()).overlap(false),
        elastic(3, ElasticRules::default()).batch(1).grad_accum(2),
    ];
    for cluster in runs {
        let run = cluster.fault("kill=1:3").unwrap().run(STEPS).unwrap();
        assert!(run.replicas_identical(), "{:?}", run.first_divergence());
        assert_eq!(survivors(&run), vec![0, 2]);
        assert!(run.max_loss_gap_to_single_worker() < 1e-5);
    }
}

#[test]
fn elastic_runs_are_refused_where_ranks_are_named_by_number() {
    let err = elastic(2, ElasticRules::default())
        .batch_split(4, "3,1")
        .unwrap()
        .run(2)
        .unwrap_err();
    assert!(format!("{err:#}").contains("weights name ranks"), "{err:#}");
}

/// Sharded: the lost worker's optimizer chunk and newest parameters come from its buddy (the worker to its
/// right), and the survivors end with the bits of a restart from a checkpoint on fewer ranks.
#[test]
fn sharded_a_killed_worker_s_chunk_comes_from_its_buddy() {
    for (fault, first_survivors, committed) in [("kill=1:3", vec![0, 2], 2), ("kill=0:2", vec![1, 2], 1)] {
        let cluster = sharded(3).fault(fault).unwrap();
        let run = cluster.run(STEPS).unwrap();
        assert!(run.replicas_identical(), "{fault}: {:?}", run.first_divergence());
        assert_eq!(survivors(&run), first_survivors, "{fault}");
        let change = &run.report.ranks[first_survivors[0] as usize].memberships[0];
        assert_eq!(change.resumed_from_step, committed, "{fault}");
        assert!(run.max_loss_gap_to_single_worker() < 1e-5, "{fault}");
        let dir = tempfile::tempdir().unwrap();
        let replayed = replay(&options_of(&cluster), 3, committed, 2, dir.path());
        assert_eq!(replayed, vec![run.final_hash().to_string(); 2], "{fault}");
    }
}

/// Sharded, a worker dies after each number of its messages in turn: inside each bucket's reduce-scatter
/// and shift to its buddy, the agreement on the scalars, and the parameter gathers that overlap the next
/// forward. Every run ends with the bits of a restart from the step the survivors continued from. (A
/// survivor whose agreement failed while another's completed rolls the step forward; whether a drop leaves
/// one that way depends on timing here, so `trainer::buddy`'s unit test makes that case on purpose.)
#[test]
fn sharded_deaths_anywhere_in_a_step_end_with_the_bits_of_a_restart() {
    let base = sharded(3).bucket_elems(30_000);
    let options = options_of(&base);
    let mut resumed_from = std::collections::BTreeSet::new();
    for msgs in 2..60 {
        let run = worker_1_dropped_after(base.clone(), msgs, STEPS);
        let Some(change) = run.report.ranks[0].memberships.first() else {
            continue; // The worker finished its steps before the drop.
        };
        assert_eq!(
            Some(change.resumed_from_step),
            run.report.ranks[2].memberships.first().map(|c| c.resumed_from_step),
            "drop after {msgs}"
        );
        resumed_from.insert(change.resumed_from_step);
        let dir = tempfile::tempdir().unwrap();
        let replayed = replay(&options, 3, change.resumed_from_step, 2, dir.path());
        assert_eq!(replayed, vec![run.final_hash().to_string(); 2], "drop after {msgs}");
    }
    assert!(
        resumed_from.len() >= 3,
        "the drops fell in too few steps: {resumed_from:?}"
    );
}

/// Sharded with `--overlap off`, where the parameter gathers complete inside the step that updated: a death
/// during them leaves ranks that applied the update and have not finished the step; the update is the
/// commit point, so none applies it twice, and every run ends with the bits of a restart.
#[test]
fn sharded_without_overlap_a_death_in_the_gathers_commits_the_update_once() {
    let base = sharded(3).bucket_elems(30_000).overlap(false);
    let options = options_of(&base);
    for msgs in 14..46 {
        let run = worker_1_dropped_after(base.clone(), msgs, STEPS);
        let Some(change) = run.report.ranks[0].memberships.first() else {
            continue;
        };
        let dir = tempfile::tempdir().unwrap();
        let replayed = replay(&options, 3, change.resumed_from_step, 2, dir.path());
        assert_eq!(replayed, vec![run.final_hash().to_string(); 2], "drop after {msgs}");
    }
}

#[test]
fn sharded_a_joiner_takes_a_chunk_and_a_mirror() {
    let cluster = sharded(2).fault("join=3").unwrap();
    let run = cluster.run(STEPS).unwrap();
    assert!(run.replicas_identical(), "{:?}", run.first_divergence());
    assert_eq!(survivors(&run), vec![0, 1, 2]);
    let dir = tempfile::tempdir().unwrap();
    let replayed = replay(&options_of(&cluster), 2, 2, 3, dir.path());
    assert_eq!(replayed, vec![run.final_hash().to_string(); 3]);
    // A loss, then a join: the chunks are re-cut twice.
    let run = sharded(3)
        .fault("kill=2:2")
        .unwrap()
        .fault("join=4")
        .unwrap()
        .run(STEPS)
        .unwrap();
    assert!(run.replicas_identical(), "{:?}", run.first_divergence());
    assert_eq!(survivors(&run), vec![0, 1, 3]);
}

/// Losing a chunk's owner and its buddy at once loses that chunk: the job stops naming both, and points to
/// the last checkpoint. Two lost workers that are not neighbours leave every chunk held.
#[test]
fn sharded_losing_an_owner_and_its_buddy_at_once_stops_naming_both() {
    // Worker 1 dies, and worker 2, frozen past the deadline, is lost while the others re-form.
    let err = sharded(5)
        .timeout(Duration::from_secs(2))
        .fault("kill=1:3")
        .unwrap()
        .fault("freeze=2:3:5000")
        .unwrap()
        .run(STEPS)
        .unwrap_err();
    let err = format!("{err:#}");
    assert!(err.contains("member 1 and member 2, its buddy"), "{err}");
    assert!(err.contains("--resume"), "{err}");
    let cluster = sharded(5)
        .timeout(Duration::from_secs(2))
        .fault("kill=1:3")
        .unwrap()
        .fault("freeze=3:3:5000")
        .unwrap();
    let run = cluster.run(STEPS).unwrap();
    assert!(run.replicas_identical(), "{:?}", run.first_divergence());
    assert_eq!(survivors(&run), vec![0, 2, 4]);
    let dir = tempfile::tempdir().unwrap();
    let replayed = replay(&options_of(&cluster), 5, 2, 3, dir.path());
    assert_eq!(replayed, vec![run.final_hash().to_string(); 3]);
}
