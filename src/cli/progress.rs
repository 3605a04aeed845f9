//! Training progress on stderr.
//!
//! On a terminal: an indicatif bar with step/total, loss, tokens/s and ETA. Off a terminal (a log file, CI):
//! plain lines, one for the first step, then one every `max(1, total / 20)` steps, and one for the last step:
//!
//! ```text
//! step 20/200 | loss 2.3412 | lr 3.00e-04 | norm 0.812 | 12.3 ms | 20800 tok/s
//! ```
//!
//! The line format and the choice of which steps to log are pure functions ([`format_step_line`],
//! [`should_log`]) so they can be tested without a terminal.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use ringtrain::metrics::StepMetrics;

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// An indicatif bar on stderr.
    Bar,
    /// Plain log lines on stderr, every [`log_interval`] steps.
    Lines,
    /// Nothing at all (e.g. ranks other than 0).
    Hidden,
}

impl ProgressMode {
    /// [`ProgressMode::Bar`] when stderr is a terminal, else [`ProgressMode::Lines`].
    pub fn detect() -> Self {
        if std::io::stderr().is_terminal() {
            Self::Bar
        } else {
            Self::Lines
        }
    }
}

/// Shows training progress on stderr; see the module documentation.
#[derive(Debug)]
pub struct Progress {
    mode: ProgressMode,
    bar: Option<ProgressBar>,
    total_steps: u64,
    first_step: u64,
}

impl Progress {
    /// Progress for a run that ends at step `total_steps` and resumes after `start_step` (0 for a fresh run).
    /// A bar on a terminal, plain lines otherwise.
    pub fn new(total_steps: u64, start_step: u64) -> Self {
        Self::with_mode(total_steps, start_step, ProgressMode::detect())
    }

    /// Progress that shows nothing: for ranks other than 0.
    pub fn hidden() -> Self {
        Self::with_mode(0, 0, ProgressMode::Hidden)
    }

    /// Progress in the given mode, whatever stderr is.
    pub fn with_mode(total_steps: u64, start_step: u64, mode: ProgressMode) -> Self {
        let bar = (mode == ProgressMode::Bar).then(|| {
            let bar = ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} | {msg} | ETA {eta_precise}",
            )
            .expect("valid progress template")
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_message("starting");
            bar.set_position(start_step.min(total_steps));
            // Record the starting position, then restart the rate estimate, so a resumed run's ETA is not
            // computed as if all the earlier steps had been done in no time.
            bar.tick();
            bar.reset_eta();
            bar.enable_steady_tick(Duration::from_millis(500));
            bar
        });
        Self {
            mode,
            bar,
            total_steps,
            first_step: start_step + 1,
        }
    }

    /// Reports a finished step.
    pub fn update(&mut self, m: &StepMetrics) {
        match self.mode {
            ProgressMode::Bar => {
                if let Some(bar) = &self.bar {
                    bar.set_message(format_bar_message(m));
                    bar.set_position(m.step.min(self.total_steps));
                }
            }
            ProgressMode::Lines => {
                if should_log(m.step, self.first_step, self.total_steps) {
                    eprintln!("{}", format_step_line(m, self.total_steps));
                }
            }
            ProgressMode::Hidden => {}
        }
    }

    /// Prints a log line (evaluation results, checkpoint saved, ...) without breaking the bar.
    pub fn message(&self, msg: &str) {
        match (&self.mode, &self.bar) {
            (ProgressMode::Bar, Some(bar)) => bar.println(msg),
            (ProgressMode::Hidden, _) => {}
            _ => eprintln!("{msg}"),
        }
    }

    /// Prints a line even when the progress itself is hidden: what each rank decided on its own, which
    /// every rank must say.
    pub fn warn(&self, msg: &str) {
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => eprint_line(msg),
        }
    }

    /// Ends the bar, leaving its last state on screen.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An error path that never called `finish` must not leave the steady tick drawing over later output.
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
    }
}

/// Writes `msg` and its newline to stderr in one write, so that the ranks of a job sharing one stderr
/// (`ringtrain launch`) cannot interleave inside the line (`eprintln!` writes the pieces separately).
pub fn eprint_line(msg: &str) {
    let line = format!("{msg}\n");
    // Nothing useful is left to do when stderr itself is gone.
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Steps between two log lines off a terminal: `max(1, total_steps / 20)`.
pub fn log_interval(total_steps: u64) -> u64 {
    (total_steps / 20).max(1)
}

/// Whether the plain-line mode logs `step`: the first step of the run (`first_step`, 1 unless resumed), every
/// [`log_interval`]-th step, and the last step.
pub fn should_log(step: u64, first_step: u64, total_steps: u64) -> bool {
    step == first_step || step == total_steps || step % log_interval(total_steps) == 0
}

/// One plain progress line, e.g.
/// `step 20/200 | loss 2.3412 | lr 3.00e-04 | norm 0.812 | 12.3 ms | 20800 tok/s`.
/// Evaluation steps add `| val 2.1000`; skipped (non-finite) steps add `| skipped`; with `--sync outer` the
/// loss is this rank's own, and outer steps add the round's mean over the ranks, `| outer loss 2.2000`.
pub fn format_step_line(m: &StepMetrics, total_steps: u64) -> String {
    let mut line = format!(
        "step {}/{} | loss {:.4} | lr {} | norm {:.3} | {:.1} ms | {:.0} tok/s",
        m.step,
        total_steps,
        m.loss,
        format_sci(m.lr, 2),
        m.grad_norm,
        m.step_ms,
        m.tokens_per_s
    );
    if let Some(v) = m.val_loss {
        line.push_str(&format!(" | val {v:.4}"));
    }
    if let Some(round) = m.outer {
        line.push_str(&format!(" | outer loss {:.4}", round.loss));
    }
    if m.skipped {
        line.push_str(" | skipped");
    }
    line
}

/// A skipped step, as every rank reports it: `rank 1: step 3: non-finite loss (2.1) or gradient norm (NaN),
/// update skipped (--on-nonfinite skip)`; no rank prefix for a single process.
pub fn format_skip_line(m: &StepMetrics, rank: usize) -> String {
    let who = if m.world_size > 1 {
        format!("rank {rank}: ")
    } else {
        String::new()
    };
    format!(
        "{who}step {}: non-finite loss ({}) or gradient norm ({}), update skipped (--on-nonfinite skip)",
        m.step, m.loss, m.grad_norm
    )
}

/// The `--loss-spike` warning, or `None` when the step was not a spike: `warning: step 7: loss spike:
/// loss 9.1000 is 3.5x its running average 2.6000 (--loss-spike 3)`.
pub fn format_spike_line(m: &StepMetrics, factor: f64) -> Option<String> {
    let reference = m.loss_spike_reference?;
    Some(format!(
        "warning: step {}: loss spike: loss {:.4} is {:.1}x its running average {reference:.4} (--loss-spike {factor})",
        m.step,
        m.loss,
        m.loss / reference
    ))
}

/// The bar's message: `loss 2.3412 | 20800 tok/s`.
pub fn format_bar_message(m: &StepMetrics) -> String {
    let mut msg = format!("loss {:.4} | {:.0} tok/s", m.loss, m.tokens_per_s);
    if m.skipped {
        msg.push_str(" | skipped");
    }
    msg
}

/// Scientific notation with a signed, at least two-digit exponent, like C's `%.2e`: `3.00e-04`, `1.50e+01`.
pub fn format_sci(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    // Rust's `{:e}` gives `3.00e-4`; rewrite the exponent.
    let s = format!("{x:.decimals$e}");
    let (mantissa, exp) = s.split_once('e').expect("`{:e}` output has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(step: u64) -> StepMetrics {
        StepMetrics {
            step,
            loss: 2.34123,
            lr: 3e-4,
            grad_norm: 0.8124,
            tokens: step * 1040,
            tokens_per_s: 20_800.2,
            step_ms: 12.34,
            comm_ms: 0.0,
            exposed_comm_ms: 0.0,
            world_size: 1,
            rank: 0,
            update: "replicated".into(),
            ..Default::default()
        }
    }

    #[test]
    fn line_matches_the_documented_format() {
        assert_eq!(
            format_step_line(&m(20), 200),
            "step 20/200 | loss 2.3412 | lr 3.00e-04 | norm 0.812 | 12.3 ms | 20800 tok/s"
        );
    }

    #[test]
    fn line_marks_eval_and_skipped_steps() {
        let mut s = m(5);
        s.val_loss = Some(2.1);
        s.skipped = true;
        s.loss = f64::NAN;
        assert_eq!(
            format_step_line(&s, 10),
            "step 5/10 | loss NaN | lr 3.00e-04 | norm 0.812 | 12.3 ms | 20800 tok/s | val 2.1000 | skipped"
        );
    }

    #[test]
    fn an_outer_step_shows_the_round_s_loss() {
        let mut s = m(10);
        s.outer = Some(ringtrain::trainer::outer_sync::OuterRound {
            loss: 2.2,
            delta_norm: 0.5,
            inner_steps: 10,
        });
        assert!(format_step_line(&s, 20).ends_with("20800 tok/s | outer loss 2.2000"));
    }

    #[test]
    fn skip_and_spike_lines_name_the_step() {
        let mut s = m(3);
        s.grad_norm = f64::NAN;
        s.skipped = true;
        assert_eq!(
            format_skip_line(&s, 0),
            "step 3: non-finite loss (2.34123) or gradient norm (NaN), update skipped (--on-nonfinite skip)"
        );
        s.world_size = 3;
        assert!(format_skip_line(&s, 2).starts_with("rank 2: step 3: "));
        assert_eq!(format_spike_line(&s, 3.0), None);
        s.loss = 9.1;
        s.loss_spike_reference = Some(2.6);
        assert_eq!(
            format_spike_line(&s, 3.0).unwrap(),
            "warning: step 3: loss spike: loss 9.1000 is 3.5x its running average 2.6000 (--loss-spike 3)"
        );
    }

    #[test]
    fn sci_notation() {
        assert_eq!(format_sci(3e-4, 2), "3.00e-04");
        assert_eq!(format_sci(6e-5, 2), "6.00e-05");
        assert_eq!(format_sci(15.0, 2), "1.50e+01");
        assert_eq!(format_sci(0.0, 2), "0.00e+00");
        assert_eq!(format_sci(-2.5e-12, 1), "-2.5e-12");
        assert_eq!(format_sci(1e100, 2), "1.00e+100");
        assert_eq!(format_sci(f64::INFINITY, 2), "inf");
    }

    #[test]
    fn logged_steps() {
        let logged: Vec<u64> = (1..=200).filter(|&s| should_log(s, 1, 200)).collect();
        let mut want = vec![1];
        want.extend((10..=200).step_by(10));
        assert_eq!(logged, want);

        // Fewer than 20 steps: every step.
        assert!((1..=7).all(|s| should_log(s, 1, 7)));

        // Total not a multiple of the interval: the last step is still logged.
        let logged: Vec<u64> = (1..=45).filter(|&s| should_log(s, 1, 45)).collect();
        assert_eq!(
            logged,
            vec![1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 45]
        );

        // Resumed at step 103: the first step of this run is logged.
        let logged: Vec<u64> = (104..=200).filter(|&s| should_log(s, 104, 200)).collect();
        assert_eq!(&logged[..3], &[104, 110, 120]);
    }

    #[test]
    fn modes_do_not_panic() {
        for mode in [ProgressMode::Lines, ProgressMode::Hidden, ProgressMode::Bar] {
            let mut p = Progress::with_mode(3, 1, mode);
            p.update(&m(2));
            p.message("checkpoint saved");
            p.update(&m(3));
            p.finish();
        }
        let mut p = Progress::hidden();
        p.update(&m(1));
        p.finish();
    }

    #[test]
    fn progress_line_format() {
        let m = StepMetrics {
            step: 20,
            loss: 2.34123,
            lr: 3e-4,
            grad_norm: 0.81234,
            tokens: 20 * 1040,
            tokens_per_s: 20_800.4,
            step_ms: 12.31,
            comm_ms: 2.0,
            exposed_comm_ms: 0.0,
            world_size: 4,
            rank: 0,
            update: "sharded".into(),
            ..Default::default()
        };
        assert_eq!(
            format_step_line(&m, 200),
            "step 20/200 | loss 2.3412 | lr 3.00e-04 | norm 0.812 | 12.3 ms | 20800 tok/s"
        );
        let logged: Vec<u64> = (1..=200).filter(|&s| should_log(s, 1, 200)).collect();
        assert_eq!(logged.len(), 21);
        assert_eq!((logged[0], logged[1], logged[20]), (1, 10, 200));
    }
}
