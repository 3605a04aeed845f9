//! Training on the two-level ring: 4 ranks on 2 hosts of 2 (told apart by `RINGTRAIN_HOST_ID`'s value in
//! each rank's config), over QUIC between the hosts and shared memory within them. Replicas stay
//! bit-identical after every step, the losses follow one worker on the global batch within 1e-5 for both
//! update modes and with overlap on and off, and a sharded checkpoint of the two-level run resumes on a
//! flat ring of another size (the moments are gathered and re-cut).

mod common;

use common::{assert_trains_like, quic_ranks, Run};
use std::path::Path;

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::mem::single_rank;
use ringtrain::collective::{Collective, CollectiveChoice};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, TrainOptions, Trainer, UpdateMode};

const STEPS: u64 = 4;
const HOSTS: [&str; 4] = ["host-a", "host-a", "host-b", "host-b"];

fn model() -> ModelConfig {
    ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    }
}

fn options(batch_size: usize, update: UpdateMode, overlap: bool) -> TrainOptions {
    TrainOptions {
        batch_size,
        seq_len: 16,
        update,
        overlap,
        eval_batches: 0,
        // Several buckets, so that a sharded rank owns a part of each.
        bucket_elems: 5_000,
        collective: CollectiveChoice::Hierarchical,
        ..TrainOptions::for_model(&model()).with_steps(STEPS)
    }
}

fn run_trainer(
    comm: Box<dyn Collective>,
    opts: TrainOptions,
    source: ModelSource,
    until: u64,
    save: Option<&Path>,
) -> Run {
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let mut t = Trainer::new(be, source, data, opts, comm).unwrap();
    let mut run = Vec::new();
    while t.step() < until {
        let m = t.train_step().unwrap();
        run.push((m.loss, t.param_hash().unwrap()));
    }
    if let Some(dir) = save {
        t.save(dir).unwrap();
    }
    run
}

/// Trains the 4 ranks of 2 hosts up to step `until`, saving at the end when `save` is given.
fn two_hosts(opts: &TrainOptions, until: u64, save: Option<&Path>) -> Vec<Run> {
    let job = opts.job_hash(&model(), HOSTS.len());
    quic_ranks(&HOSTS, opts.collective, job, |rank, q| {
        let t = q.layout().expect("two hosts of two ranks run the two-level ring");
        assert_eq!((t.host.len(), t.cross.len()), (2, 2));
        // Each host's pair talks through shared memory, the pairs through QUIC.
        let want = if rank % 2 == 0 {
            ["quic", "shm"]
        } else {
            ["shm", "quic"]
        };
        assert_eq!(q.data_links(), want, "rank {rank}: [from the left, to the right]");
        run_trainer(Box::new(q), opts.clone(), ModelSource::Fresh(model()), until, save)
    })
}

fn one_worker(update: UpdateMode) -> Run {
    run_trainer(
        single_rank(),
        TrainOptions {
            collective: CollectiveChoice::Flat,
            ..options(4 * HOSTS.len(), update, true)
        },
        ModelSource::Fresh(model()),
        STEPS,
        None,
    )
}

#[test]
fn two_hosts_of_two_ranks_train_like_one_worker_with_identical_replicas() {
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        let reference = one_worker(update);
        for overlap in [true, false] {
            let what = format!("{update:?} overlap {overlap}");
            let ranks = two_hosts(&options(4, update, overlap), STEPS, None);
            assert_trains_like(&ranks, &reference, &what);
        }
    }
}

/// `--wire bf16` rounds on the cross-host ring only: the replicas stay identical and the losses stay near
/// one worker's (tiny's losses move by well under 1e-3 over 4 steps of bf16-rounded gradients).
#[test]
fn a_compact_wire_on_two_levels_keeps_the_replicas_identical() {
    let reference = one_worker(UpdateMode::Replicated);
    let opts = TrainOptions {
        wire: ringtrain::collective::Wire::Bf16,
        ..options(4, UpdateMode::Replicated, true)
    };
    let ranks = two_hosts(&opts, STEPS, None);
    for (rank, run) in ranks.iter().enumerate() {
        for (step, ((loss, hash), (want, want_hash))) in run.iter().zip(&reference).enumerate() {
            assert_eq!(hash, &ranks[0][step].1, "rank {rank}'s replica differs at step {step}");
            assert!(
                (loss - want).abs() <= 1e-3,
                "step {step}: loss {loss} against one worker's {want}"
            );
            if step == STEPS as usize - 1 {
                assert_ne!(hash, want_hash, "bf16 rounding changes the parameters");
            }
        }
    }
}

#[test]
fn a_sharded_two_level_checkpoint_resumes_on_one_worker() {
    let dir = tempfile::tempdir().unwrap();
    let opts = options(4, UpdateMode::Sharded, true);
    let full = two_hosts(&opts, STEPS, None);
    two_hosts(&opts, 2, Some(dir.path()));
    // One worker with the same global batch goes on from the gathered moments.
    let resumed = run_trainer(
        single_rank(),
        TrainOptions {
            collective: CollectiveChoice::Flat,
            ..options(4 * HOSTS.len(), UpdateMode::Sharded, true)
        },
        ModelSource::Resume(dir.path().to_path_buf()),
        STEPS,
        None,
    );
    assert_eq!(resumed.len(), 2);
    for (step, ((loss, _), (want, _))) in resumed.iter().zip(&full[0][2..]).enumerate() {
        assert!(
            (loss - want).abs() <= 1e-5,
            "step {}: resumed loss {loss} against the two-level run's {want}",
            step + 3
        );
    }
}

#[test]
fn options_that_name_another_ring_than_the_collective_runs_are_refused() {
    use ringtrain::collective::mem::{mem_cluster, MemOptions};
    let comm = mem_cluster(2, MemOptions::default()).pop().unwrap();
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let opts = options(4, UpdateMode::Sharded, true);
    let e = Trainer::new(be, ModelSource::Fresh(model()), data, opts, Box::new(comm))
        .err()
        .expect("the in-memory ring is flat")
        .to_string();
    assert!(e.contains("--collective hierarchical"), "{e}");
}
