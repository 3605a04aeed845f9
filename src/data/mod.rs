//! Tokenizers, corpora, the window sampler and the synthetic corpus.
//!
//! Map of the module:
//! - `tokenizer.rs`: `byte` (vocab 256) and `gpt2` (tiktoken r50k_base, vocab 50257, offline);
//! - `shard.rs`: llm.c `.bin` token shards, validated then memory-mapped;
//! - `text.rs`: UTF-8 `.txt` corpora;
//! - `documents.rs`, `shard_writer.rs`, `pretokenize.rs`: `ringtrain tokenize`, corpus files read
//!   incrementally, tokenized in parallel and written as llm.c shards with a validation split;
//! - `synthetic.rs`: the built-in deterministic corpus and its documented grammar;
//! - `stream.rs`: `TokenStream`, random access to u16 tokens without copying shards;
//! - `sampler.rs`: windows, global batches, the per-rank split, batch filling, eval batches;
//! - `rng.rs`: portable ChaCha8-based integer sampling shared by the sampler and the corpus.
//!
//! This file resolves a `--data` spec (`synthetic`, a file, a directory or a glob) and builds the
//! train/validation split.

pub mod documents;
mod error;
pub mod pretokenize;
mod rng;
pub mod sampler;
pub mod shard;
pub mod shard_writer;
pub mod split;
pub mod stream;
pub mod synthetic;
pub mod text;
pub mod tokenizer;

use std::path::{Path, PathBuf};

pub use error::{DataError, Result};
pub use sampler::{eval_windows, fill_batch, split_for_rank, WindowSampler};
pub use shard::{write_shard, Shard};
pub use split::{BatchPlan, BatchSplit};
pub use stream::{n_windows, TokenStream};
pub use tokenizer::{Tokenizer, TokenizerKind, GPT2_EOT, GPT2_VOCAB_SIZE};

/// The spec that selects the built-in corpus.
pub const SYNTHETIC: &str = "synthetic";

/// Fraction of a single `.txt` corpus held out for validation when no `--val-data` is given: 1/20 = 5%.
pub const TEXT_HOLDOUT_DIVISOR: u64 = 20;

/// What a `--data` spec names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Synthetic,
    Text(PathBuf),
    /// Shard files in order (sorted by path), with the spec for messages.
    Shards(Vec<PathBuf>),
}

fn has_glob_chars(spec: &str) -> bool {
    spec.contains(['*', '?', '['])
}

fn is_bin(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("bin"))
}

/// Resolves a spec: `synthetic`; an existing directory (its `*.bin` files sorted by name); an existing file
/// (`.bin` is a shard, anything else is UTF-8 text); otherwise a glob pattern of `.bin` shards.
fn resolve(spec: &str) -> Result<Source> {
    if spec == SYNTHETIC {
        return Ok(Source::Synthetic);
    }
    let path = Path::new(spec);
    if path.is_dir() {
        let entries = std::fs::read_dir(path).map_err(|e| DataError::io(path, e))?;
        let mut shards = Vec::new();
        for entry in entries {
            let p = entry.map_err(|e| DataError::io(path, e))?.path();
            if p.is_file() && is_bin(&p) {
                shards.push(p);
            }
        }
        if shards.is_empty() {
            return Err(DataError::NoShards { spec: spec.to_string() });
        }
        shards.sort();
        return Ok(Source::Shards(shards));
    }
    if path.is_file() {
        return Ok(if is_bin(path) {
            Source::Shards(vec![path.to_path_buf()])
        } else {
            Source::Text(path.to_path_buf())
        });
    }
    if path.exists() {
        return Err(DataError::InvalidArgument(format!(
            "{spec:?} is neither a file nor a directory"
        )));
    }
    if !has_glob_chars(spec) {
        return Err(DataError::NotFound { spec: spec.to_string() });
    }
    let paths = glob::glob(spec).map_err(|e| DataError::BadGlob {
        spec: spec.to_string(),
        detail: e.to_string(),
    })?;
    let mut shards = Vec::new();
    for p in paths {
        let p = p.map_err(|e| DataError::io(e.path().to_path_buf(), std::io::Error::other(e.to_string())))?;
        if p.is_file() && is_bin(&p) {
            shards.push(p);
        }
    }
    if shards.is_empty() {
        return Err(DataError::NoShards { spec: spec.to_string() });
    }
    shards.sort();
    Ok(Source::Shards(shards))
}

fn open_shards(name: &str, paths: &[PathBuf]) -> Result<TokenStream> {
    let shards = paths.iter().map(|p| Shard::open(p)).collect::<Result<Vec<_>>>()?;
    let stream = TokenStream::from_shards(name, shards);
    if stream.is_empty() {
        return Err(DataError::NoTokens {
            source_name: name.to_string(),
        });
    }
    Ok(stream)
}

fn synthetic_stream(text: &str, name: &str, tokenizer: TokenizerKind) -> Result<TokenStream> {
    text::tokenize_text(name, text, &tokenizer.build()?)
}

fn load_source(spec: &str, source: &Source, tokenizer: TokenizerKind) -> Result<TokenStream> {
    match source {
        Source::Synthetic => synthetic_stream(&synthetic::train_text(), SYNTHETIC, tokenizer),
        Source::Text(path) => text::load_text_file(path, &tokenizer.build()?),
        Source::Shards(paths) => open_shards(spec, paths),
    }
}

/// Loads a whole corpus. `spec` is `synthetic` (the training text), a `.txt` file (tokenized with
/// `tokenizer`), a `.bin` shard, a directory of `.bin` shards or a glob of them (sorted by path and
/// concatenated; shards are tokenizer-independent). Call [`TokenStream::validate_vocab`] before training.
pub fn load_tokens(spec: &str, tokenizer: TokenizerKind) -> Result<TokenStream> {
    load_source(spec, &resolve(spec)?, tokenizer)
}

/// llm.c's naming: when some shards are named `*_train_*` and others `*_val_*`, those two sets; otherwise
/// `None` (every shard is training data).
fn split_shards(paths: &[PathBuf]) -> Option<(Vec<PathBuf>, Vec<PathBuf>)> {
    let named = |tag: &str| -> Vec<PathBuf> {
        let has_tag = |p: &&PathBuf| p.file_name().is_some_and(|n| n.to_string_lossy().contains(tag));
        paths.iter().filter(has_tag).cloned().collect()
    };
    let (train, val) = (named("_train_"), named("_val_"));
    (!train.is_empty() && !val.is_empty()).then_some((train, val))
}

/// What `ringtrain eval --data SPEC` scores, and a line saying so.
#[derive(Debug, Clone)]
pub struct EvalData {
    pub stream: TokenStream,
    /// Which files (or text) were read, for the user.
    pub description: String,
}

/// The tokens `eval --data SPEC` scores: what `train --data SPEC` validates on when SPEC has a validation
/// part of its own (the `_val_` shards of a shard set named in llm.c's way, the synthetic corpus's
/// validation text), otherwise everything SPEC names (a text file is read whole: it is not split).
pub fn load_eval_tokens(spec: &str, tokenizer: TokenizerKind) -> Result<EvalData> {
    let source = resolve(spec)?;
    let file_names = |paths: &[PathBuf]| {
        let names: Vec<String> = paths
            .iter()
            .map(|p| {
                p.file_name()
                    .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
            })
            .collect();
        names.join(", ")
    };
    let (stream, description) = match &source {
        Source::Synthetic => (
            synthetic_stream(&synthetic::val_text(), "synthetic (val)", tokenizer)?,
            "the synthetic corpus's validation text (what train validates on)".to_string(),
        ),
        Source::Shards(paths) => match split_shards(paths) {
            Some((_, val)) => (
                open_shards(&format!("{spec} (_val_ shards)"), &val)?,
                format!(
                    "the _val_ shards of {spec}: {} (a glob such as '{spec}/*_train_*.bin' scores the training shards)",
                    file_names(&val)
                ),
            ),
            None => (
                open_shards(spec, paths)?,
                format!("every shard of {spec}: {}", file_names(paths)),
            ),
        },
        Source::Text(path) => (
            load_source(spec, &source, tokenizer)?,
            format!("all of {} (a text file is read whole)", path.display()),
        ),
    };
    Ok(EvalData { stream, description })
}

/// Where the validation stream came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValSource {
    /// `--val-data`.
    Explicit,
    /// The synthetic corpus's own validation text (a different seed).
    SyntheticVal,
    /// The last 5% of the tokens of a single text file.
    HeldOut,
    /// Shards named `*_val_*` next to shards named `*_train_*` (llm.c naming).
    ValShards,
    /// No validation data.
    None,
}

/// Training and (optional) validation streams.
#[derive(Debug, Clone)]
pub struct DataSplits {
    pub train: TokenStream,
    pub val: Option<TokenStream>,
    pub val_source: ValSource,
}

/// Builds the train/validation split for `--data` and `--val-data`:
/// - `--val-data` given: it is the validation set (loaded like `--data`; `synthetic` means the synthetic
///   validation text);
/// - `synthetic`: train on the training text, validate on the validation text (different seed);
/// - a `.txt` file: the last 5% of its tokens (`len / 20`, rounded down) are held out and not trained on.
///   With sequence length T the held-out part has `(held - 1) / T` windows; if that is zero there is
///   nothing to evaluate and `eval_windows` returns no batches. Files under 40 tokens get no validation;
/// - shard sets: if some shard file names contain `_train_` and others `_val_` (llm.c's naming, e.g.
///   `fineweb_train_000001.bin`), training uses only the `_train_` shards and validation the `_val_` ones;
///   otherwise every shard is training data and there is no validation.
pub fn load_splits(data: &str, val_data: Option<&str>, tokenizer: TokenizerKind) -> Result<DataSplits> {
    let source = resolve(data)?;
    let explicit = match val_data {
        Some(SYNTHETIC) => Some(synthetic_stream(&synthetic::val_text(), "synthetic (val)", tokenizer)?),
        Some(spec) => Some(load_tokens(spec, tokenizer)?),
        None => None,
    };
    let with_default = |default: Option<TokenStream>, default_source: ValSource| match (&explicit, default) {
        (Some(v), _) => (Some(v.clone()), ValSource::Explicit),
        (None, Some(d)) => (Some(d), default_source),
        (None, None) => (None, ValSource::None),
    };
    let (train, (val, val_source)) = match &source {
        Source::Synthetic => {
            let train = load_source(data, &source, tokenizer)?;
            let default = match explicit {
                Some(_) => None,
                None => Some(synthetic_stream(&synthetic::val_text(), "synthetic (val)", tokenizer)?),
            };
            (train, with_default(default, ValSource::SyntheticVal))
        }
        Source::Text(_) => {
            let all = load_source(data, &source, tokenizer)?;
            let held = all.len() / TEXT_HOLDOUT_DIVISOR;
            if explicit.is_some() || held < 2 {
                (all, with_default(None, ValSource::None))
            } else {
                let cut = all.len() - held;
                (
                    all.slice(0, cut)?,
                    with_default(Some(all.slice(cut, all.len())?), ValSource::HeldOut),
                )
            }
        }
        Source::Shards(paths) => {
            if let Some((train_paths, val_paths)) = split_shards(paths) {
                let train = open_shards(&format!("{data} (_train_ shards)"), &train_paths)?;
                let default = match explicit {
                    Some(_) => None,
                    None => Some(open_shards(&format!("{data} (_val_ shards)"), &val_paths)?),
                };
                (train, with_default(default, ValSource::ValShards))
            } else {
                (open_shards(data, paths)?, with_default(None, ValSource::None))
            }
        }
    };
    Ok(DataSplits { train, val, val_source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_kinds() {
        assert_eq!(resolve("synthetic").unwrap(), Source::Synthetic);
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("a.txt");
        std::fs::write(&t, "hi").unwrap();
        assert_eq!(resolve(t.to_str().unwrap()).unwrap(), Source::Text(t.clone()));
        let err = resolve(dir.path().to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("no .bin shards"), "{err}");
        let missing = dir.path().join("nope.bin");
        let err = resolve(missing.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("does not exist"), "{err}");
        let pattern = format!("{}/*.bin", dir.path().display());
        assert!(resolve(&pattern).unwrap_err().to_string().contains("no .bin shards"));
    }
}
