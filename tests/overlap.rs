//! Gradient sync overlapping backward: `--overlap on` and `off` give the same bits for every world size,
//! accumulation and update mode, on the CPU backend and on wgpu (whose buckets are read back while later
//! kernels are still queued); replicas stay identical after every step; any bucket size works; and with
//! overlap on the first bucket's collective starts while backward is still running.

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::testing::{open_or_skip, Device};
use ringtrain::backend::Backend;
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::metrics::StepMetrics;
use ringtrain::model::{ModelConfig, ParamLayout};
use ringtrain::trainer::grad_sync::SyncTrace;
use ringtrain::trainer::{ModelSource, RunObserver, TrainOptions, Trainer, UpdateMode};

/// What one rank saw in each step.
struct RankRun {
    losses: Vec<f64>,
    hashes: Vec<String>,
    traces: Vec<SyncTrace>,
    buckets: usize,
}

impl<B: Backend> RunObserver<B> for RankRun {
    fn step(&mut self, t: &mut Trainer<B>, m: &StepMetrics) -> anyhow::Result<()> {
        self.losses.push(m.loss);
        self.hashes.push(t.param_hash()?);
        self.traces
            .push(t.last_sync_trace().expect("the bucketed sync traces").clone());
        Ok(())
    }
}

/// Trains `options.steps` steps of `model` on `world` CPU ranks over the in-memory ring.
fn train(world: usize, model: &ModelConfig, options: &TrainOptions) -> Vec<RankRun> {
    train_on(BackendChoice::Cpu, world, model, options)
}

/// [`train`] on another backend.
fn train_on(choice: BackendChoice, world: usize, model: &ModelConfig, options: &TrainOptions) -> Vec<RankRun> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = mem_cluster(world, MemOptions::default())
            .into_iter()
            .map(|comm| {
                scope.spawn(move || {
                    let (be, _) = factory::open(choice, 0).unwrap();
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let source = ModelSource::Fresh(model.clone());
                    let mut t: Trainer<Box<dyn Backend>> =
                        Trainer::new(be, source, data, options.clone(), Box::new(comm)).unwrap();
                    let mut run = RankRun {
                        losses: Vec::new(),
                        hashes: Vec::new(),
                        traces: Vec::new(),
                        buckets: t.bucket_plan().buckets.len(),
                    };
                    t.run(&mut run).unwrap();
                    run
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn options(model: &ModelConfig, update: UpdateMode, grad_accum: usize, overlap: bool) -> TrainOptions {
    TrainOptions {
        batch_size: 2,
        seq_len: 32,
        grad_accum,
        update,
        overlap,
        eval_every: 0,
        // Several buckets: tiny's largest tensor (wte) is 16,384 elements.
        bucket_elems: 20_000,
        ..TrainOptions::for_model(model).with_steps(20)
    }
}

/// Every rank's fingerprint equals rank 0's after every step.
fn assert_replicas_identical(runs: &[RankRun], what: &str) {
    for (rank, run) in runs.iter().enumerate() {
        assert_eq!(run.hashes, runs[0].hashes, "{what}: rank {rank} diverged from rank 0");
    }
}

#[test]
fn overlap_on_and_off_give_identical_bits() {
    let model = ModelConfig::tiny();
    for world in 1..=4 {
        for grad_accum in [1, 3] {
            for update in [UpdateMode::Replicated, UpdateMode::Sharded] {
                let what = format!("{world} ranks, grad-accum {grad_accum}, {}", update.as_str());
                let on = train(world, &model, &options(&model, update, grad_accum, true));
                let off = train(world, &model, &options(&model, update, grad_accum, false));
                assert!(on[0].buckets > 2, "{what}: {} buckets", on[0].buckets);
                assert_eq!(on[0].hashes.len(), 20);
                assert_replicas_identical(&on, &what);
                assert_replicas_identical(&off, &what);
                assert_eq!(on[0].hashes, off[0].hashes, "{what}: overlap on and off differ");
                assert_eq!(on[0].losses, off[0].losses, "{what}");
            }
        }
    }
}

#[test]
fn buckets_smaller_than_a_tensor_and_larger_than_the_model_work() {
    let model = ModelConfig::tiny();
    let total = ParamLayout::new(&model).total;
    for update in [UpdateMode::Replicated, UpdateMode::Sharded] {
        let runs: Vec<Vec<RankRun>> = [1, 20_000, 10 * total]
            .into_iter()
            .map(|bucket_elems| {
                let opts = TrainOptions {
                    bucket_elems,
                    ..options(&model, update, 1, true)
                };
                train(3, &model, &opts)
            })
            .collect();
        assert_eq!(
            runs[0][0].buckets,
            ParamLayout::new(&model).specs.len(),
            "one bucket per tensor"
        );
        assert_eq!(runs[2][0].buckets, 1, "one bucket for the whole model");
        for (runs, what) in runs
            .iter()
            .zip(["1-element buckets", "20,000-element buckets", "one bucket"])
        {
            assert_replicas_identical(runs, what);
        }
        // Other buckets change only where each element's ring sum starts: rounding, not training.
        let reference = &runs[1][0].losses;
        for (runs, what) in [(&runs[0], "1-element buckets"), (&runs[2], "one bucket")] {
            for (step, (a, b)) in runs[0].losses.iter().zip(reference).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs(),
                    "{what}, step {step}: loss {a} against {b}"
                );
            }
        }
    }
}

#[test]
fn the_first_bucket_travels_while_backward_runs() {
    // `small` with long sequences, so that backward lasts long enough to be seen overlapping.
    let model = ModelConfig::small();
    for overlap in [true, false] {
        let opts = TrainOptions {
            batch_size: 4,
            seq_len: 128,
            update: UpdateMode::Replicated,
            overlap,
            eval_every: 0,
            bucket_elems: 100_000,
            ..TrainOptions::for_model(&model).with_steps(2)
        };
        for run in train(2, &model, &opts) {
            assert!(run.buckets > 2);
            for trace in &run.traces {
                let ended = trace.backward_ended.expect("backward end recorded");
                assert_eq!(trace.bucket_started.len(), run.buckets);
                assert!(
                    trace.bucket_started.windows(2).all(|w| w[0] <= w[1]),
                    "buckets in plan order"
                );
                let first = trace.bucket_started[0];
                if overlap {
                    assert!(
                        first < ended,
                        "overlap on: the first bucket started after backward ended"
                    );
                } else {
                    assert!(first >= ended, "overlap off: a bucket started before backward ended");
                }
            }
        }
    }
}

#[test]
fn overlap_on_and_off_give_identical_bits_on_wgpu() {
    if open_or_skip(Device::Wgpu, factory::open(BackendChoice::Wgpu, 0)).is_none() {
        return;
    }
    let model = ModelConfig::tiny();
    for update in [UpdateMode::Replicated, UpdateMode::Sharded] {
        let steps = |overlap| TrainOptions {
            steps: 4,
            ..options(&model, update, 1, overlap)
        };
        let on = train_on(BackendChoice::Wgpu, 2, &model, &steps(true));
        let off = train_on(BackendChoice::Wgpu, 2, &model, &steps(false));
        let what = format!("wgpu, {}", update.as_str());
        assert!(on[0].buckets > 2);
        assert_replicas_identical(&on, &what);
        assert_eq!(on[0].hashes, off[0].hashes, "{what}: overlap on and off differ");
    }
}

#[test]
fn backward_reports_only_gradients_that_are_final() {
    use ringtrain::model::{init::init_params, Gpt2};
    let model = ModelConfig::tiny();
    let layout = ParamLayout::new(&model);
    let (mut be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    let mut gpt = Gpt2::new(&mut be, model.clone(), &init_params(&model, &layout, 7)).unwrap();
    let (b, t) = (2, 16);
    let inputs: Vec<u32> = (0..b * t).map(|i| (i * 37 % 256) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 11 % 256) as u32).collect();
    gpt.zero_grads(&mut be);
    gpt.forward(&mut be, &inputs, &targets, b, t).unwrap();
    // What each report claimed final, as it was at the time of the report.
    let mut reports: Vec<(usize, Vec<f32>)> = Vec::new();
    let grads = gpt.grads;
    gpt.backward_reporting(&mut be, 1.0 / (b * t) as f32, &mut |be, from| {
        let mut suffix = vec![0f32; layout.total - from];
        be.download(grads.sub(from, layout.total - from), &mut suffix)?;
        reports.push((from, suffix));
        Ok(())
    })
    .unwrap();
    let mut fin = vec![0f32; layout.total];
    be.download(grads, &mut fin).unwrap();
    let froms: Vec<usize> = reports.iter().map(|r| r.0).collect();
    assert!(
        froms.windows(2).all(|w| w[0] > w[1]),
        "the finished suffix only grows: {froms:?}"
    );
    assert_eq!(froms.last(), Some(&0));
    // Several reports per block: buckets can start while a block's backward goes on.
    assert!(froms.len() >= 2 + 6 * model.n_layer, "{froms:?}");
    for (from, suffix) in &reports {
        let same = suffix
            .iter()
            .zip(&fin[*from..])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "gradients from {from} changed after they were reported final");
    }
}
