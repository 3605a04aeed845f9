//! Documents read incrementally from corpus files, for `ringtrain tokenize`.
//!
//! Two formats, chosen by the file's extension:
//! - `.jsonl`: one JSON object per line; the document is the string under a chosen field (`text` by
//!   default). Lines holding only whitespace are skipped.
//! - anything else: UTF-8 text, and the whole file is one document, so its tokens are exactly what
//!   `ringtrain train --data file.txt` trains on.
//!
//! Nothing holds a whole file. A JSONL file is read a line at a time. A text file is read in blocks and
//! handed out as pieces of about [`TEXT_CHUNK_BYTES`], each cut where GPT-2's pre-tokenizer is guaranteed
//! to start a new piece, so encoding the pieces one by one gives exactly the tokens of the whole file:
//!
//! - the cut is just before an ASCII whitespace byte (space, tab, `\r`, `\n`) whose preceding character is
//!   not whitespace;
//! - no alternative of the r50k_base pattern (`'s`-style contractions, ` ?\p{L}++`, ` ?\p{N}++`,
//!   ` ?[^\s\p{L}\p{N}]++`, `\s++$`, `\s+(?!\S)`, `\s`) matches a non-whitespace character followed by a
//!   whitespace one, so a pre-token always ends at the cut;
//! - the pattern has no look-behind, so the matches from the cut onwards depend only on the text after it;
//! - a piece that is not the last one ends with a non-whitespace character, so `$` (the end of the text)
//!   and `(?!\S)` decide the same way as in the whole text.
//!
//! The byte tokenizer is indifferent to where text is cut. A unit test checks the GPT-2 claim on random text.
//!
//! A JSONL line, or a run of text with no such cut, longer than [`MAX_PIECE_BYTES`] is an error naming the
//! file and line, so memory stays bounded whatever the input. Pieces stay raw bytes here; UTF-8 and JSON are
//! checked by [`Piece::text`], which runs on the tokenizing threads.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use super::error::{DataError, Result};

/// Target size of one piece of a text file.
pub const TEXT_CHUNK_BYTES: usize = 1 << 20;
/// The longest JSONL line, or text run without a safe cut, that is accepted.
pub const MAX_PIECE_BYTES: usize = 64 << 20;
/// Read buffer of a JSONL file.
const READ_BUFFER_BYTES: usize = 1 << 20;
/// Read buffer of a text file: its blocks are read straight into the pending text, so this serves only the
/// short reads at the end of a file.
const TEXT_READ_BUFFER_BYTES: usize = 64 << 10;
/// A piece's buffer may exceed its length by this fraction (plus [`PIECE_SLACK_BYTES`]) before it is cut to
/// size, so that what a piece holds stays proportional to its text, whatever the reads that built it.
const PIECE_SLACK_DIVISOR: usize = 8;
const PIECE_SLACK_BYTES: usize = 64;

/// How a corpus file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputFormat {
    /// The whole file is one UTF-8 document.
    Text,
    /// One JSON object per line, with the document under a string field.
    Jsonl,
}

impl InputFormat {
    /// `.jsonl` (any case) is JSON Lines; every other file is text.
    pub fn of(path: &Path) -> Self {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("jsonl")) {
            InputFormat::Jsonl
        } else {
            InputFormat::Text
        }
    }
}

/// Raw bytes of one document, or of one part of a text document, with where they came from. Its buffer
/// holds little more than its bytes ([`Piece::held_bytes`]), so that batches counted by what they hold stay
/// small whatever the number of files.
#[derive(Debug)]
pub struct Piece {
    /// 1-based line of the file where the piece starts.
    pub line: u64,
    /// Byte offset in the file where the piece starts.
    pub offset: u64,
    /// Whether a new document starts here (always for JSONL; the first piece of a text file).
    pub starts_document: bool,
    pub format: InputFormat,
    /// A JSONL line without its line break, or a run of text.
    pub bytes: Vec<u8>,
}

impl Piece {
    /// Memory this piece holds: its buffer and the piece itself.
    pub fn held_bytes(&self) -> usize {
        self.bytes.capacity() + std::mem::size_of::<Piece>()
    }

    /// The document text in this piece: the bytes as UTF-8, or for a JSONL line the string under `field`.
    /// Errors name `path` (the file the piece came from) and the line.
    pub fn text(&self, path: &Path, field: &str) -> Result<Cow<'_, str>> {
        let text = std::str::from_utf8(&self.bytes).map_err(|e| {
            let valid = &self.bytes[..e.valid_up_to()];
            DataError::InvalidUtf8AtLine {
                path: path.to_path_buf(),
                line: self.line + count_newlines(valid),
                offset: self.offset + valid.len() as u64,
            }
        })?;
        match self.format {
            InputFormat::Text => Ok(Cow::Borrowed(text)),
            InputFormat::Jsonl => json_field(text, field)
                .map(Cow::Owned)
                .map_err(|detail| DataError::BadDocument {
                    path: path.to_path_buf(),
                    line: self.line,
                    detail,
                }),
        }
    }
}

/// The string under `field` of a one-line JSON object, or why there is none.
fn json_field(line: &str, field: &str) -> std::result::Result<String, String> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
        // serde_json appends "at line 1 column N"; the line is the file's, so keep only the column.
        let message = e.to_string();
        let message = message.split(" at line ").next().unwrap_or(&message).to_string();
        format!("not valid JSON at column {}: {message}", e.column())
    })?;
    let serde_json::Value::Object(mut object) = value else {
        return Err(format!("expected a JSON object, found {}", json_kind(&value)));
    };
    match object.remove(field) {
        Some(serde_json::Value::String(text)) => Ok(text),
        Some(other) => Err(format!("field {field:?} is {}, not a string", json_kind(&other))),
        None => Err(format!("no {field:?} field (choose another with --field)")),
    }
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `bytes` with its spare capacity given back when it exceeds the allowed slack.
fn trimmed(mut bytes: Vec<u8>) -> Vec<u8> {
    if bytes.capacity() - bytes.len() > bytes.len() / PIECE_SLACK_DIVISOR + PIECE_SLACK_BYTES {
        bytes.shrink_to_fit();
    }
    bytes
}

fn count_newlines(bytes: &[u8]) -> u64 {
    bytes.iter().filter(|&&b| b == b'\n').count() as u64
}

/// Whether text may be cut just before `bytes[i]` without changing its GPT-2 tokens (see the module docs).
fn is_safe_cut(bytes: &[u8], i: usize) -> bool {
    if i == 0 || !matches!(bytes[i], b' ' | b'\t' | b'\r' | b'\n') {
        return false;
    }
    // The character before the cut: back over at most three UTF-8 continuation bytes.
    let mut start = i - 1;
    while start > 0 && i - start < 4 && bytes[start] & 0xC0 == 0x80 {
        start -= 1;
    }
    match std::str::from_utf8(&bytes[start..i])
        .ok()
        .and_then(|s| s.chars().next_back())
    {
        Some(c) => !c.is_whitespace(),
        None => false,
    }
}

/// Reads one corpus file as a sequence of [`Piece`]s.
pub struct PieceReader {
    path: PathBuf,
    format: InputFormat,
    reader: BufReader<File>,
    /// Bytes of the file not read yet, by its size when opened: the next read asks for no more than this
    /// (plus one, to see the end), so a small file is not read into a chunk-sized buffer.
    unread_hint: u64,
    /// Line and byte offset of the next piece.
    line: u64,
    offset: u64,
    /// Text read but not yet handed out.
    pending: Vec<u8>,
    /// No safe cut exists in `pending[..no_cut_below]`.
    no_cut_below: usize,
    at_document_start: bool,
    eof: bool,
    chunk_bytes: usize,
    max_piece_bytes: usize,
}

impl PieceReader {
    /// Opens a corpus file. A missing file, a directory and an empty file are errors naming the path.
    pub fn open(path: &Path) -> Result<Self> {
        Self::with_sizes(path, TEXT_CHUNK_BYTES, MAX_PIECE_BYTES)
    }

    fn with_sizes(path: &Path, chunk_bytes: usize, max_piece_bytes: usize) -> Result<Self> {
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        let meta = file.metadata().map_err(|e| DataError::io(path, e))?;
        if meta.is_dir() {
            return Err(DataError::InvalidArgument(format!(
                "{}: is a directory, expected a text or .jsonl file",
                path.display()
            )));
        }
        if meta.len() == 0 {
            return Err(DataError::EmptyFile {
                path: path.to_path_buf(),
            });
        }
        let format = InputFormat::of(path);
        let buffer = match format {
            InputFormat::Jsonl => READ_BUFFER_BYTES,
            InputFormat::Text => TEXT_READ_BUFFER_BYTES,
        };
        Ok(PieceReader {
            path: path.to_path_buf(),
            format,
            reader: BufReader::with_capacity(buffer, file),
            unread_hint: meta.len(),
            line: 1,
            offset: 0,
            pending: Vec::new(),
            no_cut_below: 0,
            at_document_start: true,
            eof: false,
            chunk_bytes: chunk_bytes.max(1),
            max_piece_bytes,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next piece, or `None` at the end of the file.
    pub fn next_piece(&mut self) -> Result<Option<Piece>> {
        match self.format {
            InputFormat::Jsonl => self.next_json_line(),
            InputFormat::Text => self.next_text_chunk(),
        }
    }

    fn too_long(&self, line: u64, what: &str) -> DataError {
        DataError::BadDocument {
            path: self.path.clone(),
            line,
            detail: format!("{what} longer than {} MiB", self.max_piece_bytes >> 20),
        }
    }

    fn next_json_line(&mut self) -> Result<Option<Piece>> {
        loop {
            let mut bytes = Vec::new();
            let limit = self.max_piece_bytes as u64 + 1;
            let n = (&mut self.reader)
                .take(limit)
                .read_until(b'\n', &mut bytes)
                .map_err(|e| DataError::io(&self.path, e))?;
            if n == 0 {
                return Ok(None);
            }
            let (line, offset) = (self.line, self.offset);
            if bytes.last() != Some(&b'\n') && n as u64 == limit {
                return Err(self.too_long(line, "line is"));
            }
            self.line += 1;
            self.offset += n as u64;
            while matches!(bytes.last(), Some(b'\n' | b'\r')) {
                bytes.pop();
            }
            if bytes.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Ok(Some(Piece {
                line,
                offset,
                starts_document: true,
                format: InputFormat::Jsonl,
                bytes: trimmed(bytes),
            }));
        }
    }

    fn next_text_chunk(&mut self) -> Result<Option<Piece>> {
        loop {
            if self.pending.len() >= self.chunk_bytes {
                if let Some(cut) = self.last_safe_cut() {
                    let rest = self.pending.split_off(cut);
                    self.no_cut_below = rest.len();
                    let bytes = std::mem::replace(&mut self.pending, rest);
                    return Ok(Some(self.text_piece(bytes)));
                }
                if self.pending.len() > self.max_piece_bytes {
                    return Err(self.too_long(self.line, "text runs without a space or line break for"));
                }
            }
            if self.eof {
                if self.pending.is_empty() {
                    return Ok(None);
                }
                let bytes = std::mem::take(&mut self.pending);
                return Ok(Some(self.text_piece(bytes)));
            }
            self.read_block()?;
        }
    }

    /// Appends up to one chunk's worth of the file to `pending` (no more than the file has left, by its size
    /// when opened, plus one byte to see the end); sets `eof` at the end.
    fn read_block(&mut self) -> Result<()> {
        let start = self.pending.len();
        let want = (self.chunk_bytes as u64).min(self.unread_hint + 1) as usize;
        self.pending.resize(start + want, 0);
        let n = loop {
            match self.reader.read(&mut self.pending[start..]) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.pending.truncate(start);
                    return Err(DataError::io(&self.path, e));
                }
            }
        };
        self.pending.truncate(start + n);
        self.unread_hint = self.unread_hint.saturating_sub(n as u64);
        self.eof = n == 0;
        Ok(())
    }

    /// The last safe cut in `pending`, searching only where none was found before.
    fn last_safe_cut(&mut self) -> Option<usize> {
        let low = self.no_cut_below.max(1);
        let cut = (low..self.pending.len()).rev().find(|&i| is_safe_cut(&self.pending, i));
        if cut.is_none() {
            self.no_cut_below = self.pending.len();
        }
        cut
    }

    fn text_piece(&mut self, bytes: Vec<u8>) -> Piece {
        let piece = Piece {
            line: self.line,
            offset: self.offset,
            starts_document: std::mem::replace(&mut self.at_document_start, false),
            format: InputFormat::Text,
            bytes: trimmed(bytes),
        };
        self.line += count_newlines(&piece.bytes);
        self.offset += piece.bytes.len() as u64;
        piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer::{Tokenizer, TokenizerKind};
    use proptest::prelude::*;

    fn pieces(path: &Path, chunk: usize, max: usize) -> Result<Vec<Piece>> {
        let mut reader = PieceReader::with_sizes(path, chunk, max)?;
        let mut out = Vec::new();
        while let Some(p) = reader.next_piece()? {
            out.push(p);
        }
        Ok(out)
    }

    fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn text_pieces_cover_the_file_and_track_lines() {
        let dir = tempfile::tempdir().unwrap();
        let text = "one two\nthree  four\n\nfive six seven\n".repeat(50);
        let p = write(&dir, "a.txt", text.as_bytes());
        let got = pieces(&p, 16, 1 << 20).unwrap();
        assert!(got.len() > 10);
        assert_eq!(
            got.iter().flat_map(|p| p.bytes.clone()).collect::<Vec<u8>>(),
            text.as_bytes()
        );
        assert!(got[0].starts_document && got[1..].iter().all(|p| !p.starts_document));
        for p in &got {
            let before = &text.as_bytes()[..p.offset as usize];
            assert_eq!(p.line, 1 + count_newlines(before));
        }
    }

    /// A piece holds about its own bytes: a small file is not read into a chunk-sized buffer, and the last
    /// piece of a large file does not keep the capacity of the reads before it.
    #[test]
    fn pieces_hold_about_their_own_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let small = write(&dir, "small.txt", &b"a few words\n".repeat(80));
        let large = write(&dir, "large.txt", &b"many more words here\n".repeat(200_000));
        let json = write(&dir, "d.jsonl", "{\"text\": \"hi there\"}\n".repeat(100).as_bytes());
        for path in [&small, &large, &json] {
            let mut reader = PieceReader::open(path).unwrap();
            let mut n = 0;
            while let Some(p) = reader.next_piece().unwrap() {
                let slack = p.bytes.len() / PIECE_SLACK_DIVISOR + PIECE_SLACK_BYTES;
                assert!(
                    p.bytes.capacity() <= p.bytes.len() + slack,
                    "{}: piece {n} of {} bytes holds {}",
                    path.display(),
                    p.bytes.len(),
                    p.bytes.capacity()
                );
                assert!(p.held_bytes() < p.bytes.len() + slack + 256);
                n += 1;
            }
            assert!(n > 0);
        }
    }

    #[test]
    fn text_without_a_cut_is_refused_past_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(&dir, "a.txt", &b"x".repeat(5000));
        let err = pieces(&p, 16, 1024).unwrap_err().to_string();
        assert!(err.contains("a.txt:1:") && err.contains("without a space"), "{err}");
    }

    #[test]
    fn jsonl_lines_skip_blanks_and_name_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            &dir,
            "d.jsonl",
            b"{\"text\": \"a\"}\r\n\n  \n{\"text\": 3}\n[1]\n{\"t\": \"x\"}\nnope",
        );
        let got = pieces(&p, 16, 1024).unwrap();
        assert_eq!(got.iter().map(|p| p.line).collect::<Vec<_>>(), vec![1, 4, 5, 6, 7]);
        assert_eq!(got[0].text(&p, "text").unwrap(), "a");
        let errs: Vec<String> = got[1..]
            .iter()
            .map(|g| g.text(&p, "text").unwrap_err().to_string())
            .collect();
        assert!(
            errs[0].ends_with("d.jsonl:4: field \"text\" is a number, not a string"),
            "{}",
            errs[0]
        );
        assert!(
            errs[1].ends_with("d.jsonl:5: expected a JSON object, found an array"),
            "{}",
            errs[1]
        );
        assert!(
            errs[2].ends_with("d.jsonl:6: no \"text\" field (choose another with --field)"),
            "{}",
            errs[2]
        );
        assert!(
            errs[3].contains("d.jsonl:7: not valid JSON at column 2: expected ident"),
            "{}",
            errs[3]
        );
        assert_eq!(got[3].text(&p, "t").unwrap(), "x");
    }

    #[test]
    fn long_jsonl_line_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let long = format!("{{\"text\": \"ok\"}}\n{{\"text\": \"{}\"}}\n", "y".repeat(2000));
        let p = write(&dir, "d.jsonl", long.as_bytes());
        let err = pieces(&p, 16, 1024).unwrap_err().to_string();
        assert!(err.contains("d.jsonl:2: line is longer than"), "{err}");
    }

    #[test]
    fn invalid_utf8_names_line_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = b"good line\nsecond line\nbad \xff here\n".to_vec();
        bytes.extend_from_slice(&b"more text ".repeat(20));
        let p = write(&dir, "u.txt", &bytes);
        let got = pieces(&p, 8, 1024).unwrap();
        let err = got.iter().find_map(|g| g.text(&p, "text").err()).unwrap().to_string();
        assert!(err.ends_with("u.txt:3: invalid UTF-8 at byte offset 26"), "{err}");
    }

    #[test]
    fn safe_cuts() {
        let b = "ab cd\u{3000} é\n".as_bytes();
        let cuts: Vec<usize> = (0..b.len()).filter(|&i| is_safe_cut(b, i)).collect();
        // Before " cd" and before the "\n" after "é"; not after the ideographic space (it is whitespace).
        assert_eq!(cuts, vec![2, b.len() - 1]);
    }

    fn gpt2_tokens_of_pieces(text: &str, chunk: usize) -> Vec<u32> {
        let dir = tempfile::tempdir().unwrap();
        let p = write(&dir, "t.txt", text.as_bytes());
        let tok = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        let got = pieces(&p, chunk, 1 << 20).unwrap();
        got.iter()
            .flat_map(|g| tok.encode(&g.text(&p, "text").unwrap()))
            .collect()
    }

    #[test]
    fn pieces_encode_like_the_whole_synthetic_text() {
        let text = &crate::data::synthetic::val_text();
        let tok = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        assert_eq!(gpt2_tokens_of_pieces(text, 999), tok.encode(text));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn pieces_encode_like_the_whole_text(
            parts in proptest::collection::vec(
                prop_oneof![
                    Just(" "), Just("  "), Just("\n"), Just("\n\n"), Just("\t"), Just("\r\n"), Just(" \n "),
                    Just("word"), Just("It's"), Just("'ll"), Just("42"), Just("3.14"), Just("!?"), Just("--"),
                    Just("é"), Just("日本"), Just("\u{3000}"), Just("\u{a0}"), Just("🙂"), Just("x")
                ],
                1..200,
            ),
            chunk in 1usize..40,
        ) {
            let text: String = parts.concat();
            let tok = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
            prop_assert_eq!(gpt2_tokens_of_pieces(&text, chunk), tok.encode(&text));
        }
    }
}
