//! `ringtrain train` and `ringtrain bench step`: build the trainer from resolved flags and run the loop
//! with progress, metrics, evaluation and checkpoints.

use super::args::TrainArgs;
use super::metrics::{MetricsWriter, StepMetrics};
use super::progress::Progress;
use super::select::{select_backend, BackendKind};
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::data::{load_splits, DataSplits};
use crate::dist::env::{detect_launch, LaunchFlags};
use crate::trainer::{ModelSource, TrainOptions, Trainer};
use anyhow::{bail, ensure, Context, Result};

/// Everything a run needs, resolved from flags, the TOML file and the launch environment.
struct RunSetup {
    source: ModelSource,
    data: DataSplits,
    opts: TrainOptions,
    backend: BackendKind,
    backend_reason: String,
    metrics_path: Option<std::path::PathBuf>,
}

fn setup(args: TrainArgs) -> Result<RunSetup> {
    let args = args.merged_with_file()?;
    let flags = LaunchFlags {
        rank: args.rank,
        world_size: args.world_size,
        local_rank: None,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
    };
    let launch = detect_launch(&flags, |k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
    if launch.world_size > 1 {
        bail!(
            "world size {} requested (from {:?}), but this build trains in a single process: the data-parallel \
             trainer over the collective layer is not wired into `ringtrain train` yet",
            launch.world_size,
            launch.source
        );
    }
    ensure!(
        args.init.is_none() || args.resume.is_none(),
        "--init and --resume both given: --resume already restores the parameters"
    );
    let (source, n_positions) = if let Some(dir) = &args.resume {
        let dir = crate::model::checkpoint::resolve_checkpoint_dir(dir)?;
        let cfg = crate::model::checkpoint::load_model(&dir)?.0;
        (crate::trainer::ModelSource::Resume(dir), cfg.n_positions)
    } else if let Some(dir) = &args.init {
        let cfg = crate::model::checkpoint::load_model(dir)
            .with_context(|| format!("--init {}", dir.display()))?
            .0;
        (ModelSource::Init(dir.clone()), cfg.n_positions)
    } else {
        let cfg = args.model_config()?;
        let n = cfg.n_positions;
        (ModelSource::Fresh(cfg), n)
    };
    let opts = args.resolve(n_positions, launch.world_size)?;
    let data_spec = args.data.clone().unwrap_or_else(|| "synthetic".into());
    let data = load_splits(&data_spec, args.val_data.as_deref(), args.tokenizer_kind()?)?;
    let (backend, backend_reason) = select_backend(args.backend.as_deref().unwrap_or("auto"))?;
    Ok(RunSetup {
        source,
        data,
        opts,
        backend,
        backend_reason,
        metrics_path: args.metrics.clone(),
    })
}

pub fn run_train(args: TrainArgs) -> Result<()> {
    let s = setup(args)?;
    match s.backend {
        BackendKind::Cpu => train_loop(CpuBackend::<f32>::new(), s),
    }
}

fn train_loop<B: Backend>(be: B, s: RunSetup) -> Result<()> {
    let resuming = matches!(s.source, ModelSource::Resume(_));
    let mut trainer = Trainer::new(be, s.source, s.data, s.opts)?;
    let opts = trainer.opts.clone();
    let mut metrics = match &s.metrics_path {
        Some(p) => Some(MetricsWriter::open(p, resuming)?),
        None => None,
    };
    let mut progress = Progress::new(opts.steps, trainer.step);
    progress.message(&format!(
        "ringtrain: {} params ({} layers, {} wide), backend {} [{}], global batch {} x {} tokens, {} steps from step {}",
        trainer.model.layout.total,
        trainer.model.config.n_layer,
        trainer.model.config.n_embd,
        trainer.be.name(),
        s.backend_reason,
        opts.batch_size * opts.grad_accum,
        opts.seq_len,
        opts.steps,
        trainer.step
    ));
    if trainer.step >= opts.steps {
        progress.message(&format!(
            "already at step {} of {}: nothing to train",
            trainer.step, opts.steps
        ));
    }
    let mut last: Option<StepMetrics> = None;
    while trainer.step < opts.steps {
        let mut m = trainer.train_step()?;
        if m.skipped {
            progress.message(&format!("step {}: non-finite gradients, update skipped", m.step));
        }
        let at_end = trainer.step == opts.steps;
        if (opts.eval_every > 0 && trainer.step % opts.eval_every == 0) || at_end {
            m.val_loss = trainer.evaluate()?;
            if let Some(v) = m.val_loss {
                progress.message(&format!("step {}: val loss {v:.4}", m.step));
            }
        }
        if let Some(w) = metrics.as_mut() {
            w.write(&m)?;
        }
        progress.update(&m);
        if let Some(dir) = &opts.save {
            if opts.save_every > 0 && trainer.step % opts.save_every == 0 && !at_end {
                trainer.save(dir)?;
                progress.message(&format!("step {}: saved {}", m.step, dir.display()));
            }
        }
        last = Some(m);
    }
    progress.finish();
    if let Some(dir) = &opts.save {
        trainer.save(dir)?;
        eprintln!("saved checkpoint {}", dir.display());
    }
    if let Some(m) = last {
        let val = m.val_loss.map(|v| format!(", val loss {v:.4}")).unwrap_or_default();
        eprintln!(
            "done: step {}, loss {:.4}{val}, {:.0} tokens/s",
            m.step, m.loss, m.tokens_per_s
        );
    }
    Ok(())
}

/// `ringtrain bench step`: warm-up steps, then timed steps; ms/step, tokens/s and model GFLOP/s.
pub fn run_bench_step(mut args: TrainArgs, warmup: u64) -> Result<()> {
    let timed = args.steps.unwrap_or(10).max(1);
    args.steps = Some(timed + warmup);
    args.eval_every = Some(0);
    args.save = None;
    let s = setup(args)?;
    match s.backend {
        BackendKind::Cpu => bench_loop(CpuBackend::<f32>::new(), s, warmup, timed),
    }
}

fn bench_loop<B: Backend>(be: B, s: RunSetup, warmup: u64, timed: u64) -> Result<()> {
    let mut trainer = Trainer::new(be, s.source, s.data, s.opts)?;
    for _ in 0..warmup {
        trainer.train_step()?;
    }
    let started = std::time::Instant::now();
    for _ in 0..timed {
        trainer.train_step()?;
    }
    let secs = started.elapsed().as_secs_f64();
    let tokens = trainer.tokens_per_step() as f64 * timed as f64;
    // Forward + backward = 3x the forward FLOPs.
    let flops = 3.0 * trainer.model.flops_per_token(trainer.opts.seq_len) * tokens;
    let line = serde_json::json!({
        "impl": "ringtrain",
        "backend": trainer.be.name(),
        "params": trainer.model.layout.total,
        "batch": trainer.opts.batch_size * trainer.opts.grad_accum,
        "seq": trainer.opts.seq_len,
        "steps": timed,
        "ms_per_step": secs * 1e3 / timed as f64,
        "tokens_per_s": tokens / secs,
        "gflops": flops / secs / 1e9,
    });
    println!("{line}");
    Ok(())
}
