//! Turns corpus files into llm.c shards: the pipeline behind `ringtrain tokenize`.
//!
//! Three stages, so that memory stays flat whatever the input size and every core tokenizes:
//! 1. a reader thread reads the files in order ([`PieceReader`]) and groups their pieces into batches that
//!    hold about [`BATCH_BYTES`] of memory ([`Piece::held_bytes`], so thousands of small files make a
//!    batch no larger than one big file), sent over a channel that holds at most [`BATCHES_IN_FLIGHT`];
//! 2. the calling thread hands each batch to the rayon pool, which checks UTF-8, parses JSON and encodes
//!    the pieces in parallel, collecting the results in input order;
//! 3. the calling thread then writes the batch's tokens ([`ShardWriter`]): the separator token before each
//!    document (`<|endoftext|>` for gpt2, byte 0 for bytes; see [`Tokenizer::document_separator`]), then its
//!    tokens.
//!
//! The output depends only on the inputs and options, not on thread timing. The first error in input order
//! stops the run; the writer then removes everything it wrote.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use rayon::prelude::*;

use super::documents::{Piece, PieceReader};
use super::error::{DataError, Result};
use super::shard_writer::{ShardWriter, Split, WrittenShard};
use super::tokenizer::{Tokenizer, TokenizerKind};

/// Default `--shard-tokens`: 10M tokens (20 MB files). Shard 0 is the validation set, so this is smaller
/// than llm.c's 100M to keep the held-out share small for corpora of a few hundred million tokens.
pub const DEFAULT_SHARD_TOKENS: u64 = 10_000_000;
/// Memory per batch handed to the tokenizing threads (piece buffers and bookkeeping).
pub const BATCH_BYTES: usize = 4 << 20;
/// Batches read ahead of the tokenizer.
pub const BATCHES_IN_FLIGHT: usize = 2;

/// What to tokenize and how to cut it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeOptions {
    pub tokenizer: TokenizerKind,
    /// The JSONL field that holds a document's text.
    pub field: String,
    /// Tokens per shard (the last training shard holds the remainder).
    pub shard_tokens: u64,
}

impl Default for TokenizeOptions {
    fn default() -> Self {
        TokenizeOptions {
            tokenizer: TokenizerKind::Gpt2,
            field: "text".to_string(),
            shard_tokens: DEFAULT_SHARD_TOKENS,
        }
    }
}

/// Counts so far, reported after each batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenizeProgress {
    /// Input bytes consumed, out of `total_bytes` (the sum of the input file sizes).
    pub bytes: u64,
    pub total_bytes: u64,
    pub documents: u64,
    /// Tokens written, separators included.
    pub tokens: u64,
}

/// What a finished run wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeSummary {
    pub input_bytes: u64,
    pub documents: u64,
    /// Tokens written, separators included.
    pub tokens: u64,
    /// Every shard, in stream order (validation first).
    pub shards: Vec<WrittenShard>,
}

impl TokenizeSummary {
    /// Number of shards and tokens in one split.
    pub fn split_totals(&self, split: Split) -> (usize, u64) {
        let of_split = self.shards.iter().filter(|s| s.split == split);
        (of_split.clone().count(), of_split.map(|s| s.tokens).sum())
    }
}

/// Pieces of the input read together, and the input bytes they span.
struct Batch {
    /// (index of the input file, piece)
    pieces: Vec<(usize, Piece)>,
    bytes: u64,
}

/// Tokenizes `inputs` in order into shards in `out_dir`; see the module documentation. Inputs are checked
/// (present, regular, non-empty) before anything is written. `on_progress` runs on the calling thread.
pub fn tokenize_files(
    inputs: &[PathBuf],
    out_dir: &Path,
    opts: &TokenizeOptions,
    on_progress: &mut dyn FnMut(&TokenizeProgress),
) -> Result<TokenizeSummary> {
    if inputs.is_empty() {
        return Err(DataError::InvalidArgument("no input files".into()));
    }
    if opts.field.is_empty() {
        return Err(DataError::InvalidArgument("the JSONL field name is empty".into()));
    }
    let total_bytes = check_inputs(inputs)?;
    let tokenizer = opts.tokenizer.build()?;
    let mut writer = ShardWriter::create(out_dir, opts.tokenizer.as_str(), opts.shard_tokens)?;
    let mut progress = TokenizeProgress {
        total_bytes,
        ..Default::default()
    };
    std::thread::scope(|scope| -> Result<()> {
        let (tx, rx) = sync_channel(BATCHES_IN_FLIGHT);
        scope.spawn(move || read_batches(inputs, &tx));
        encode_and_write(
            inputs,
            rx,
            &tokenizer,
            &opts.field,
            &mut writer,
            &mut progress,
            on_progress,
        )
    })?;
    Ok(TokenizeSummary {
        input_bytes: progress.bytes,
        documents: progress.documents,
        tokens: progress.tokens,
        shards: writer.finish()?,
    })
}

/// Opens every input once, so that a missing, unreadable, empty or directory input fails before any
/// output; returns the total size.
fn check_inputs(inputs: &[PathBuf]) -> Result<u64> {
    let mut total = 0;
    for path in inputs {
        PieceReader::open(path)?;
        total += std::fs::metadata(path).map_err(|e| DataError::io(path, e))?.len();
    }
    Ok(total)
}

/// The reader thread: sends batches in input order, then the first read error if any. Stops early when the
/// receiver is gone.
fn read_batches(inputs: &[PathBuf], tx: &SyncSender<Result<Batch>>) {
    let mut batch = Batch {
        pieces: Vec::new(),
        bytes: 0,
    };
    let mut batch_held = 0usize;
    for (input, path) in inputs.iter().enumerate() {
        let mut reader = match PieceReader::open(path) {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.send(Ok(batch)).and_then(|_| tx.send(Err(e)));
                return;
            }
        };
        let mut consumed = 0u64;
        loop {
            let piece = match reader.next_piece() {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(e) => {
                    // Earlier pieces go first, so that an error among them is the one reported.
                    let _ = tx.send(Ok(batch)).and_then(|_| tx.send(Err(e)));
                    return;
                }
            };
            let end = piece.offset + piece.bytes.len() as u64;
            batch.bytes += end - consumed;
            consumed = end;
            batch_held += piece.held_bytes();
            batch.pieces.push((input, piece));
            if batch_held >= BATCH_BYTES {
                let full = std::mem::replace(
                    &mut batch,
                    Batch {
                        pieces: Vec::new(),
                        bytes: 0,
                    },
                );
                batch_held = 0;
                if tx.send(Ok(full)).is_err() {
                    return;
                }
            }
        }
        // Line breaks and blank lines after the last piece.
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(consumed);
        batch.bytes += size.saturating_sub(consumed);
    }
    let _ = tx.send(Ok(batch));
}

/// Stages 2 and 3 on the calling thread.
fn encode_and_write(
    inputs: &[PathBuf],
    rx: Receiver<Result<Batch>>,
    tokenizer: &Tokenizer,
    field: &str,
    writer: &mut ShardWriter,
    progress: &mut TokenizeProgress,
    on_progress: &mut dyn FnMut(&TokenizeProgress),
) -> Result<()> {
    let separator = [tokenizer.document_separator()];
    for batch in rx {
        let batch = batch?;
        let encoded: Vec<Result<Vec<u32>>> = batch
            .pieces
            .par_iter()
            .map(|(input, piece)| Ok(tokenizer.encode(&piece.text(&inputs[*input], field)?)))
            .collect();
        for ((_, piece), tokens) in batch.pieces.iter().zip(encoded) {
            let tokens = tokens?;
            if piece.starts_document {
                writer.write(&separator)?;
                progress.documents += 1;
                progress.tokens += 1;
            }
            writer.write(&tokens)?;
            progress.tokens += tokens.len() as u64;
        }
        progress.bytes += batch.bytes;
        on_progress(progress);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_get_a_separator_and_keep_input_order() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.jsonl");
        let lines: Vec<String> = (0..300).map(|i| format!("{{\"text\": \"doc {i} é\"}}")).collect();
        std::fs::write(&a, lines.join("\n") + "\n\n").unwrap();
        let b = dir.path().join("b.txt");
        std::fs::write(&b, "tail text").unwrap();
        let out = dir.path().join("out");
        let opts = TokenizeOptions {
            tokenizer: TokenizerKind::Byte,
            shard_tokens: 1000,
            ..Default::default()
        };
        let mut reports = Vec::new();
        let summary = tokenize_files(&[a.clone(), b.clone()], &out, &opts, &mut |p| reports.push(*p)).unwrap();
        let mut want = Vec::new();
        for i in 0..300 {
            want.push(0);
            want.extend(format!("doc {i} é").bytes().map(u32::from));
        }
        want.push(0);
        want.extend("tail text".bytes().map(u32::from));
        let got: Vec<u32> = summary
            .shards
            .iter()
            .flat_map(|s| {
                let shard = crate::data::Shard::open(&s.path).unwrap();
                let mut t = vec![0; shard.len()];
                shard.copy_into(0, &mut t);
                t
            })
            .collect();
        assert_eq!(got, want);
        assert_eq!((summary.documents, summary.tokens), (301, want.len() as u64));
        let size = std::fs::metadata(&a).unwrap().len() + std::fs::metadata(&b).unwrap().len();
        assert_eq!(summary.input_bytes, size);
        assert_eq!(reports.last().unwrap().bytes, size);
        assert_eq!(summary.split_totals(Split::Val), (1, 1000));
    }
}
