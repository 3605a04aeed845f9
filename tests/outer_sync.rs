//! `--sync outer` (DiLoCo): the ranks train alone between outer steps and end every outer step with the
//! same bits; the outer step is torch's Nesterov SGD on the change of the parameters; the run is a pure
//! function of its seed and flags; and what it cannot combine with is refused.

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::mem::{mem_cluster, single_rank, MemOptions};
use ringtrain::collective::Collective;
use ringtrain::data::{load_splits, BatchSplit, TokenizerKind};
use ringtrain::elastic::ElasticRules;
use ringtrain::metrics::StepMetrics;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, OuterOptions, SyncMode, TrainOptions, Trainer, UpdateMode};

type CpuTrainer = Trainer<Box<dyn ringtrain::backend::Backend>>;

fn options(every: u64, steps: u64) -> TrainOptions {
    let model = ModelConfig::tiny();
    TrainOptions {
        batch_size: 2,
        seq_len: 32,
        eval_every: 0,
        eval_batches: 0,
        update: UpdateMode::Replicated,
        sync: SyncMode::Outer(OuterOptions {
            every,
            lr: 0.7,
            momentum: 0.9,
        }),
        ..TrainOptions::for_model(&model).with_steps(steps)
    }
}

fn trainer(options: &TrainOptions, comm: Box<dyn Collective>) -> CpuTrainer {
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    Trainer::new(be, ModelSource::Fresh(ModelConfig::tiny()), data, options.clone(), comm).unwrap()
}

/// `world` ranks train `options` step by step: each rank's metrics and parameter fingerprint after every
/// step.
fn run(world: usize, options: &TrainOptions) -> Vec<Vec<(StepMetrics, String)>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(world, MemOptions::default())
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let mut t = trainer(options, Box::new(comm));
                    let mut out = Vec::new();
                    while t.step() < options.steps {
                        let m = t.train_step().unwrap();
                        out.push((m, t.param_hash().unwrap()));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_part_between_outer_steps_and_agree_after_each() {
    let (every, steps) = (3, 9);
    let ranks = run(3, &options(every, steps));
    for step in 0..steps as usize {
        let hashes: Vec<&String> = ranks.iter().map(|r| &r[step].1).collect();
        let outer = (step as u64 + 1) % every == 0;
        let alike = hashes.iter().all(|h| *h == hashes[0]);
        assert_eq!(alike, outer, "step {}: {hashes:?}", step + 1);
        for (rank, r) in ranks.iter().enumerate() {
            let m = &r[step].0;
            assert_eq!(m.outer.is_some(), outer, "rank {rank} step {}", m.step);
        }
        if outer {
            // The round's loss: the mean over ranks of each rank's mean inner loss, in rank order.
            let from = step + 1 - every as usize;
            let per_rank: Vec<f64> = ranks
                .iter()
                .map(|r| r[from..=step].iter().map(|(m, _)| m.loss).sum::<f64>() / every as f64)
                .collect();
            let expected = per_rank.iter().sum::<f64>() / 3.0;
            for r in &ranks {
                let round = r[step].0.outer.unwrap();
                assert_eq!((round.loss, round.inner_steps), (expected, every));
                assert!(round.delta_norm > 0.0);
            }
            // Each rank's own inner losses differ: it trains on its own share.
            assert_ne!(ranks[0][step].0.loss, ranks[1][step].0.loss);
        }
    }
    // The same seed and flags: the same bits.
    assert_eq!(
        run(3, &options(every, steps))[0].last().unwrap().1,
        ranks[0].last().unwrap().1
    );
}

/// One rank: its inner steps are plain training, so the outer step can be checked element by element
/// against torch's Nesterov SGD applied to Δ = θ0 − θ_inner, computed here in f32.
#[test]
fn the_outer_step_applies_nesterov_sgd_to_the_change_of_the_parameters() {
    let (every, steps) = (2, 2);
    let outer = options(every, steps);
    let plain = TrainOptions {
        sync: SyncMode::EveryStep,
        ..outer.clone()
    };
    let mut t = trainer(&plain, single_rank());
    let start = t.params().unwrap();
    while t.step() < steps {
        t.train_step().unwrap();
    }
    let inner = t.params().unwrap();
    let mut t = trainer(&outer, single_rank());
    while t.step() < steps {
        t.train_step().unwrap();
    }
    let got = t.params().unwrap();
    let (lr, mu) = (0.7f32, 0.9f32);
    for i in 0..start.len() {
        let delta = start[i] - inner[i];
        let momentum = mu * 0.0 + delta;
        let expected = start[i] - lr * (delta + mu * momentum);
        assert_eq!(got[i].to_bits(), expected.to_bits(), "element {i}");
    }
}

#[test]
fn what_outer_sync_cannot_combine_with_is_refused() {
    let model = ModelConfig::tiny();
    let base = options(4, 8);
    let cases: Vec<(TrainOptions, &str)> = vec![
        (
            TrainOptions {
                update: UpdateMode::Sharded,
                ..base.clone()
            },
            "--sync outer needs --update replicated",
        ),
        (
            TrainOptions {
                elastic: Some(ElasticRules::default()),
                ..base.clone()
            },
            "--sync outer with --elastic is not built",
        ),
        (
            TrainOptions {
                batch_split: BatchSplit::Auto,
                ..base.clone()
            },
            "must be equal",
        ),
        (
            base.clone().with_steps(10),
            "--steps 10 is not a multiple of --outer-every 4",
        ),
        (
            TrainOptions {
                save_every: 6,
                ..base.clone()
            },
            "--save-every 6",
        ),
        (
            TrainOptions {
                sync: SyncMode::Outer(OuterOptions {
                    every: 4,
                    lr: 0.7,
                    momentum: 1.0,
                }),
                ..base.clone()
            },
            "--outer-momentum 1 must be in [0, 1)",
        ),
    ];
    for (opts, why) in cases {
        let err = opts.validate(&model, 2).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    }
    assert!(base.validate(&model, 2).is_ok());
}

/// `world` ranks train `options` to `until` (from `source` of each rank), save to `dir` when given, and
/// return each rank's parameter fingerprint and inner moments.
fn train_to(
    world: usize,
    options: &TrainOptions,
    source: impl Fn() -> ModelSource + Sync,
    until: u64,
    save: Option<&std::path::Path>,
) -> Vec<(String, Vec<f32>)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(world, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let source = &source;
                s.spawn(move || {
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                    let mut t = Trainer::new(be, source(), data, options.clone(), Box::new(comm)).unwrap();
                    while t.step() < until {
                        t.train_step().unwrap();
                    }
                    if let Some(dir) = save {
                        t.save(dir).unwrap();
                    }
                    (t.param_hash().unwrap(), t.moments().unwrap().v)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A checkpoint at an outer step holds the outer state and every rank's own inner moments: the resumed run
/// ends with the bits of one that never stopped, each rank's inner optimizer included.
#[test]
fn a_resumed_outer_run_continues_with_every_rank_s_own_bits() {
    let opts = options(2, 6);
    let fresh = || ModelSource::Fresh(ModelConfig::tiny());
    let straight = train_to(3, &opts, fresh, 6, None);
    assert_ne!(
        straight[0].1, straight[1].1,
        "the ranks' inner moments differ by design"
    );
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    train_to(3, &opts, fresh, 4, Some(&ck));
    let resumed = train_to(3, &opts, || ModelSource::Resume(ck.clone()), 6, None);
    assert_eq!(resumed, straight);
    // Another number of ranks, or the other --sync mode, is refused naming why.
    let resume = |opts: &TrainOptions, world: usize| {
        let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
        let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
        let comm: Box<dyn Collective> = match world {
            1 => single_rank(),
            _ => unreachable!(),
        };
        let source = ModelSource::Resume(ck.clone());
        match Trainer::new(be, source, data, opts.clone(), comm) {
            Ok(mut t) => format!("{:#}", t.train_step().unwrap_err()),
            Err(e) => format!("{e:#}"),
        }
    };
    let err = resume(&opts, 1);
    assert!(err.contains("inner optimizer state of 3 ranks"), "{err}");
    let every_step = TrainOptions {
        sync: SyncMode::EveryStep,
        global_batch: Some(6),
        ..opts.clone()
    };
    let err = resume(&every_step, 1);
    assert!(err.contains("synchronisation state"), "{err}");
    // And an every-step checkpoint under --sync outer.
    let plain = dir.path().join("plain");
    let one = TrainOptions {
        sync: SyncMode::EveryStep,
        ..opts.clone()
    };
    train_to(1, &one, fresh, 2, Some(&plain));
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    let mut t = Trainer::new(be, ModelSource::Resume(plain), data, opts.clone(), single_rank()).unwrap();
    let err = format!("{:#}", t.train_step().unwrap_err());
    assert!(err.contains("not --sync outer's"), "{err}");
}
