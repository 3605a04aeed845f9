//! Per-step training metrics: the record the trainer returns for every optimizer step ([`StepMetrics`]), and
//! its file, one JSON object per line (JSON Lines).
//!
//! Rank 0 of a run writes the file through [`MetricsWriter`]; `ringtrain plot` and the tests read it back
//! with [`read_metrics`]. Every line is flushed as soon as it is written, so a crash loses at most the line being
//! written, and the reader ignores such a torn last line.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// The metrics of one optimizer step, as written to the metrics file.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct StepMetrics {
    /// Optimizer step, counted from 1.
    pub step: u64,
    /// Training loss of this step (mean over the global batch).
    #[serde(deserialize_with = "f64_or_nan")]
    pub loss: f64,
    /// Learning rate used for this step.
    #[serde(deserialize_with = "f64_or_nan")]
    pub lr: f64,
    /// Global gradient norm, before clipping.
    #[serde(deserialize_with = "f64_or_nan")]
    pub grad_norm: f64,
    /// Tokens processed so far, over all ranks (cumulative, global).
    pub tokens: u64,
    /// Global throughput of this step.
    #[serde(deserialize_with = "f64_or_nan")]
    pub tokens_per_s: f64,
    /// Wall time of this step in milliseconds.
    #[serde(deserialize_with = "f64_or_nan")]
    pub step_ms: f64,
    /// Time the communication thread spent in the collectives this step waited for (gradient buckets,
    /// scalars, the sharded parameter gather), in milliseconds, whether or not backward hid it.
    #[serde(deserialize_with = "f64_or_nan")]
    pub comm_ms: f64,
    /// The part of `comm_ms` during which the step's compute thread waited for those collectives, in
    /// milliseconds: never more than `comm_ms` (`trainer::comm_ledger`). Read-backs, uploads and the
    /// gradient norm around them count as the rank's own work. Files written before it existed read as 0.
    #[serde(default, deserialize_with = "f64_or_nan")]
    pub exposed_comm_ms: f64,
    /// Number of ranks.
    pub world_size: usize,
    /// The rank that wrote this record: `step_ms`, `comm_ms` and `exposed_comm_ms` are its own, the rest
    /// is the same on every rank. Files written before it existed read as 0.
    #[serde(default)]
    pub rank: usize,
    /// Update mode: `sharded` or `replicated`.
    pub update: String,
    /// Parameter hash, on verified steps only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_hash: Option<String>,
    /// Validation loss, on evaluation steps only. A non-finite value is written as `null` and reads back as
    /// `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// True when the step was skipped because the loss or gradients were not finite.
    #[serde(default)]
    pub skipped: bool,
    /// On a loss spike only (`--loss-spike`): the running average of the earlier losses that this step's
    /// loss exceeded by more than the factor. Absent otherwise, and in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_spike_reference: Option<f64>,
    /// Sequences of each rank's share of the global batch, when the shares are uneven: on a process's first
    /// step and whenever they change. Absent otherwise, and in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_shares: Option<Vec<usize>>,
    /// Elastic runs, on the first step a re-formed group completes: who was lost, the new members, the step
    /// the survivors continued from and the time to recover. Absent otherwise, and in files written before
    /// it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<crate::elastic::MembershipChange>,
    /// `--sync outer`, on a step that ends with an outer step: the mean inner loss over the ranks and the
    /// round, and the norm of the averaged change of the parameters. `loss` is then this rank's own inner
    /// loss, as on every step of such a run. Absent otherwise, and in files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer: Option<crate::trainer::outer_sync::OuterRound>,
    /// Bytes this rank sent to its ring neighbours between the end of the previous step and the end of this
    /// one (collective payloads and their frame headers): a sharded step's parameter gathers, which overlap
    /// the next forward, land in either. 0 in files written before it existed.
    #[serde(default)]
    pub sent_bytes: u64,
}

/// JSON has no NaN or infinity: serde_json writes a non-finite float as `null`. Read `null` back as NaN so a
/// step with a non-finite loss or norm (usually `skipped`) round-trips instead of making the file unreadable.
fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// The metrics file rank `rank` writes for `--metrics path`: rank 0 the path itself, rank r > 0 the path
/// with `.rank{r}` before its extension (`runs/m.jsonl` -> `runs/m.rank1.jsonl`; without an extension,
/// appended), so ranks that share a host or a filesystem never write one file, and a survivor's record
/// exists when rank 0 is gone.
pub fn rank_metrics_path(path: &Path, rank: usize) -> PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let named = match (path.extension(), path.file_stem()) {
        (Some(ext), Some(stem)) => format!("{}.rank{rank}.{}", stem.to_string_lossy(), ext.to_string_lossy()),
        _ => format!("{name}.rank{rank}"),
    };
    path.with_file_name(named)
}

/// Appends one JSON object per line to a metrics file, flushing after every line.
#[derive(Debug)]
pub struct MetricsWriter {
    file: File,
    path: PathBuf,
}

impl MetricsWriter {
    /// Opens `path` for writing, creating its parent directories. With `append` (used by `--resume`) the
    /// existing lines are kept and new ones go after them; otherwise the file is truncated.
    ///
    /// When appending to a file whose last line is torn (a crash mid-write), a newline is added first so the
    /// next record starts on a line of its own.
    pub fn open(path: impl AsRef<Path>, append: bool) -> Result<Self> {
        let path = path.as_ref();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating directory {} for metrics", parent.display()))?;
        }
        let mut options = OpenOptions::new();
        if append {
            options.create(true).append(true);
        } else {
            options.create(true).write(true).truncate(true);
        }
        let mut file = options
            .open(path)
            .with_context(|| format!("opening metrics file {}", path.display()))?;
        if append && !ends_with_newline_or_empty(path)? {
            file.write_all(b"\n")
                .with_context(|| format!("writing metrics file {}", path.display()))?;
            file.flush()?;
        }
        Ok(Self {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Writes one step as a single line and flushes it to the file.
    pub fn write(&mut self, metrics: &StepMetrics) -> Result<()> {
        let mut line = serde_json::to_vec(metrics).context("serializing step metrics")?;
        line.push(b'\n');
        // One write call per line: the line reaches the file whole or (on a crash) torn at its end only.
        self.file
            .write_all(&line)
            .with_context(|| format!("writing metrics file {}", self.path.display()))?;
        self.file
            .flush()
            .with_context(|| format!("flushing metrics file {}", self.path.display()))?;
        Ok(())
    }

    /// The path being written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn ends_with_newline_or_empty(path: &Path) -> Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path).with_context(|| format!("opening metrics file {}", path.display()))?;
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(true);
    }
    f.seek(SeekFrom::Start(len - 1))?;
    let mut last = [0u8; 1];
    f.read_exact(&mut last)?;
    Ok(last[0] == b'\n')
}

/// Before a fresh run writes `path`: moves an earlier run's records there (a non-empty file) to the first
/// free `path.1`, `path.2`, ... and returns where they went, so that no run's metrics are overwritten. A
/// resumed run appends to `path` instead ([`MetricsWriter::open`]).
pub fn set_aside_earlier_run(path: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    let path = path.as_ref();
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("metrics file {}", path.display())),
    };
    if !meta.is_file() {
        bail!("metrics file {} exists and is not a regular file", path.display());
    }
    if meta.len() == 0 {
        return Ok(None);
    }
    for n in 1u32.. {
        let mut name = path.as_os_str().to_owned();
        name.push(format!(".{n}"));
        let aside = PathBuf::from(name);
        if std::fs::symlink_metadata(&aside).is_err() {
            std::fs::rename(path, &aside)
                .with_context(|| format!("moving metrics file {} to {}", path.display(), aside.display()))?;
            return Ok(Some(aside));
        }
    }
    unreachable!("some suffix is free")
}

/// Reads a metrics file written by [`MetricsWriter`].
///
/// Blank lines are skipped. A last line that does not parse is taken to be torn by a crash and ignored; a
/// line that does not parse anywhere else is an error naming its (1-based) line number.
pub fn read_metrics(path: impl AsRef<Path>) -> Result<Vec<StepMetrics>> {
    let path = path.as_ref();
    let file = File::open(path).with_context(|| format!("opening metrics file {}", path.display()))?;
    let mut lines = Vec::new();
    for (i, line) in BufReader::new(file).split(b'\n').enumerate() {
        let line = line.with_context(|| format!("reading metrics file {}", path.display()))?;
        lines.push((i + 1, line));
    }
    // Index of the last non-blank line: only that one may be torn.
    let last = lines.iter().rposition(|(_, l)| !is_blank(l));
    let mut out = Vec::with_capacity(lines.len());
    for (idx, (lineno, bytes)) in lines.iter().enumerate() {
        if is_blank(bytes) {
            continue;
        }
        match serde_json::from_slice::<StepMetrics>(bytes) {
            Ok(m) => out.push(m),
            Err(_) if Some(idx) == last => {
                tracing::warn!("{}: ignoring torn last line {lineno}", path.display());
            }
            Err(e) => bail!("{}: line {lineno}: invalid metrics record: {e}", path.display()),
        }
    }
    Ok(out)
}

fn is_blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> StepMetrics {
        StepMetrics {
            step,
            loss: 3.0 / step as f64,
            lr: 3e-4,
            grad_norm: 0.5,
            tokens: step * 1024,
            tokens_per_s: 20_000.0,
            step_ms: 12.0,
            comm_ms: 1.5,
            exposed_comm_ms: 0.0,
            world_size: 2,
            rank: 0,
            update: "sharded".into(),
            ..Default::default()
        }
    }

    #[test]
    fn optional_fields_are_omitted() {
        let json = serde_json::to_string(&sample(1)).unwrap();
        assert!(!json.contains("param_hash"));
        assert!(!json.contains("val_loss"));
        assert!(!json.contains("loss_spike_reference"));
        let mut m = sample(2);
        m.param_hash = Some("abc".into());
        m.val_loss = Some(2.5);
        m.loss_spike_reference = Some(0.75);
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains("\"param_hash\":\"abc\""));
        assert!(json.contains("\"val_loss\":2.5"));
        assert!(json.contains("\"loss_spike_reference\":0.75"));
        assert_eq!(serde_json::from_str::<StepMetrics>(&json).unwrap(), m);
    }

    #[test]
    fn every_rank_but_rank_0_gets_its_own_file_name() {
        let p = |s: &str, r| rank_metrics_path(Path::new(s), r);
        assert_eq!(p("runs/m.jsonl", 0), Path::new("runs/m.jsonl"));
        assert_eq!(p("runs/m.jsonl", 1), Path::new("runs/m.rank1.jsonl"));
        assert_eq!(p("runs/m.v2.jsonl", 12), Path::new("runs/m.v2.rank12.jsonl"));
        assert_eq!(p("metrics", 3), Path::new("metrics.rank3"));
        assert_eq!(p("runs/.hidden", 2), Path::new("runs/.hidden.rank2"));
    }

    #[test]
    fn write_append_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/metrics.jsonl");
        {
            let mut w = MetricsWriter::open(&path, false).unwrap();
            w.write(&sample(1)).unwrap();
            w.write(&sample(2)).unwrap();
        }
        // Simulate a crash mid-line, then resume in append mode.
        {
            let mut f = OpenOptions::new().append(true).open(&path).unwrap();
            f.write_all(b"{\"step\":3,\"lo").unwrap();
        }
        {
            let mut w = MetricsWriter::open(&path, true).unwrap();
            w.write(&sample(3)).unwrap();
        }
        // The torn line is now in the middle: reading must name it.
        let err = read_metrics(&path).unwrap_err().to_string();
        assert!(err.contains("line 3"), "{err}");

        // Without append the file starts over.
        let mut w = MetricsWriter::open(&path, false).unwrap();
        w.write(&sample(7)).unwrap();
        let got = read_metrics(&path).unwrap();
        assert_eq!(got, vec![sample(7)]);
    }

    #[test]
    fn append_to_clean_file_keeps_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        MetricsWriter::open(&path, false).unwrap().write(&sample(1)).unwrap();
        MetricsWriter::open(&path, true).unwrap().write(&sample(2)).unwrap();
        assert_eq!(read_metrics(&path).unwrap(), vec![sample(1), sample(2)]);
    }

    #[test]
    fn an_earlier_runs_metrics_are_set_aside_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        assert_eq!(set_aside_earlier_run(&path).unwrap(), None);
        MetricsWriter::open(&path, false).unwrap().write(&sample(1)).unwrap();
        let first = set_aside_earlier_run(&path).unwrap().unwrap();
        assert_eq!(first, dir.path().join("m.jsonl.1"));
        assert!(!path.exists());
        MetricsWriter::open(&path, false).unwrap().write(&sample(2)).unwrap();
        let second = set_aside_earlier_run(&path).unwrap().unwrap();
        assert_eq!(second, dir.path().join("m.jsonl.2"));
        assert_eq!(read_metrics(&first).unwrap(), vec![sample(1)]);
        assert_eq!(read_metrics(&second).unwrap(), vec![sample(2)]);
        // An empty file holds nothing to keep; a directory is refused.
        std::fs::write(&path, b"").unwrap();
        assert_eq!(set_aside_earlier_run(&path).unwrap(), None);
        let err = set_aside_earlier_run(dir.path()).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }

    #[test]
    fn non_finite_round_trips_as_nan() {
        let mut m = sample(4);
        m.loss = f64::NAN;
        m.grad_norm = f64::INFINITY;
        m.skipped = true;
        let json = serde_json::to_string(&m).unwrap();
        let back: StepMetrics = serde_json::from_str(&json).unwrap();
        assert!(back.loss.is_nan() && back.grad_norm.is_nan() && back.skipped);
        assert_eq!(back.step, 4);
    }

    #[test]
    fn missing_skipped_defaults_to_false() {
        let m: StepMetrics = serde_json::from_str(
            r#"{"step":1,"loss":2.0,"lr":0.1,"grad_norm":1.0,"tokens":10,"tokens_per_s":5.0,
                "step_ms":1.0,"comm_ms":0.0,"world_size":1,"update":"replicated"}"#,
        )
        .unwrap();
        assert!(!m.skipped);
        assert_eq!(m.loss_spike_reference, None);
    }
}
