//! ZeRO-1 optimizer memory: in sharded mode each of N ranks keeps the AdamW moments of its own chunk only
//! (1/N of the replicated state), checkpoints gather those chunks into full tensors, and a resume with
//! another world size re-cuts them.

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::Backend;
use ringtrain::collective::chunk_range;
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, TrainOptions, Trainer, UpdateMode};
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
        ..TrainOptions::for_model(&model()).with_steps(3)
    }
}

/// The moments a trainer holds, downloaded: `([owned.len()], [owned.len()])`.
fn moments(t: &mut Trainer<Box<dyn Backend>>) -> (Vec<f32>, Vec<f32>) {
    let (mut m, mut v) = (vec![0f32; t.opt.m.len], vec![0f32; t.opt.v.len]);
    t.be.download(t.opt.m, &mut m).unwrap();
    t.be.download(t.opt.v, &mut v).unwrap();
    (m, v)
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
        (t.rank(), t.opt.owned.clone(), t.opt.m.len)
    });
    for (rank, owned, len) in &lens {
        assert_eq!(*owned, chunk_range(total, 3, *rank));
        assert_eq!(*len, owned.len());
        assert!(len.abs_diff(total / 3) <= 1, "rank {rank}: {len} of {total}");
    }
    assert_eq!(lens.iter().map(|l| l.2).sum::<usize>(), total);
    for len in on_ranks(3, UpdateMode::Replicated, fresh, |t| t.opt.m.len) {
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
            (t.opt.owned.clone(), moments(t))
        },
    );
    let (mut full_m, mut full_v) = (vec![f32::NAN; total], vec![f32::NAN; total]);
    for (owned, (m, v)) in &chunks {
        full_m[owned.clone()].copy_from_slice(m);
        full_v[owned.clone()].copy_from_slice(v);
    }
    assert!(full_m.iter().any(|&x| x != 0.0), "the moments moved");
    // One process resuming holds the gathered tensors.
    let resume = |p: &Path| ModelSource::Resume(p.to_path_buf());
    let single = on_ranks(1, UpdateMode::Sharded, || resume(&ckpt), moments);
    assert!(bits_equal(&single[0].0, &full_m) && bits_equal(&single[0].1, &full_v));
    // Two sharded ranks resuming each hold their chunk of them.
    for (owned, (m, v)) in on_ranks(
        2,
        UpdateMode::Sharded,
        || resume(&ckpt),
        |t| (t.opt.owned.clone(), moments(t)),
    ) {
        assert_eq!(owned.len(), m.len());
        assert!(bits_equal(&m, &full_m[owned.clone()]) && bits_equal(&v, &full_v[owned]));
    }
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
