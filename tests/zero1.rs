//! ZeRO-1 optimizer memory: in sharded mode each of N ranks keeps the AdamW moments of its own chunk of
//! every gradient bucket only (1/N of the replicated state), checkpoints gather those chunks into full
//! tensors, and a resume with another world size re-cuts them.

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::Backend;
use ringtrain::collective::chunk_range;
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, TrainOptions, Trainer, UpdateMode};
use std::ops::Range;
use std::path::Path;

fn model() -> ModelConfig {
    ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    }
}

fn options(update: UpdateMode) -> TrainOptions {
    TrainOptions {
        batch_size: 2,
        seq_len: 16,
        update,
        eval_every: 0,
        // Several buckets, so that a rank owns several slices.
        bucket_elems: 5_000,
        ..TrainOptions::for_model(&model()).with_steps(3)
    }
}

/// The moments a trainer holds, downloaded: `([owned.len()], [owned.len()])`.
fn moments(t: &mut Trainer<Box<dyn Backend>>) -> (Vec<f32>, Vec<f32>) {
    let moments = t.moments().unwrap();
    (moments.m, moments.v)
}

/// The flat-layout ranges whose moments a trainer keeps.
fn owned(t: &mut Trainer<Box<dyn Backend>>) -> Vec<Range<usize>> {
    t.moments().unwrap().owned
}

/// Runs `world` ranks over the in-memory ring; each builds a trainer from `source` and hands it to `body`.
fn on_ranks<T: Send>(
    world: usize,
    update: UpdateMode,
    source: impl Fn() -> ModelSource + Sync,
    body: impl Fn(&mut Trainer<Box<dyn Backend>>) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = mem_cluster(world, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let (source, body) = (&source, &body);
                scope.spawn(move || {
                    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let mut t = Trainer::new(be, source(), data, options(update), Box::new(comm)).unwrap();
                    body(&mut t)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn sharded_ranks_keep_a_nth_of_the_moments() {
    let total = ringtrain::model::ParamLayout::new(&model()).total;
    let fresh = || ModelSource::Fresh(model());
    let lens = on_ranks(3, UpdateMode::Sharded, fresh, |t| {
        let moments = t.moments().unwrap();
        (
            t.rank(),
            moments.owned,
            moments.m.len(),
            t.bucket_plan().buckets.clone(),
        )
    });
    for (rank, owned, len, buckets) in &lens {
        assert!(buckets.len() > 2, "{buckets:?}");
        // Chunk `rank` of every bucket, ascending.
        let mut expected: Vec<Range<usize>> = buckets
            .iter()
            .map(|b| {
                let c = chunk_range(b.len(), 3, *rank);
                b.start + c.start..b.start + c.end
            })
            .collect();
        expected.reverse();
        assert_eq!(*owned, expected);
        assert_eq!(*len, owned.iter().map(|r| r.len()).sum::<usize>());
        assert!(
            len.abs_diff(total / 3) <= buckets.len(),
            "rank {rank}: {len} of {total}"
        );
    }
    assert_eq!(lens.iter().map(|l| l.2).sum::<usize>(), total);
    for len in on_ranks(3, UpdateMode::Replicated, fresh, |t| t.moments().unwrap().m.len()) {
        assert_eq!(len, total);
    }
}

#[test]
fn checkpoints_gather_sharded_moments_and_resume_recuts_them() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let total = ringtrain::model::ParamLayout::new(&model()).total;
    // Three sharded ranks train two steps (12 windows: whole global batches for 1, 2 and 3 ranks), keep
    // their moment chunks, and save together.
    let chunks = on_ranks(
        3,
        UpdateMode::Sharded,
        || ModelSource::Fresh(model()),
        |t| {
            for _ in 0..2 {
                t.train_step().unwrap();
            }
            t.save(&ckpt).unwrap();
            (owned(t), moments(t))
        },
    );
    let (mut full_m, mut full_v) = (vec![f32::NAN; total], vec![f32::NAN; total]);
    for (owned, (m, v)) in &chunks {
        place(owned, m, &mut full_m);
        place(owned, v, &mut full_v);
    }
    assert!(full_m.iter().all(|x| !x.is_nan()), "the chunks cover every element");
    assert!(full_m.iter().any(|&x| x != 0.0), "the moments moved");
    // One process resuming holds the gathered tensors.
    let resume = |p: &Path| ModelSource::Resume(p.to_path_buf());
    let single = on_ranks(1, UpdateMode::Sharded, || resume(&ckpt), moments);
    assert!(bits_equal(&single[0].0, &full_m) && bits_equal(&single[0].1, &full_v));
    // Two sharded ranks resuming each hold their chunk of them.
    for (owned, (m, v)) in on_ranks(2, UpdateMode::Sharded, || resume(&ckpt), |t| (owned(t), moments(t))) {
        assert_eq!(owned.iter().map(|r| r.len()).sum::<usize>(), m.len());
        assert!(bits_equal(&m, &cut(&owned, &full_m)) && bits_equal(&v, &cut(&owned, &full_v)));
    }
}

/// Owned values (range after range) written to their places in a full tensor.
fn place(owned: &[Range<usize>], values: &[f32], full: &mut [f32]) {
    let mut at = 0;
    for r in owned {
        full[r.clone()].copy_from_slice(&values[at..at + r.len()]);
        at += r.len();
    }
}

/// The owned elements of a full tensor, range after range.
fn cut(owned: &[Range<usize>], full: &[f32]) -> Vec<f32> {
    owned.iter().flat_map(|r| full[r.clone()].iter().copied()).collect()
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
