//! Resume with a cosine schedule: a run that saves at step 5 of 12 and a fresh process that resumes from it
//! end with the same bits as an uninterrupted 12-step run (parameters and AdamW moments).

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::Backend;
use ringtrain::collective::mem::single_rank as solo;
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::model::ModelConfig;
use ringtrain::optim::schedule::ScheduleKind;
use ringtrain::trainer::{ModelSource, TrainOptions, Trainer};

fn options(cfg: &ModelConfig) -> TrainOptions {
    let mut o = TrainOptions {
        batch_size: 2,
        seq_len: 16,
        grad_accum: 2,
        eval_every: 0,
        ..TrainOptions::for_model(cfg).with_steps(12)
    };
    o.schedule.kind = ScheduleKind::Cosine;
    o.schedule.warmup = 2;
    o
}

fn trainer(source: ModelSource) -> Trainer<Box<dyn Backend>> {
    let cfg = ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    };
    let opts = options(&cfg);
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let source = match source {
        ModelSource::Fresh(_) => ModelSource::Fresh(cfg),
        other => other,
    };
    let (cpu, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    Trainer::new(cpu, source, data, opts, solo()).unwrap()
}

fn state(t: &mut Trainer<Box<dyn Backend>>) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let params = t.params().unwrap();
    let moments = t.moments().unwrap();
    (params, moments.m, moments.v)
}

#[test]
fn cosine_resume_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let mut straight = trainer(ModelSource::Fresh(ModelConfig::tiny()));
    let mut losses = Vec::new();
    for _ in 0..12 {
        losses.push(straight.train_step().unwrap().loss);
    }
    let mut first = trainer(ModelSource::Fresh(ModelConfig::tiny()));
    for _ in 0..5 {
        first.train_step().unwrap();
    }
    first.save(&ckpt).unwrap();
    drop(first);
    let mut second = trainer(ModelSource::Resume(ckpt.clone()));
    assert_eq!(second.step(), 5);
    assert_eq!(second.moments().unwrap().step, 5);
    let mut resumed_losses = Vec::new();
    for _ in 5..12 {
        resumed_losses.push(second.train_step().unwrap().loss);
    }
    assert_eq!(&losses[5..], &resumed_losses[..], "per-step losses differ after resume");
    assert!(
        state(&mut straight) == state(&mut second),
        "parameters or moments differ after resume"
    );
    assert_eq!(second.tokens_seen(), straight.tokens_seen());
}
