//! `--sync outer` (DiLoCo): the ranks train alone between outer steps and end every outer step with the
//! same bits; the outer step is torch's Nesterov SGD on the change of the parameters; the run is a pure
//! function of its seed and flags; and what it cannot combine with is refused.

mod common;

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
    TrainOptions {
        update: UpdateMode::Replicated,
        sync: SyncMode::Outer(OuterOptions {
            every,
            lr: 0.7,
            momentum: 0.9,
            overlap: false,
        }),
        ..common::tiny_options(steps)
    }
}

fn trainer(options: &TrainOptions, comm: Box<dyn Collective>) -> CpuTrainer {
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    Trainer::new(be, ModelSource::Fresh(ModelConfig::tiny()), data, options.clone(), comm).unwrap()
}

/// `world` ranks, each a trainer of `options` from `source` running `body`: what each returned, in rank
/// order.
fn on_each_rank<T: Send>(
    world: usize,
    options: &TrainOptions,
    source: impl Fn() -> ModelSource + Sync,
    body: impl Fn(&mut CpuTrainer) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(world, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let (source, body) = (&source, &body);
                s.spawn(move || {
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                    let mut t = Trainer::new(be, source(), data, options.clone(), Box::new(comm)).unwrap();
                    body(&mut t)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn fresh() -> ModelSource {
    ModelSource::Fresh(ModelConfig::tiny())
}

/// `world` ranks train `options` step by step: each rank's metrics and parameter fingerprint after every
/// step.
fn run(world: usize, options: &TrainOptions) -> Vec<Vec<(StepMetrics, String)>> {
    on_each_rank(world, options, fresh, |t| {
        let mut out = Vec::new();
        while t.step() < options.steps {
            let m = t.train_step().unwrap();
            out.push((m, t.param_hash().unwrap()));
        }
        out
    })
}

/// 1 to 4 ranks under both update modes: the ranks agree exactly at the outer steps, and the two modes
/// give the same bits (the same ring mean, the same element-wise update).
#[test]
fn one_to_four_ranks_agree_after_every_outer_step_under_both_update_modes() {
    for world in 1..=4 {
        let finals: Vec<String> = [UpdateMode::Sharded, UpdateMode::Replicated]
            .into_iter()
            .map(|update| {
                let opts = TrainOptions {
                    update,
                    ..options(2, 4)
                };
                let ranks = run(world, &opts);
                for step in [1, 3] {
                    assert!(
                        ranks.iter().all(|r| r[step].1 == ranks[0][step].1),
                        "{world} ranks, {update:?}, step {}",
                        step + 1
                    );
                }
                ranks[0][3].1.clone()
            })
            .collect();
        assert_eq!(finals[0], finals[1], "{world} ranks");
    }
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

/// With `--outer-lr 1 --outer-momentum 0` the outer step is plain averaging: one rank trains exactly as
/// without outer steps.
#[test]
fn one_rank_with_outer_lr_1_and_no_momentum_trains_as_plain_training() {
    let averaging = TrainOptions {
        sync: SyncMode::Outer(OuterOptions {
            every: 2,
            lr: 1.0,
            momentum: 0.0,
            overlap: false,
        }),
        ..options(2, 6)
    };
    let plain = TrainOptions {
        sync: SyncMode::EveryStep,
        ..averaging.clone()
    };
    assert_eq!(
        run(1, &averaging)[0].last().unwrap().1,
        run(1, &plain)[0].last().unwrap().1
    );
}

/// Each rank's parameters after `steps` steps of `opts` over `world` ranks.
fn params_after(world: usize, opts: &TrainOptions, steps: u64) -> Vec<Vec<f32>> {
    on_each_rank(world, opts, fresh, |t| {
        while t.step() < steps {
            t.train_step().unwrap();
        }
        t.params().unwrap()
    })
}

/// Several ranks: the shared θ after the first outer step equals, within the rounding of the ring's sum
/// (relative 1e-5), θ0 − lr (Δ̄ + μ Δ̄) with Δ̄ the mean of θ0 − θ_r over the ranks' local θ_r, taken here
/// from a run whose first outer step comes later.
#[test]
fn the_shared_parameters_are_the_outer_step_on_the_mean_change() {
    let world = 3;
    let start = trainer(&options(2, 4), single_rank()).params().unwrap();
    let locals = params_after(world, &options(4, 4), 2);
    assert_ne!(locals[0], locals[1]);
    let shared = params_after(world, &options(2, 4), 2);
    assert!(shared.iter().all(|p| *p == shared[0]));
    let (lr, mu) = (0.7f64, 0.9f64);
    let mut worst = 0f64;
    for (i, &got) in shared[0].iter().enumerate() {
        let theta0 = f64::from(start[i]);
        let mean = locals.iter().map(|r| theta0 - f64::from(r[i])).sum::<f64>() / world as f64;
        let expected = theta0 - lr * (mean + mu * mean);
        worst = worst.max((f64::from(got) - expected).abs() / expected.abs().max(1e-3));
    }
    assert!(worst < 1e-5, "largest relative difference {worst}");
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
                eval_every: 6,
                ..base.clone()
            },
            "--eval-every 6",
        ),
        (
            TrainOptions {
                sync: SyncMode::Outer(OuterOptions {
                    every: 4,
                    lr: 0.7,
                    momentum: 1.0,
                    overlap: false,
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
/// return each rank's parameter fingerprint, inner moments and the losses (their bits) of the outer steps
/// it took.
fn train_to(
    world: usize,
    options: &TrainOptions,
    source: impl Fn() -> ModelSource + Sync,
    until: u64,
    save: Option<&std::path::Path>,
) -> Vec<(String, Vec<f32>, Vec<u64>)> {
    on_each_rank(world, options, source, |t| {
        let mut rounds = Vec::new();
        while t.step() < until {
            rounds.extend(t.train_step().unwrap().outer.map(|r| r.loss.to_bits()));
        }
        if let Some(dir) = save {
            t.save(dir).unwrap();
        }
        (t.param_hash().unwrap(), t.moments().unwrap().v, rounds)
    })
}

/// A checkpoint holds the outer state and every rank's own inner moments (and, between outer steps, its own
/// parameters): the resumed run ends with the bits of one that never stopped, each rank's inner optimizer
/// included.
#[test]
fn a_resumed_outer_run_continues_with_every_rank_s_own_bits() {
    let opts = options(2, 6);
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        let opts = TrainOptions { update, ..opts.clone() };
        let straight = train_to(3, &opts, fresh, 6, None);
        assert_ne!(
            straight[0].1, straight[1].1,
            "the ranks' inner moments differ by design"
        );
        // At an outer step, and between two (each rank's own parameters saved too).
        for saved_at in [4, 3] {
            train_to(3, &opts, fresh, saved_at, Some(&ck));
            let resumed = train_to(3, &opts, || ModelSource::Resume(ck.clone()), 6, None);
            // The outer steps after the save report what the straight run's did: a round begun before the
            // save keeps its losses.
            for (r, s) in resumed.iter().zip(&straight) {
                assert_eq!((&r.0, &r.1), (&s.0, &s.1), "{update:?}, saved at step {saved_at}");
                let after = (6 - saved_at as usize).div_ceil(2);
                assert_eq!(r.2.len(), after);
                assert!(s.2.ends_with(&r.2), "{update:?}, saved at step {saved_at}");
            }
        }
        // The model files of the save between outer steps hold the shared parameters of step 2.
        let shared = run(3, &opts)[0][1].1.clone();
        let read = ModelSource::Resume(ck.clone()).read(0).unwrap();
        assert_eq!(ringtrain::trainer::hash_f32(&read.params), shared, "{update:?}");
    }
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
    let err = Trainer::new(be, ModelSource::Resume(plain), data, opts.clone(), single_rank())
        .err()
        .expect("an every-step checkpoint under --sync outer");
    assert!(format!("{err:#}").contains("holds no --sync outer state"), "{err:#}");
}

/// `sent_bytes`: nothing on an inner step (outer mode exchanges no per-step scalar), and on an outer step
/// about what one all-reduce of the parameters sends, 2 (N − 1) / N × 4 bytes per parameter, as every step
/// of every-step sync does.
#[test]
fn inner_steps_send_nothing_and_an_outer_step_one_all_reduce_of_the_parameters() {
    let world = 3;
    let params = trainer(&options(2, 4), single_rank()).param_count() as f64;
    let all_reduce = 2.0 * (world - 1) as f64 / world as f64 * 4.0 * params;
    let near = |bytes: u64| (bytes as f64 - all_reduce).abs() < 0.01 * all_reduce + 1024.0;
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        let ranks = run(
            world,
            &TrainOptions {
                update,
                ..options(2, 4)
            },
        );
        for r in &ranks {
            let sent: Vec<u64> = r.iter().map(|(m, _)| m.sent_bytes).collect();
            assert_eq!((sent[0], sent[2]), (0, 0), "{update:?}: {sent:?}");
            assert!(
                near(sent[1]) && near(sent[3]),
                "{update:?}: {sent:?} against {all_reduce}"
            );
        }
    }
    let every_step = TrainOptions {
        sync: SyncMode::EveryStep,
        update: UpdateMode::Replicated,
        ..options(2, 4)
    };
    for r in run(world, &every_step) {
        assert!(
            r.iter().all(|(m, _)| near(m.sent_bytes)),
            "{:?}",
            r.iter().map(|(m, _)| m.sent_bytes).collect::<Vec<_>>()
        );
    }
}

/// Under `--sync outer` each rank decides on its own non-finite steps: a rank that skipped one has taken
/// fewer inner AdamW steps, and a resume keeps each rank's own count (its bias correction).
#[test]
fn a_rank_that_skipped_a_step_resumes_with_its_own_optimizer_step() {
    let opts = options(2, 6);
    let skip_on_rank_1 = |t: &mut CpuTrainer| {
        t.arm_faults(ringtrain::fault_plan::FaultPlan::parse(&["nan=1:3"]).unwrap());
    };
    let body = |until: u64, save: Option<std::path::PathBuf>| {
        move |t: &mut CpuTrainer| {
            skip_on_rank_1(t);
            let mut skipped = Vec::new();
            while t.step() < until {
                skipped.push(t.train_step().unwrap().skipped);
            }
            if let Some(dir) = &save {
                t.save(dir).unwrap();
            }
            (t.param_hash().unwrap(), t.moments().unwrap().step, skipped)
        }
    };
    let straight = on_each_rank(2, &opts, fresh, body(6, None));
    assert_eq!((straight[0].1, straight[1].1), (6, 5), "rank 1 skipped step 3");
    assert!(straight[1].2[2] && !straight[0].2[2]);
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    on_each_rank(2, &opts, fresh, body(4, Some(ck.clone())));
    let resumed = on_each_rank(2, &opts, || ModelSource::Resume(ck.clone()), body(6, None));
    for (r, s) in resumed.iter().zip(&straight) {
        assert_eq!((&r.0, r.1), (&s.0, s.1));
    }
}

fn overlapped(every: u64, steps: u64) -> TrainOptions {
    let opts = options(every, steps);
    let Some(outer) = opts.sync.outer() else { unreachable!() };
    TrainOptions {
        sync: SyncMode::Outer(OuterOptions { overlap: true, ..outer }),
        ..opts
    }
}

/// What a rank of an overlapped run holds after each step: its metrics, the fingerprints of its device's
/// parameters and of the shared ones, and whether the device's are its own.
type OverlapTrace = Vec<(StepMetrics, String, String, bool)>;

fn run_overlapped(world: usize, options: &TrainOptions) -> Vec<OverlapTrace> {
    on_each_rank(world, options, fresh, |t| {
        let mut out = Vec::new();
        while t.step() < options.steps {
            let m = t.train_step().unwrap();
            let own = t.holds_own_params();
            out.push((m, t.param_hash().unwrap(), t.shared_param_hash().unwrap(), own));
        }
        out
    })
}

/// `--outer-overlap on`: the shared parameters are the same bits on every rank after every outer step,
/// while each rank works on its own (the shared ones plus its own last round); the run's end puts the same
/// final model on every rank. Both update modes agree, and a rerun gives the same bits.
#[test]
fn overlapped_outer_steps_keep_the_shared_parameters_identical_and_the_run_deterministic() {
    let finals: Vec<String> = [UpdateMode::Sharded, UpdateMode::Replicated]
        .into_iter()
        .map(|update| {
            let opts = TrainOptions {
                update,
                ..overlapped(2, 6)
            };
            let ranks = run_overlapped(3, &opts);
            for step in [1, 3, 5] {
                assert!(
                    ranks.iter().all(|r| r[step].2 == ranks[0][step].2),
                    "{update:?}, step {}: the shared parameters",
                    step + 1
                );
            }
            for step in [1, 3] {
                assert!(ranks.iter().all(|r| r[step].3), "{update:?}, step {}", step + 1);
                assert!(
                    ranks.windows(2).all(|w| w[0][step].1 != w[1][step].1),
                    "{update:?}, step {}: each rank keeps its own round",
                    step + 1
                );
            }
            // The run's end: every rank holds the last outer step.
            assert!(ranks
                .iter()
                .all(|r| !r[5].3 && r[5].1 == ranks[0][5].1 && r[5].2 == r[5].1));
            // The first outer step has no earlier one to apply; each later one reports the round before.
            let reported: Vec<bool> = ranks[0].iter().map(|(m, ..)| m.outer.is_some()).collect();
            assert_eq!(reported, [false, false, false, true, false, true], "{update:?}");
            assert_eq!(run_overlapped(3, &opts)[0][5].1, ranks[0][5].1, "{update:?}: a rerun");
            ranks[0][5].1.clone()
        })
        .collect();
    assert_eq!(finals[0], finals[1]);
    let plain = run(3, &options(2, 6));
    assert_ne!(plain[0][5].1, finals[0], "the delayed outer step is another trajectory");
}

/// One rank: the first outer step leaves the rank on its own parameters (nothing to apply yet), so the
/// second round trains as plain training does; the second outer step applies the first round's Nesterov
/// step to the start and adds the second round's own progress back; the run's last step puts its own outer
/// step on the device.
#[test]
fn an_overlapped_outer_step_is_applied_one_round_late_keeping_the_rank_s_progress() {
    let (every, steps) = (2, 6);
    let opts = overlapped(every, steps);
    let plain = TrainOptions {
        sync: SyncMode::EveryStep,
        ..opts.clone()
    };
    let mut t = trainer(&plain, single_rank());
    let start = t.params().unwrap();
    let mut trained = Vec::new();
    while t.step() < 2 * every {
        t.train_step().unwrap();
        trained.push(t.params().unwrap());
    }
    let (first_round, second_round) = (&trained[1], &trained[3]);
    let start_loss = trainer(&opts, single_rank()).evaluate().unwrap();
    let mut t = trainer(&opts, single_rank());
    let mut after = Vec::new();
    while t.step() < steps {
        t.train_step().unwrap();
        after.push((t.params().unwrap(), t.shared_params().unwrap()));
        if t.step() == every {
            // Evaluation reads the shared parameters (the start, here) and leaves the rank's own in place.
            assert_eq!(t.evaluate().unwrap(), start_loss);
            assert_eq!(t.params().unwrap(), after[1].0);
        }
    }
    assert_eq!(
        &after[1].0, first_round,
        "the first round goes on from the rank's own parameters"
    );
    assert_eq!(
        after[1].1, start,
        "the shared parameters are the start until an outer step is applied"
    );
    assert_eq!(&after[2].0, &trained[2], "the second round trains as plain training");
    let (lr, mu) = (0.7f32, 0.9f32);
    for i in 0..start.len() {
        let delta = start[i] - first_round[i];
        let shared = start[i] - lr * (delta + mu * delta);
        assert_eq!(after[3].1[i].to_bits(), shared.to_bits(), "shared element {i}");
        let own = shared - (first_round[i] - second_round[i]);
        assert_eq!(after[3].0[i].to_bits(), own.to_bits(), "element {i}");
    }
    assert_eq!(
        after[5].0, after[5].1,
        "the last outer step is on the device at the end"
    );
    assert_ne!(after[5].0, after[3].1);
}

/// Several ranks: the shared parameters the second overlapped outer step applies are the Nesterov step on
/// the mean of the ranks' first-round changes (within float rounding of the ring's mean).
#[test]
fn the_overlapped_shared_parameters_are_the_outer_step_on_the_mean_change() {
    let opts = overlapped(2, 6);
    let ranks = on_each_rank(3, &opts, fresh, |t| {
        let start = t.params().unwrap();
        let mut after = Vec::new();
        while t.step() < 4 {
            t.train_step().unwrap();
            after.push((t.params().unwrap(), t.shared_params().unwrap()));
        }
        (start, after)
    });
    let start = &ranks[0].0;
    let (lr, mu) = (0.7f32, 0.9f32);
    let mut worst = 0f32;
    for (i, &at_start) in start.iter().enumerate() {
        let mean: f32 = ranks.iter().map(|(_, a)| at_start - a[1].0[i]).sum::<f32>() / 3.0;
        let expected = at_start - lr * (mean + mu * mean);
        worst = worst.max((ranks[0].1[3].1[i] - expected).abs());
    }
    assert!(worst <= 1e-6, "largest difference {worst}");
    assert!(ranks.iter().all(|(_, a)| a[3].1 == ranks[0].1[3].1));
}

/// A checkpoint of `--outer-overlap on` holds the outer step still to apply and each rank's round start:
/// resumed at an outer step, in a round, and from the end of a shorter run (whose model files hold its last
/// outer step, applied early), the run ends with the bits of one that never stopped. A run without overlap
/// refuses it.
#[test]
fn an_overlapped_run_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        let opts = TrainOptions {
            update,
            ..overlapped(2, 6)
        };
        let straight = train_to(3, &opts, fresh, 6, None);
        for saved_at in [4, 3] {
            train_to(3, &opts, fresh, saved_at, Some(&ck));
            let resumed = train_to(3, &opts, || ModelSource::Resume(ck.clone()), 6, None);
            for (r, s) in resumed.iter().zip(&straight) {
                assert_eq!((&r.0, &r.1), (&s.0, &s.1), "{update:?}, saved at step {saved_at}");
            }
        }
        // A run told to end at step 4 (same schedule) puts its last outer step on the device and in its model
        // files; resumed to step 6 it goes on from the anchor, as the longer run did.
        let shorter = TrainOptions {
            steps: 4,
            ..opts.clone()
        };
        let ended = train_to(3, &shorter, fresh, 4, Some(&ck));
        assert_ne!(
            ended[0].0,
            run(3, &opts)[0][3].1,
            "{update:?}: the end applies its outer step"
        );
        let read = ModelSource::Resume(ck.clone()).read(0).unwrap();
        assert_eq!(ringtrain::trainer::hash_f32(&read.params), ended[0].0, "{update:?}");
        let resumed = train_to(3, &opts, || ModelSource::Resume(ck.clone()), 6, None);
        for (r, s) in resumed.iter().zip(&straight) {
            assert_eq!((&r.0, &r.1), (&s.0, &s.1), "{update:?}, resumed from a run's end");
        }
    }
    // Every rank refuses it alike, before any collective.
    let without = options(2, 6);
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(3, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let (without, ck) = (&without, &ck);
                s.spawn(move || {
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                    let source = ModelSource::Resume(ck.clone());
                    match Trainer::new(be, source, data, without.clone(), Box::new(comm)) {
                        Ok(mut t) => format!("{:#}", t.train_step().unwrap_err()),
                        Err(e) => format!("{e:#}"),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for err in errors {
        assert!(err.contains("--outer-overlap on"), "{err}");
    }
}

/// A run resumed between outer steps that saves before its first step writes the model files it read (the
/// shared parameters), not the rank's own parameters it put on the device; with and without overlap.
#[test]
fn a_save_before_the_first_step_of_a_resumed_round_keeps_the_shared_parameters() {
    for opts in [options(2, 6), overlapped(2, 6)] {
        let dir = tempfile::tempdir().unwrap();
        let (ck, again) = (dir.path().join("ck"), dir.path().join("again"));
        train_to(3, &opts, fresh, 3, Some(&ck));
        on_each_rank(
            3,
            &opts,
            || ModelSource::Resume(ck.clone()),
            |t| t.save(&again).unwrap(),
        );
        let read = |dir: &std::path::Path| ModelSource::Resume(dir.to_path_buf()).read(0).unwrap().params;
        assert_eq!(
            read(&ck),
            read(&again),
            "overlap {}",
            opts.sync.outer().unwrap().overlap
        );
    }
}

/// `--verify-every` at the outer steps compares the parameters and the outer sync's shared state (the
/// anchor, and the momentum where every rank holds all of it): the ranks agree on all of it, with and
/// without overlap, so the check passes and reports its fingerprint.
#[test]
fn the_replica_check_at_outer_steps_covers_the_outer_state_and_passes() {
    for overlap in [false, true] {
        for update in [UpdateMode::Replicated, UpdateMode::Sharded] {
            let base = if overlap { overlapped(2, 4) } else { options(2, 4) };
            let opts = TrainOptions {
                update,
                verify_every: 2,
                ..base
            };
            let ranks = run(3, &opts);
            for r in &ranks {
                let checked: Vec<bool> = r.iter().map(|(m, _)| m.param_hash.is_some()).collect();
                assert_eq!(checked, [false, true, false, true], "overlap {overlap}, {update:?}");
            }
            let fingerprints: Vec<&Option<String>> = ranks.iter().map(|r| &r[1].0.param_hash).collect();
            assert!(fingerprints.iter().all(|f| *f == fingerprints[0]));
            // The fingerprint covers more than the parameters: the anchor at least.
            assert_ne!(fingerprints[0].as_deref(), Some(ranks[0][1].1.as_str()));
        }
    }
}
