//! `ringtrain selftest [--backend auto|cpu|wgpu|cuda] [--json PATH]`: runs every case of the op conformance
//! suite ([`ringtrain::backend::conformance`], the cases `tests/conformance.rs` asserts) on one backend
//! against the CPU reference, and prints one row per case as it finishes. The CPU backend is checked against
//! the f64 reference. Fails (exit status 1) when any case fails.

use super::backend::{open_backend, parse_backend};
use anyhow::{bail, Context, Result};
use ringtrain::backend::conformance::{self, CaseResult, Finding, Reference, Settings};
use ringtrain::backend::factory::BackendKind;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

pub fn run_selftest(backend: &str, json: Option<&Path>) -> Result<()> {
    let (mut be, selection) = open_backend(parse_backend(Some(backend))?, 0)?;
    let name = be.name();
    // The CPU backend is the f32 reference itself: check it against the f64 one instead.
    let reference = if selection.kind == BackendKind::Cpu {
        Reference::F64
    } else {
        Reference::F32
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "# {}", selection.reason)?;
    writeln!(out, "# backend: {name}, reference: {}", reference_name(reference))?;
    write_row(&mut out, "op", "shape", "result", "worst error against tolerance")?;
    let started = Instant::now();
    let mut results = Vec::new();
    let mut written = Ok(());
    let settings = Settings {
        reference,
        straddle: None,
    };
    conformance::run_all(&mut *be, settings, &mut |r| {
        // Each row is flushed at once, so a run cut short still shows the cases that finished.
        if written.is_ok() {
            written = write_result(&mut out, &r);
        }
        results.push(r);
    });
    written?;
    let passed = results.iter().filter(|r| r.passed()).count();
    let total = results.len();
    let seconds = started.elapsed().as_secs_f64();
    writeln!(out, "selftest: {passed}/{total} passed on {name} in {seconds:.1} s")?;
    out.flush()?;
    if let Some(path) = json {
        write_json(path, &name, &selection.reason, reference, &results)
            .with_context(|| format!("--json {}", path.display()))?;
    }
    if passed < total {
        bail!("{} of {total} conformance cases failed on {name}", total - passed);
    }
    Ok(())
}

fn reference_name(reference: Reference) -> &'static str {
    match reference {
        Reference::F32 => "cpu f32",
        Reference::F64 => "cpu f64",
    }
}

fn write_result(out: &mut impl Write, r: &CaseResult) -> std::io::Result<()> {
    let verdict = if r.passed() { "PASS" } else { "FAIL" };
    write_row(out, &r.op, &r.shape, verdict, &r.finding.to_string())
}

fn write_row(out: &mut impl Write, op: &str, shape: &str, result: &str, worst: &str) -> std::io::Result<()> {
    writeln!(out, "{op:<22} {shape:<27} {result:<6} {worst}")?;
    out.flush()
}

/// The results as one JSON document: the backend, then one object per case.
fn write_json(path: &Path, name: &str, reason: &str, reference: Reference, results: &[CaseResult]) -> Result<()> {
    let cases: Vec<serde_json::Value> = results.iter().map(case_json).collect();
    let doc = serde_json::json!({
        "backend": name,
        "selection": reason,
        "reference": reference_name(reference),
        "passed": results.iter().filter(|r| r.passed()).count(),
        "total": results.len(),
        "cases": cases,
    });
    let text = serde_json::to_string_pretty(&doc)?;
    std::fs::write(path, text + "\n")?;
    Ok(())
}

/// One case; non-finite numbers become `null`.
fn case_json(r: &CaseResult) -> serde_json::Value {
    let mut case = serde_json::json!({"op": r.op, "shape": r.shape, "passed": r.passed()});
    let detail = match &r.finding {
        Finding::Elements { worst, mismatches } => serde_json::json!({
            "mismatches": mismatches,
            "worst": {"index": worst.index, "got": worst.got, "want": worst.want, "err": worst.err,
                "bound": worst.bound, "tolerance_abs": shortest(worst.tolerance.abs),
                "tolerance_rel": shortest(worst.tolerance.rel)},
        }),
        Finding::Property { what, .. } => serde_json::json!({ "property": what }),
        Finding::Error(e) => serde_json::json!({ "error": e }),
    };
    if let (Some(case), Some(detail)) = (case.as_object_mut(), detail.as_object()) {
        case.extend(detail.clone());
    }
    case
}

/// `x` as the f64 nearest its shortest decimal form, so that a tolerance of `1e-6f32` reads `1e-6`, not
/// `9.999999974752427e-7`.
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}
