//! `ringtrain tokenize`: flags into [`TokenizeOptions`], a progress bar on a terminal, and the summary.
//!
//! The bar shows input bytes, bytes/s and tokens/s on stderr and is hidden when stderr is not a terminal.
//! The summary goes to stdout:
//!
//! ```text
//! tokenized 2 files (12.5 MiB) in 3.2 s: 3.9 MiB/s, 1.02M tokens/s
//! 30000 documents, 3271840 tokens (gpt2) -> 2 shards in out/: 1 val (327184 tokens), 1 train (2944656 tokens)
//! ```

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use ringtrain::data::pretokenize::{tokenize_files, TokenizeOptions, TokenizeProgress, TokenizeSummary};
use ringtrain::data::shard_writer::Split;
use ringtrain::data::TokenizerKind;

/// `ringtrain tokenize INPUT... -o DIR [--tokenizer gpt2|byte] [--field text] [--shard-tokens N]`.
pub fn run_tokenize(inputs: &[PathBuf], out_dir: &Path, tokenizer: &str, field: &str, shard_tokens: u64) -> Result<()> {
    let opts = TokenizeOptions {
        tokenizer: tokenizer.parse::<TokenizerKind>()?,
        field: field.to_string(),
        shard_tokens,
    };
    let start = Instant::now();
    let bar = std::io::stderr().is_terminal().then(new_bar);
    let result = tokenize_files(inputs, out_dir, &opts, &mut |p| {
        if let Some(bar) = &bar {
            update_bar(bar, p, start.elapsed());
        }
    });
    if let Some(bar) = bar {
        match &result {
            Ok(_) => bar.finish(),
            Err(_) => bar.abandon(),
        }
    }
    let summary = result?;
    println!(
        "{}",
        format_summary(&summary, inputs.len(), opts.tokenizer, out_dir, start.elapsed())
    );
    Ok(())
}

fn new_bar() -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} | \
         {msg} | ETA {eta}",
    )
    .expect("valid progress template")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message("starting");
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}

fn update_bar(bar: &ProgressBar, p: &TokenizeProgress, elapsed: Duration) {
    bar.set_length(p.total_bytes);
    bar.set_position(p.bytes);
    bar.set_message(format!(
        "{} tokens, {}/s",
        format_count(p.tokens as f64),
        format_count(p.tokens as f64 / elapsed.as_secs_f64().max(1e-9))
    ));
}

/// `1234` -> `1234`, `1.5e6` -> `1.50M`, `2.3e9` -> `2.30G`.
fn format_count(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2}G", x / 1e9),
        x if x >= 1e6 => format!("{:.2}M", x / 1e6),
        x if x >= 1e4 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// The two summary lines (see the module documentation).
fn format_summary(
    s: &TokenizeSummary,
    files: usize,
    tokenizer: TokenizerKind,
    out_dir: &Path,
    elapsed: Duration,
) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    let mib = s.input_bytes as f64 / (1u64 << 20) as f64;
    let (val_shards, val_tokens) = s.split_totals(Split::Val);
    let (train_shards, train_tokens) = s.split_totals(Split::Train);
    format!(
        "tokenized {files} file{} ({mib:.1} MiB) in {secs:.1} s: {:.1} MiB/s, {} tokens/s\n\
         {} documents, {} tokens ({tokenizer}) -> {} shards in {}: {val_shards} val ({val_tokens} tokens), \
         {train_shards} train ({train_tokens} tokens)",
        if files == 1 { "" } else { "s" },
        mib / secs,
        format_count(s.tokens as f64 / secs),
        s.documents,
        s.tokens,
        s.shards.len(),
        out_dir.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringtrain::data::shard_writer::WrittenShard;

    #[test]
    fn summary_format() {
        let shard = |name: &str, split, tokens| WrittenShard {
            path: PathBuf::from(name),
            split,
            tokens,
        };
        let s = TokenizeSummary {
            input_bytes: 3 << 20,
            documents: 40,
            tokens: 1_500_000,
            shards: vec![shard("a", Split::Val, 1_000_000), shard("b", Split::Train, 500_000)],
        };
        assert_eq!(
            format_summary(&s, 2, TokenizerKind::Gpt2, Path::new("out"), Duration::from_secs(2)),
            "tokenized 2 files (3.0 MiB) in 2.0 s: 1.5 MiB/s, 750.0k tokens/s\n\
             40 documents, 1500000 tokens (gpt2) -> 2 shards in out: 1 val (1000000 tokens), 1 train (500000 tokens)"
        );
        assert_eq!(format_count(2.5e9), "2.50G");
        assert_eq!(format_count(999.0), "999");
    }
}
