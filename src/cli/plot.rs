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

use crate::metrics::{read_metrics, StepMetrics};

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
}
