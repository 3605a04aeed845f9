//! Metrics file round trip and `ringtrain plot` output.

use std::io::Write;
use std::path::Path;

use ringtrain::cli::plot::{plot_file, plot_metrics, PLOT_HEIGHT, PLOT_WIDTH};
use ringtrain::cli::progress::{format_step_line, should_log};
use ringtrain::metrics::{read_metrics, MetricsWriter, StepMetrics};

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
        world_size: 2,
        update: "sharded".to_string(),
        param_hash: (step % 50 == 0).then(|| format!("{step:016x}")),
        val_loss: (step % 25 == 0).then(|| 4.0 * (-s / 60.0).exp() + 1.6),
        skipped: false,
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
        world_size: 4,
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
