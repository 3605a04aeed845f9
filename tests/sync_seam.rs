//! The synchronisation seam: a sync written outside the library plugs into the trainer without touching its
//! step. This one synchronises every other step and trains alone in between, as a periodic outer sync
//! would; the test checks that the step really runs through it (no collective on the local steps, the
//! ranks' own losses, replicas that part) and through the library's sync on the others.

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::{Backend, View};
use ringtrain::collective::comm_thread::CommThread;
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::metrics::StepMetrics;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::buckets::BucketPlan;
use ringtrain::trainer::comm_ledger::CommTime;
use ringtrain::trainer::sync::{AgreedStep, GradientSync, LocalStep};
use ringtrain::trainer::{ModelSource, RunObserver, TrainOptions, Trainer, UpdateMode};

/// Delegates even steps (0-based) to the library's sync; on odd ones each rank keeps its own gradient.
struct EveryOtherStep<B: Backend> {
    inner: Box<dyn GradientSync<B>>,
    local: bool,
}

impl<B: Backend> GradientSync<B> for EveryOtherStep<B> {
    fn loss_scale(&self, local_tokens: usize) -> f32 {
        self.inner.loss_scale(local_tokens)
    }

    fn begin_step(&mut self, be: &mut B, step: u64) {
        self.local = step % 2 == 1;
        self.inner.begin_step(be, step);
    }

    fn await_params(&mut self, be: &mut B, params: View, upto: usize) -> anyhow::Result<()> {
        self.inner.await_params(be, params, upto)
    }

    fn overlaps_backward(&self) -> bool {
        !self.local && self.inner.overlaps_backward()
    }

    fn backward_starting(&mut self, comm: &CommThread) {
        self.inner.backward_starting(comm);
    }

    fn gradients_final(&mut self, be: &mut B, comm: &CommThread, grads: View, from: usize) -> anyhow::Result<()> {
        self.inner.gradients_final(be, comm, grads, from)
    }

    fn synchronise(
        &mut self,
        be: &mut B,
        comm: &CommThread,
        grads: View,
        local: LocalStep,
    ) -> anyhow::Result<AgreedStep> {
        if !self.local {
            return self.inner.synchronise(be, comm, grads, local);
        }
        Ok(AgreedStep {
            loss: local.loss,
            grad_sq: be.sum_squares(grads)?,
        })
    }

    fn after_update(&mut self, be: &mut B, comm: &CommThread, params: View) -> anyhow::Result<()> {
        match self.local {
            true => Ok(()),
            false => self.inner.after_update(be, comm, params),
        }
    }

    fn settle_params(&mut self, be: &mut B, params: View) -> anyhow::Result<()> {
        self.inner.settle_params(be, params)
    }

    fn take_comm_time(&mut self) -> CommTime {
        self.inner.take_comm_time()
    }

    fn clear_comm_time(&mut self) {
        self.inner.clear_comm_time();
    }

    fn membership_changed(
        &mut self,
        be: &mut B,
        plan: &BucketPlan,
        owner: &ringtrain::collective::Owner,
        reduction: ringtrain::trainer::grad_sync::Reduction,
    ) -> anyhow::Result<()> {
        self.inner.membership_changed(be, plan, owner, reduction)
    }
}

/// Each step's metrics and parameter fingerprint.
#[derive(Default)]
struct Steps(Vec<(StepMetrics, String)>);

impl<B: Backend> RunObserver<B> for Steps {
    fn step(&mut self, t: &mut Trainer<B>, m: &StepMetrics) -> anyhow::Result<()> {
        self.0.push((m.clone(), t.param_hash()?));
        Ok(())
    }
}

#[test]
fn a_sync_from_outside_the_library_runs_the_step() {
    let model = ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    };
    let options = TrainOptions {
        batch_size: 2,
        seq_len: 16,
        update: UpdateMode::Replicated,
        eval_batches: 0,
        ..TrainOptions::for_model(&model).with_steps(4)
    };
    let ranks: Vec<Vec<(StepMetrics, String)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = mem_cluster(2, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let (model, options) = (&model, &options);
                scope.spawn(move || {
                    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let source = ModelSource::Fresh(model.clone());
                    let mut t = Trainer::new(be, source, data, options.clone(), Box::new(comm)).unwrap();
                    t.wrap_sync(|inner| Box::new(EveryOtherStep { inner, local: false }))
                        .unwrap();
                    let mut steps = Steps::default();
                    t.run(&mut steps).unwrap();
                    steps.0
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (a, b) = (&ranks[0], &ranks[1]);
    assert_eq!(a.len(), 4);
    // Step 1 synchronises: the same loss and the same replica on both ranks, and a collective ran.
    assert_eq!(a[0].0.loss.to_bits(), b[0].0.loss.to_bits());
    assert_eq!(a[0].1, b[0].1);
    assert!(a[0].0.comm_ms > 0.0, "{:?}", a[0].0);
    // Step 2 is local: each rank's own loss on its own share, no collective, and the replicas part.
    assert_ne!(a[1].0.loss.to_bits(), b[1].0.loss.to_bits());
    assert_eq!((a[1].0.comm_ms, b[1].0.comm_ms), (0.0, 0.0));
    assert_ne!(a[1].1, b[1].1);
    // Step 3 synchronises again: the agreed loss is the same bits on both ranks.
    assert_eq!(a[2].0.loss.to_bits(), b[2].0.loss.to_bits());
    assert!(a[2].0.comm_ms > 0.0);
}
