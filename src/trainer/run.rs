//! The run loop: steps until `--steps`, evaluating and saving at the options' cadence, and telling an
//! observer after each step. The command line, the sim and the tests all run through it.

use super::Trainer;
use crate::backend::Backend;
use crate::fault_plan::Fault;
use crate::metrics::StepMetrics;
use crate::model::checkpoint::check_save_target;
use anyhow::{Context, Result};
use std::path::Path;

/// What a caller of [`Trainer::run`] sees of the run: progress, metrics files, per-step checks.
pub trait RunObserver<B: Backend> {
    /// Before the first step.
    fn started(&mut self, _trainer: &Trainer<B>) -> Result<()> {
        Ok(())
    }

    /// After each step and, when one was due, its evaluation (`m.val_loss`). An error stops the run.
    fn step(&mut self, trainer: &mut Trainer<B>, m: &StepMetrics) -> Result<()>;

    /// After a checkpoint of step `step` was written to `dir` (by rank 0; every rank is told).
    fn saved(&mut self, _step: u64, _dir: &Path) {}

    /// After an injected fault changed this rank's state (a `flip`, after the step's [`RunObserver::step`]).
    fn state_corrupted(&mut self, _trainer: &mut Trainer<B>, _fault: &Fault) -> Result<()> {
        Ok(())
    }
}

/// An observer that does nothing: [`Trainer::run`] for its own sake (tests, the sim's reference run).
pub struct Quiet;

impl<B: Backend> RunObserver<B> for Quiet {
    fn step(&mut self, _trainer: &mut Trainer<B>, _m: &StepMetrics) -> Result<()> {
        Ok(())
    }
}

/// The run's checkpoints so far. A save that fails stops the run (after every rank hears why): the save is
/// atomic, so the checkpoint before it stays whole, and the error says which step that is.
#[derive(Default)]
struct Saves {
    /// The step of the last checkpoint this run saved.
    last: Option<u64>,
}

impl Saves {
    fn save<B: Backend>(&mut self, trainer: &mut Trainer<B>, dir: &Path) -> Result<()> {
        let step = trainer.step;
        if let Err(e) = trainer.save(dir) {
            let kept = match self.last {
                Some(last) => format!("the checkpoint of step {last} there is whole"),
                None => "whatever checkpoint was there before the run is left as it was".to_string(),
            };
            return Err(e.context(format!(
                "step {step}: saving the checkpoint to {} failed, so the run stops; {kept} \
                 (continue with --resume {0})",
                dir.display()
            )));
        }
        self.last = Some(step);
        Ok(())
    }
}

impl<B: Backend> Trainer<B> {
    /// Trains until `--steps`: evaluates every `eval_every` steps and at the end (when `eval_batches` is not
    /// 0), saves every `save_every` steps and at the end (when `save` is set), and tells `observer` after
    /// each step. Before the first step, rank 0 checks that it can write the checkpoints. On any error the
    /// other ranks are told why ([`Trainer::abort`]) before it is returned. Returns the last step's metrics
    /// (none when the run was already at its last step).
    pub fn run(&mut self, observer: &mut dyn RunObserver<B>) -> Result<Option<StepMetrics>> {
        let result = self.run_steps(observer);
        if let Err(e) = &result {
            self.abort(&format!("{e:#}"));
        }
        result
    }

    fn run_steps(&mut self, observer: &mut dyn RunObserver<B>) -> Result<Option<StepMetrics>> {
        let save = self.opts.save.clone();
        // Rank 0 writes the checkpoints: find out now, not after the run, when the path cannot take one.
        if let (Some(dir), 0) = (&save, self.rank) {
            check_save_target(dir).with_context(|| {
                format!(
                    "--save {}: the run's checkpoints could not be written there, so it was not started",
                    dir.display()
                )
            })?;
        }
        observer.started(self)?;
        let mut saves = Saves::default();
        let mut last = None;
        while self.step < self.opts.steps {
            let mut m = self.train_step()?;
            let at_end = self.step == self.opts.steps;
            if self.eval_due(at_end) {
                m.val_loss = self.evaluate()?;
            }
            observer.step(self, &m)?;
            if let Some((target, element)) = self.faults.flip_after(self.rank, m.step) {
                self.apply_flip(target, element).context("fault flip")?;
                let fault = Fault::Flip {
                    rank: self.rank,
                    step: m.step,
                    target,
                    element,
                };
                observer.state_corrupted(self, &fault)?;
            }
            let every = self.opts.save_every;
            if let (Some(dir), false) = (&save, at_end) {
                if every > 0 && self.step % every == 0 {
                    saves.save(self, dir)?;
                    observer.saved(self.step, dir);
                }
            }
            last = Some(m);
        }
        if let Some(dir) = &save {
            saves.save(self, dir)?;
            observer.saved(self.step, dir);
        }
        Ok(last)
    }

    /// Whether the step just finished is evaluated: every `eval_every` steps and the last one, unless the
    /// run evaluates nothing (`eval_batches` 0).
    fn eval_due(&self, at_end: bool) -> bool {
        let every = self.opts.eval_every;
        self.opts.eval_batches > 0 && ((every > 0 && self.step % every == 0) || at_end)
    }
}
