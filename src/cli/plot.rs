//! `ringtrain plot`: loss and throughput curves from a metrics file, as a PNG.
//!
//! Two panels, one above the other: training loss against step (with validation loss as points where the
//! file has it), and tokens/s against step. Non-finite values are left out. When a resumed run repeated
//! steps, the latest record of each step wins.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;

use ringtrain::metrics::{read_metrics, StepMetrics};

/// Width of the image in pixels.
pub const PLOT_WIDTH: u32 = 1200;
/// Height of the image in pixels.
pub const PLOT_HEIGHT: u32 = 800;

const FONT: &str = "sans-serif";
const LOSS_COLOR: RGBColor = RGBColor(31, 119, 180);
const VAL_COLOR: RGBColor = RGBColor(214, 39, 40);
const TPS_COLOR: RGBColor = RGBColor(44, 160, 44);
/// Below this many points, each point is also drawn as a marker (a single point has no line).
const MARKER_LIMIT: usize = 100;

/// Reads a metrics file (JSON Lines, see [`super::metrics`]) and plots it to `out`.
pub fn plot_file(jsonl: &Path, out: &Path) -> Result<()> {
    check_png_path(out)?;
    let metrics = read_metrics(jsonl)?;
    if metrics.is_empty() {
        bail!("{}: no metrics records to plot", jsonl.display());
    }
    plot_metrics(&metrics, out).with_context(|| format!("plotting {}", jsonl.display()))
}

/// Draws the loss and throughput panels for `metrics` into the PNG file `out` ([`PLOT_WIDTH`] x
/// [`PLOT_HEIGHT`]), creating its parent directories.
pub fn plot_metrics(metrics: &[StepMetrics], out: &Path) -> Result<()> {
    check_png_path(out)?;
    if metrics.is_empty() {
        bail!("no metrics records to plot");
    }

    // Latest record per step, in step order.
    let by_step: BTreeMap<u64, &StepMetrics> = metrics.iter().map(|m| (m.step, m)).collect();
    let loss: Vec<(u64, f64)> = by_step
        .values()
        .filter(|m| m.loss.is_finite())
        .map(|m| (m.step, m.loss))
        .collect();
    let val: Vec<(u64, f64)> = by_step
        .values()
        .filter_map(|m| m.val_loss.filter(|v| v.is_finite()).map(|v| (m.step, v)))
        .collect();
    let tps: Vec<(u64, f64)> = by_step
        .values()
        .filter(|m| m.tokens_per_s.is_finite())
        .map(|m| (m.step, m.tokens_per_s))
        .collect();
    let non_finite = by_step.len() - loss.len();
    let skipped = by_step.values().filter(|m| m.skipped).count();

    let first = *by_step.keys().next().expect("not empty");
    let last = *by_step.keys().next_back().expect("not empty");
    let steps = if first == last {
        first.saturating_sub(1)..last + 1
    } else {
        first..last
    };

    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating directory {}", parent.display()))?;
    }

    let root = BitMapBackend::new(out, (PLOT_WIDTH, PLOT_HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let latest = by_step.values().next_back().expect("not empty");
    let title = format!(
        "ringtrain training metrics: {} step{}, world size {}, {} update",
        by_step.len(),
        if by_step.len() == 1 { "" } else { "s" },
        latest.world_size,
        if latest.update.is_empty() {
            "unknown"
        } else {
            &latest.update
        }
    );
    let root = root.titled(&title, (FONT, 28)).map_err(draw_err)?;
    let panels = root.split_evenly((2, 1));

    // Loss panel.
    let mut notes = Vec::new();
    if non_finite > 0 {
        notes.push(format!("{non_finite} non-finite not shown"));
    }
    if skipped > 0 {
        notes.push(format!("{skipped} skipped"));
    }
    let caption = if notes.is_empty() {
        "Loss".to_string()
    } else {
        format!("Loss ({})", notes.join(", "))
    };
    let loss_values = loss.iter().chain(val.iter()).map(|&(_, v)| v);
    let loss_range = padded_range(loss_values).unwrap_or(0.0..1.0);
    let mut chart = ChartBuilder::on(&panels[0])
        .caption(caption, (FONT, 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(steps.clone(), loss_range.clone())
        .map_err(draw_err)?;
    let decimals = label_decimals(&loss_range);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .y_label_formatter(&|v| format!("{v:.decimals$}"))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 18))
        .draw()
        .map_err(draw_err)?;
    if loss.is_empty() {
        let (w, h) = panels[0].dim_in_pixel();
        panels[0]
            .draw(&Text::new(
                "no finite loss values",
                (w as i32 / 2 - 90, h as i32 / 2),
                (FONT, 20),
            ))
            .map_err(draw_err)?;
    } else {
        chart
            .draw_series(LineSeries::new(loss.iter().copied(), LOSS_COLOR.stroke_width(2)))
            .map_err(draw_err)?
            .label("train loss")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], LOSS_COLOR.stroke_width(2)));
        if loss.len() <= MARKER_LIMIT {
            chart
                .draw_series(loss.iter().map(|&p| Circle::new(p, 3, LOSS_COLOR.filled())))
                .map_err(draw_err)?;
        }
    }
    if !val.is_empty() {
        chart
            .draw_series(val.iter().map(|&p| Circle::new(p, 5, VAL_COLOR.filled())))
            .map_err(draw_err)?
            .label("val loss")
            .legend(|(x, y)| Circle::new((x + 10, y), 5, VAL_COLOR.filled()));
    }
    if !loss.is_empty() || !val.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 16))
            .draw()
            .map_err(draw_err)?;
    }

    // Throughput panel.
    let tps_range = padded_range(tps.iter().map(|&(_, v)| v)).unwrap_or(0.0..1.0);
    let mut chart = ChartBuilder::on(&panels[1])
        .caption("Throughput", (FONT, 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(steps, tps_range.clone())
        .map_err(draw_err)?;
    let decimals = label_decimals(&tps_range);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("tokens/s")
        .y_label_formatter(&|v| format!("{v:.decimals$}"))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 18))
        .draw()
        .map_err(draw_err)?;
    chart
        .draw_series(LineSeries::new(tps.iter().copied(), TPS_COLOR.stroke_width(2)))
        .map_err(draw_err)?;
    if tps.len() <= MARKER_LIMIT {
        chart
            .draw_series(tps.iter().map(|&p| Circle::new(p, 3, TPS_COLOR.filled())))
            .map_err(draw_err)?;
    }

    root.present()
        .map_err(draw_err)
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

fn check_png_path(out: &Path) -> Result<()> {
    match out.extension().and_then(|e| e.to_str()) {
        Some(ext) if ext.eq_ignore_ascii_case("png") => Ok(()),
        _ => bail!("plot output {} must be a .png file", out.display()),
    }
}

/// plotters' errors borrow the backend's error type; turn them into plain messages.
fn draw_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing plot: {e}")
}

/// The range of the finite `values`, widened by 5% on each side (or by a small amount when all are
/// equal). `None` when there are no finite values.
fn padded_range(values: impl Iterator<Item = f64>) -> Option<Range<f64>> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold(None, |acc: Option<(f64, f64)>, v| {
            Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
        })?;
    let span = hi - lo;
    let pad = if span > 0.0 {
        span * 0.05
    } else {
        (lo.abs() * 0.05).max(1e-3)
    };
    Some(lo - pad..hi + pad)
}

/// Enough decimals on the y labels to tell ticks apart over `range`.
fn label_decimals(range: &Range<f64>) -> usize {
    let span = range.end - range.start;
    if span.is_nan() || span <= 0.0 {
        return 2;
    }
    (2 - span.log10().floor() as i64).clamp(0, 6) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringtrain::metrics::MetricsWriter;
    use std::io::Write;

    #[test]
    fn ranges() {
        assert_eq!(padded_range([f64::NAN, f64::INFINITY].into_iter()), None);
        let r = padded_range([1.0, 3.0, f64::NAN].into_iter()).unwrap();
        assert!((r.start - 0.9).abs() < 1e-12 && (r.end - 3.1).abs() < 1e-12);
        let r = padded_range([2.0].into_iter()).unwrap();
        assert!(r.start < 2.0 && r.end > 2.0);
        let r = padded_range([0.0].into_iter()).unwrap();
        assert!(r.start < 0.0 && r.end > 0.0);
    }

    #[test]
    fn decimals() {
        assert_eq!(label_decimals(&(0.0..20_000.0)), 0);
        assert_eq!(label_decimals(&(2.0..3.0)), 2);
        assert_eq!(label_decimals(&(2.0..2.02)), 4);
        assert_eq!(label_decimals(&(1.0..1.0)), 2);
    }

    #[test]
    fn png_extension_required() {
        assert!(check_png_path(Path::new("a/loss.png")).is_ok());
        assert!(check_png_path(Path::new("loss.PNG")).is_ok());
        assert!(check_png_path(Path::new("loss.svg")).is_err());
        assert!(check_png_path(Path::new("loss")).is_err());
    }

    // Metrics files written and read back through ringtrain::metrics, then plotted.

    const PNG_MAGIC: [u8; 8] = [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n'];

    fn step(step: u64) -> StepMetrics {
        let s = step as f64;
        StepMetrics {
            step,
            loss: 4.0 * (-s / 60.0).exp() + 1.5 + 0.05 * (s * 0.7).sin(),
            lr: 3e-4 * (s / 10.0).min(1.0),
            grad_norm: 1.0 / (1.0 + s / 50.0),
            tokens: step * 2 * 8 * 64,
            tokens_per_s: 20_000.0 + 1_500.0 * (s * 0.3).cos() - if step == 1 { 15_000.0 } else { 0.0 },
            step_ms: 12.5,
            comm_ms: 1.25,
            exposed_comm_ms: 0.0,
            world_size: 2,
            rank: 0,
            update: "sharded".to_string(),
            param_hash: (step % 50 == 0).then(|| format!("{step:016x}")),
            val_loss: (step % 25 == 0).then(|| 4.0 * (-s / 60.0).exp() + 1.6),
            skipped: false,
            loss_spike_reference: None,
            batch_shares: None,
            membership: None,
            outer: None,
            sent_bytes: 0,
        }
    }

    fn write_synthetic(path: &Path, n: u64) -> Vec<StepMetrics> {
        let mut w = MetricsWriter::open(path, false).unwrap();
        let all: Vec<StepMetrics> = (1..=n).map(step).collect();
        for m in &all {
            w.write(m).unwrap();
        }
        all
    }

    /// Width and height from the IHDR chunk, after checking the signature and chunk type.
    fn png_dimensions(path: &Path) -> (u32, u32) {
        let bytes = std::fs::read(path).unwrap();
        assert!(bytes.len() > 24, "PNG too short: {} bytes", bytes.len());
        assert_eq!(bytes[..8], PNG_MAGIC, "not a PNG");
        assert_eq!(&bytes[12..16], b"IHDR", "first chunk is not IHDR");
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        (w, h)
    }

    fn append_raw(path: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn plots_a_synthetic_run() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("run/metrics.jsonl");
        let written = write_synthetic(&jsonl, 200);
        assert_eq!(read_metrics(&jsonl).unwrap().len(), written.len());

        let png = dir.path().join("plots/loss.png");
        plot_file(&jsonl, &png).unwrap();
        assert!(png.exists());
        assert_eq!(png_dimensions(&png), (PLOT_WIDTH, PLOT_HEIGHT));
        assert_eq!((PLOT_WIDTH, PLOT_HEIGHT), (1200, 800));

        if let Ok(keep) = std::env::var("RINGTRAIN_KEEP_PLOT") {
            std::fs::copy(&png, keep).unwrap();
        }
    }

    #[test]
    fn plots_one_point_and_non_finite_values() {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("one.png");
        plot_metrics(&[step(7)], &png).unwrap();
        assert_eq!(png_dimensions(&png), (PLOT_WIDTH, PLOT_HEIGHT));

        let mut ms: Vec<StepMetrics> = (1..=30).map(step).collect();
        ms[3].loss = f64::NAN;
        ms[3].skipped = true;
        ms[9].loss = f64::INFINITY;
        ms[9].skipped = true;
        ms[12].tokens_per_s = f64::NAN;
        ms[24].val_loss = Some(f64::NAN);
        // Through the file too: NaN is written as null and read back as NaN.
        let jsonl = dir.path().join("nan.jsonl");
        let mut w = MetricsWriter::open(&jsonl, false).unwrap();
        for m in &ms {
            w.write(m).unwrap();
        }
        let back = read_metrics(&jsonl).unwrap();
        assert!(back[3].loss.is_nan() && back[3].skipped);
        let png = dir.path().join("nan.png");
        plot_file(&jsonl, &png).unwrap();
        assert_eq!(png_dimensions(&png), (PLOT_WIDTH, PLOT_HEIGHT));

        // Every loss non-finite still gives a picture (throughput is there).
        let all_nan: Vec<StepMetrics> = (1..=5)
            .map(|s| StepMetrics {
                loss: f64::NAN,
                ..step(s)
            })
            .collect();
        let png = dir.path().join("all_nan.png");
        plot_metrics(&all_nan, &png).unwrap();
        assert_eq!(png_dimensions(&png), (PLOT_WIDTH, PLOT_HEIGHT));
    }

    #[test]
    fn resumed_run_with_repeated_steps_plots() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("m.jsonl");
        write_synthetic(&jsonl, 40);
        // Resume from a checkpoint at step 30: steps 31..=40 appear twice; the plot keeps the latest of each.
        let mut w = MetricsWriter::open(&jsonl, true).unwrap();
        for s in 31..=60 {
            w.write(&step(s)).unwrap();
        }
        drop(w);
        assert_eq!(read_metrics(&jsonl).unwrap().len(), 70);
        let png = dir.path().join("resumed.png");
        plot_file(&jsonl, &png).unwrap();
        assert_eq!(png_dimensions(&png), (PLOT_WIDTH, PLOT_HEIGHT));

        // Crash mid-line, then resume again: the torn record is now in the middle, an error naming line 71.
        append_raw(&jsonl, "{\"step\":61,\"loss\":1.");
        let mut w = MetricsWriter::open(&jsonl, true).unwrap();
        w.write(&step(51)).unwrap();
        drop(w);
        let err = format!("{:#}", read_metrics(&jsonl).unwrap_err());
        assert!(err.contains("line 71"), "{err}");
    }

    #[test]
    fn torn_last_line_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("m.jsonl");
        write_synthetic(&jsonl, 10);
        append_raw(&jsonl, "{\"step\":11,\"loss\":2.3,\"lr\":0.0");
        let got = read_metrics(&jsonl).unwrap();
        assert_eq!(got.len(), 10);
        assert_eq!(got.last().unwrap().step, 10);
        plot_file(&jsonl, &dir.path().join("torn.png")).unwrap();

        // Trailing blank lines after the torn line do not make it a middle line.
        append_raw(&jsonl, "\n\n");
        assert_eq!(read_metrics(&jsonl).unwrap().len(), 10);

        // Appending after a torn line starts a new line, and the reader then names the torn one.
        let mut w = MetricsWriter::open(&jsonl, true).unwrap();
        w.write(&step(11)).unwrap();
        drop(w);
        let err = format!("{:#}", read_metrics(&jsonl).unwrap_err());
        assert!(err.contains("line 11"), "{err}");
    }

    #[test]
    fn bad_middle_line_names_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("m.jsonl");
        let lines: Vec<String> = (1..=5).map(|s| serde_json::to_string(&step(s)).unwrap()).collect();
        let text = format!(
            "{}\n{}\nnot json at all\n{}\n{}\n{}\n",
            lines[0], lines[1], lines[2], lines[3], lines[4]
        );
        std::fs::write(&jsonl, text).unwrap();
        let err = format!("{:#}", read_metrics(&jsonl).unwrap_err());
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("m.jsonl"), "{err}");
        let err = format!("{:#}", plot_file(&jsonl, &dir.path().join("x.png")).unwrap_err());
        assert!(err.contains("line 3"), "{err}");

        // Valid JSON of the wrong shape is also an error with its line.
        let text = format!("{}\n{{\"step\":\"two\"}}\n{}\n", lines[0], lines[2]);
        std::fs::write(&jsonl, text).unwrap();
        let err = format!("{:#}", read_metrics(&jsonl).unwrap_err());
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn empty_input_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("empty.jsonl");
        std::fs::write(&jsonl, "").unwrap();
        let png = dir.path().join("empty.png");
        let err = format!("{:#}", plot_file(&jsonl, &png).unwrap_err());
        assert!(err.contains("no metrics"), "{err}");
        assert!(!png.exists());
        let err = format!("{:#}", plot_metrics(&[], &png).unwrap_err());
        assert!(err.contains("no metrics"), "{err}");

        // Only a torn line: nothing to plot either.
        std::fs::write(&jsonl, "{\"step\":1,").unwrap();
        assert!(read_metrics(&jsonl).unwrap().is_empty());
        assert!(plot_file(&jsonl, &png).is_err());

        // A missing file names the path.
        let missing = dir.path().join("missing.jsonl");
        let err = format!("{:#}", plot_file(&missing, &png).unwrap_err());
        assert!(err.contains("missing.jsonl"), "{err}");
    }

    #[test]
    fn output_must_be_png() {
        let dir = tempfile::tempdir().unwrap();
        let jsonl = dir.path().join("m.jsonl");
        write_synthetic(&jsonl, 5);
        for name in ["loss.svg", "loss.jpg", "loss"] {
            let out = dir.path().join(name);
            let err = format!("{:#}", plot_file(&jsonl, &out).unwrap_err());
            assert!(err.contains(".png"), "{err}");
            assert!(!out.exists());
        }
    }
}
