//! Uneven shares of the global batch (`--batch-split`, `--global-batch`): N ranks with fixed uneven weights
//! train like one worker on the same global batch (losses within 1e-5), their replicas stay bit-identical
//! after every step, the split really changes the partition, and a resume across a change of split and
//! world size continues the data exactly.

mod common;

use common::{assert_trains_like, Run};
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::collective::Collective;
use ringtrain::data::{load_splits, BatchSplit, TokenizerKind};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, TrainOptions, Trainer, UpdateMode};
use std::path::Path;

const STEPS: u64 = 4;

fn model() -> ModelConfig {
    ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    }
}

/// One rank's options: a 4-step run of 16-token sequences.
fn options(
    batch_size: usize,
    grad_accum: usize,
    global: Option<usize>,
    split: &str,
    update: UpdateMode,
) -> TrainOptions {
    TrainOptions {
        batch_size,
        seq_len: 16,
        grad_accum,
        global_batch: global,
        batch_split: BatchSplit::parse(split).unwrap(),
        update,
        eval_batches: 0,
        // Several buckets, so that a sharded rank owns a chunk of each.
        bucket_elems: 5_000,
        ..TrainOptions::for_model(&model()).with_steps(STEPS)
    }
}

/// Trains `per_rank.len()` ranks (each with its own options) from `source` up to step `until`, saving at
/// the end when `save` is given; returns each rank's run.
fn train(
    per_rank: &[TrainOptions],
    source: &(dyn Fn() -> ModelSource + Sync),
    until: u64,
    save: Option<&Path>,
) -> Vec<Run> {
    let comms = mem_cluster(per_rank.len(), MemOptions::default());
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let options = per_rank[comm.rank()].clone();
                scope.spawn(move || {
                    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let mut t = Trainer::new(be, source(), data, options, Box::new(comm)).unwrap();
                    let mut run = Vec::new();
                    while t.step() < until {
                        let m = t.train_step().unwrap();
                        run.push((m.loss, t.param_hash().unwrap()));
                    }
                    if let Some(dir) = save {
                        t.save(dir).unwrap();
                    }
                    run
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn fresh() -> ModelSource {
    ModelSource::Fresh(model())
}

/// One worker over the whole global batch of `global` sequences.
fn one_worker(global: usize, update: UpdateMode) -> Run {
    train(&[options(global, 1, None, "even", update)], &fresh, STEPS, None).remove(0)
}

#[test]
fn uneven_weights_train_like_one_worker_on_the_global_batch() {
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        // 3,1 over 2 ranks: 4 sequences per micro-batch, 3 micro-batches each by default: G = 24, shares 18 + 6.
        for (k, overlap) in [(1, true), (3, false), (3, true)] {
            let per_rank: Vec<TrainOptions> = (0..2)
                .map(|_| TrainOptions {
                    overlap,
                    ..options(4, k, None, "3,1", update)
                })
                .collect();
            let what = format!("{update:?} 3,1 grad-accum {k} overlap {overlap}");
            let uneven = train(&per_rank, &fresh, STEPS, None);
            let global = 2 * 4 * k;
            assert_trains_like(&uneven, &one_worker(global, update), &what);
            // The split changed the partition: the even run ends elsewhere.
            let even: Vec<TrainOptions> = (0..2).map(|_| options(4, k, None, "even", update)).collect();
            let even = train(&even, &fresh, STEPS, None);
            assert_ne!(even[0].last().unwrap().1, uneven[0].last().unwrap().1, "{what}");
        }
        // 5,2,1 over 3 ranks with a global batch of 16 and a batch size per rank: shares 10 + 4 + 2.
        let per_rank = [
            options(4, 1, Some(16), "5,2,1", update),
            options(3, 1, Some(16), "5,2,1", update),
            options(1, 1, Some(16), "5,2,1", update),
        ];
        let uneven = train(&per_rank, &fresh, STEPS, None);
        assert_trains_like(&uneven, &one_worker(16, update), &format!("{update:?} 5,2,1"));
    }
}

#[test]
fn an_even_split_with_a_remainder_covers_the_global_batch() {
    // 7 sequences over 2 ranks: 4 + 3, each rank in micro-batches of at most 2.
    let per_rank: Vec<TrainOptions> = (0..2)
        .map(|_| options(2, 1, Some(7), "even", UpdateMode::Sharded))
        .collect();
    let ranks = train(&per_rank, &fresh, STEPS, None);
    assert_trains_like(&ranks, &one_worker(7, UpdateMode::Sharded), "even 4+3");
}

#[test]
fn a_resume_across_another_split_and_world_continues_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let update = UpdateMode::Sharded;
    let reference = one_worker(12, update);
    // Two steps on 2 ranks split 3,1 ...
    let two: Vec<TrainOptions> = (0..2).map(|_| options(4, 1, Some(12), "3,1", update)).collect();
    let first = train(&two, &fresh, 2, Some(&ckpt));
    // ... then two more on 3 ranks split evenly, from the checkpoint.
    let three: Vec<TrainOptions> = (0..3).map(|_| options(4, 1, Some(12), "even", update)).collect();
    let resume = || ModelSource::Resume(ckpt.clone());
    let second = train(&three, &resume, STEPS, None);
    let joined: Vec<Run> = vec![first[0].iter().chain(&second[0]).cloned().collect()];
    assert_trains_like(&joined, &reference, "3,1 on 2 ranks, then even on 3");
    assert_trains_like(&second, &reference[2..].to_vec(), "the 3 resumed ranks");

    // A resume whose global batch does not divide the data cursor is refused, naming the one to pass.
    let other = options(5, 1, None, "even", update);
    let comm = mem_cluster(1, MemOptions::default()).remove(0);
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let err = Trainer::new(be, resume(), data, other, Box::new(comm)).err().unwrap();
    assert!(format!("{err:#}").contains("pass --global-batch 12"), "{err:#}");
}

#[test]
fn bad_splits_are_refused_at_start() {
    let refused = |options: TrainOptions, world: usize| options.validate(&model(), world).unwrap_err().to_string();
    let e = refused(options(4, 1, None, "3,1,1", UpdateMode::Sharded), 2);
    assert!(e.contains("3 weights for 2 ranks"), "{e}");
    let e = refused(options(4, 1, Some(4), "1000,1", UpdateMode::Sharded), 2);
    assert!(e.contains("rank 1's weight 1 gives it none"), "{e}");
    let e = refused(options(4, 1, Some(1), "even", UpdateMode::Sharded), 2);
    assert!(e.contains("cannot give each of 2 ranks one"), "{e}");
    let e = refused(options(4, 2, Some(16), "even", UpdateMode::Sharded), 2);
    assert!(e.contains("--grad-accum 2 with --global-batch"), "{e}");
}

/// The metrics record uneven shares on the first step only (they do not change), and equal ones never.
#[test]
fn the_metrics_record_uneven_shares() {
    for (split, want) in [("3,1", Some(vec![9, 3])), ("even", None)] {
        let options = options(6, 1, Some(12), split, UpdateMode::Sharded);
        let recorded: Vec<Vec<Option<Vec<usize>>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = mem_cluster(2, MemOptions::default())
                .into_iter()
                .map(|comm| {
                    let options = options.clone();
                    scope.spawn(move || {
                        let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                        let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                        let mut t = Trainer::new(be, fresh(), data, options, Box::new(comm)).unwrap();
                        (0..2).map(|_| t.train_step().unwrap().batch_shares).collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for rank in recorded {
            assert_eq!(rank, vec![want.clone(), None], "{split}");
        }
    }
}
