//! What the synchronisation seam carries between steps: a sync's own state through a checkpoint (a resumed
//! run continues with the bits of an uninterrupted one, and a run whose sync keeps no state refuses such a
//! checkpoint), and a re-formed group (the collective replaced between two steps, the ranks renumbered).

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::{Backend, View};
use ringtrain::collective::comm_thread::CommThread;
use ringtrain::collective::mem::{mem_cluster, MemCollective, MemOptions};
use ringtrain::collective::Collective;
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::model::checkpoint::load_trainer_state;
use ringtrain::model::{ModelConfig, ParamLayout};
use ringtrain::trainer::buckets::BucketPlan;
use ringtrain::trainer::comm_ledger::CommTime;
use ringtrain::trainer::sync::{AgreedStep, GradientSync, LocalStep, SyncState};
use ringtrain::trainer::{ModelSource, TrainOptions, Trainer, UpdateMode};
use std::path::Path;

type Be = Box<dyn Backend>;

/// The library's sync, plus a carry: before each step's gradient is synchronised, half of the last step's
/// agreed gradient is added to it. The carry is the same bits on every rank, and only a checkpoint can take
/// it across a restart.
struct CarrySync {
    inner: Box<dyn GradientSync<Be>>,
    /// `[param_count]` on the host: the last agreed gradient; empty before the first step.
    carry: Vec<f32>,
}

impl GradientSync<Be> for CarrySync {
    fn loss_scale(&self, local_tokens: usize) -> f32 {
        self.inner.loss_scale(local_tokens)
    }

    fn begin_step(&mut self, be: &mut Be, step: u64) {
        self.inner.begin_step(be, step);
    }

    fn await_params(&mut self, be: &mut Be, params: View, upto: usize) -> anyhow::Result<()> {
        self.inner.await_params(be, params, upto)
    }

    fn overlaps_backward(&self) -> bool {
        false
    }

    fn gradients_final(&mut self, _: &mut Be, _: &CommThread, _: View, _: usize) -> anyhow::Result<()> {
        unreachable!("this sync does not overlap backward")
    }

    fn synchronise(
        &mut self,
        be: &mut Be,
        comm: &CommThread,
        grads: View,
        local: LocalStep,
    ) -> anyhow::Result<AgreedStep> {
        let mut gradient = vec![0f32; grads.len];
        be.download(grads, &mut gradient)?;
        for (g, c) in gradient.iter_mut().zip(&self.carry) {
            *g += 0.5 * c;
        }
        be.upload(grads, &gradient)?;
        let agreed = self.inner.synchronise(be, comm, grads, local)?;
        self.carry.resize(grads.len, 0.0);
        be.download(grads, &mut self.carry)?;
        Ok(agreed)
    }

    fn after_update(&mut self, be: &mut Be, comm: &CommThread, params: View) -> anyhow::Result<()> {
        self.inner.after_update(be, comm, params)
    }

    fn settle_params(&mut self, be: &mut Be, params: View) -> anyhow::Result<()> {
        self.inner.settle_params(be, params)
    }

    fn take_comm_time(&mut self) -> CommTime {
        self.inner.take_comm_time()
    }

    fn clear_comm_time(&mut self) {
        self.inner.clear_comm_time();
    }

    fn checkpoint_state(&mut self, _: &mut Be, _: &CommThread) -> anyhow::Result<SyncState> {
        Ok(SyncState::from([("carry".to_string(), self.carry.clone())]))
    }

    fn restore_state(&mut self, _: &mut Be, mut state: SyncState) -> anyhow::Result<()> {
        self.carry = state.remove("carry").unwrap_or_default();
        anyhow::ensure!(state.is_empty(), "unexpected sync state {:?}", state.keys());
        Ok(())
    }

    fn membership_changed(
        &mut self,
        be: &mut Be,
        plan: &BucketPlan,
        owner: &ringtrain::collective::Owner,
        reduction: ringtrain::trainer::grad_sync::Reduction,
    ) -> anyhow::Result<()> {
        self.inner.membership_changed(be, plan, owner, reduction)
    }
}

fn model() -> ModelConfig {
    ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    }
}

fn options(update: UpdateMode, steps: u64) -> TrainOptions {
    TrainOptions {
        batch_size: 2,
        seq_len: 16,
        update,
        overlap: false,
        eval_batches: 0,
        // Several buckets, so a sharded rank owns a chunk of each.
        bucket_elems: 5_000,
        ..TrainOptions::for_model(&model()).with_steps(steps)
    }
}

fn trainer(source: ModelSource, options: &TrainOptions, comm: MemCollective) -> anyhow::Result<Trainer<Be>> {
    let (be, _) = factory::open(BackendChoice::Cpu, 0)?;
    let data = load_splits("synthetic", None, TokenizerKind::Byte)?;
    Trainer::new(be, source, data, options.clone(), Box::new(comm))
}

fn with_carry_sync(t: &mut Trainer<Be>) {
    t.wrap_sync(|inner| {
        Box::new(CarrySync {
            inner,
            carry: Vec::new(),
        })
    })
    .unwrap();
}

/// Runs a 4-step job's steps up to `steps` on 2 ranks from `source` with the carrying sync, saving to `save` at the end when
/// given; returns each rank's parameter fingerprint.
fn run_two_ranks(source: impl Fn() -> ModelSource + Sync, steps: u64, save: Option<&Path>) -> Vec<String> {
    // The options of a 4-step run always, stopped after `steps`: the learning-rate schedule spans the run.
    let options = options(UpdateMode::Replicated, 4);
    std::thread::scope(|scope| {
        let handles: Vec<_> = mem_cluster(2, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let (options, source) = (&options, &source);
                scope.spawn(move || {
                    let mut t = trainer(source(), options, comm).unwrap();
                    with_carry_sync(&mut t);
                    while t.step() < steps {
                        t.train_step().unwrap();
                    }
                    if let Some(dir) = save {
                        t.save(dir).unwrap();
                    }
                    t.param_hash().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_syncs_state_crosses_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    let fresh = || ModelSource::Fresh(model());
    let straight = run_two_ranks(fresh, 4, None);
    // Stopped after 2 steps: step 1's agreed gradient is carried into step 2's.
    run_two_ranks(fresh, 2, Some(&ckpt));
    let resumed = run_two_ranks(|| ModelSource::Resume(ckpt.clone()), 4, None);
    assert_eq!(
        resumed, straight,
        "the resumed run continues with the uninterrupted run's bits"
    );

    // The state was there to carry: a non-zero gradient, which step 2 adds to its own (without it the
    // resumed run would end elsewhere).
    let layout = ParamLayout::new(&model());
    let state = load_trainer_state(&ckpt, &layout).unwrap();
    let carry = &state.sync["carry"];
    assert_eq!(carry.len(), layout.total);
    assert!(carry.iter().any(|&c| c != 0.0));

    // A run whose sync keeps no state refuses the checkpoint before its first step instead of dropping it.
    let options = options(UpdateMode::Replicated, 4);
    let refused = std::thread::scope(|scope| {
        let handles: Vec<_> = mem_cluster(2, MemOptions::default())
            .into_iter()
            .map(|comm| {
                let (options, ckpt) = (&options, &ckpt);
                scope.spawn(move || {
                    let mut t = trainer(ModelSource::Resume(ckpt.clone()), options, comm).unwrap();
                    format!("{:#}", t.train_step().unwrap_err())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for message in refused {
        assert!(
            message.contains("synchronisation state \"carry\"") && message.contains("does not keep"),
            "{message}"
        );
    }
}

/// Each rank's parameter fingerprint and agreed loss after every step of a sharded 2-rank run of 4 steps;
/// with `renumber`, the group is re-formed after step 2 with the ranks' numbers swapped.
fn sharded_run(renumber: bool) -> Vec<Vec<(String, u64)>> {
    let options = options(UpdateMode::Sharded, 4);
    let mut reformed: Vec<Option<MemCollective>> =
        mem_cluster(2, MemOptions::default()).into_iter().map(Some).collect();
    // Thread r gets rank 1 - r of the re-formed group.
    reformed.reverse();
    std::thread::scope(|scope| {
        let handles: Vec<_> = mem_cluster(2, MemOptions::default())
            .into_iter()
            .zip(reformed.iter_mut().map(Option::take))
            .map(|(comm, mut next)| {
                let options = &options;
                scope.spawn(move || {
                    let mut t = trainer(ModelSource::Fresh(model()), options, comm).unwrap();
                    let mut steps = Vec::new();
                    while t.step() < 4 {
                        if t.step() == 2 && renumber {
                            let next = next.take().unwrap();
                            let new_rank = next.rank();
                            t.replace_collective(Box::new(next)).unwrap();
                            assert_eq!(t.rank(), new_rank);
                        }
                        let m = t.train_step().unwrap();
                        steps.push((t.param_hash().unwrap(), m.loss.to_bits()));
                    }
                    steps
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_reformed_group_continues_with_the_same_bits() {
    let straight = sharded_run(false);
    let renumbered = sharded_run(true);
    // Thread 0 was rank 0, then rank 1: its replica and the agreed losses follow the uninterrupted run's.
    assert_eq!(renumbered[0], straight[0]);
    assert_eq!(renumbered[1], straight[1]);
    assert_eq!(renumbered[0], renumbered[1]);
}

#[test]
fn a_group_of_another_size_is_refused() {
    let options = options(UpdateMode::Replicated, 2);
    let solo = mem_cluster(1, MemOptions::default()).pop().unwrap();
    let mut t = trainer(ModelSource::Fresh(model()), &options, solo).unwrap();
    let bigger = mem_cluster(2, MemOptions::default()).remove(0);
    let message = format!("{:#}", t.replace_collective(Box::new(bigger)).unwrap_err());
    assert!(message.contains("has 2 ranks, this run 1"), "{message}");
}
