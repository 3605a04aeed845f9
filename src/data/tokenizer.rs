//! Tokenizers: raw bytes (vocab 256) and GPT-2's BPE (tiktoken `r50k_base`, vocab 50257).
//!
//! The GPT-2 vocabulary is compiled into `tiktoken-rs`, so building it never touches the network. Building it
//! parses ~50k merges (tens of milliseconds), so the parsed encoder is built once per process and shared.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;
use tiktoken_rs::CoreBPE;

use super::error::{DataError, Result};

/// GPT-2's vocabulary size: 50,000 merges + 256 byte tokens + `<|endoftext|>`.
pub const GPT2_VOCAB_SIZE: usize = 50257;
/// GPT-2's `<|endoftext|>` token id.
pub const GPT2_EOT: u32 = 50256;
/// Byte-level vocabulary size.
pub const BYTE_VOCAB_SIZE: usize = 256;
/// The token `tokenize` puts before each document with the byte tokenizer, which has no end-of-text token:
/// byte 0 (NUL), which text corpora do not contain. Training on a `.txt` file never inserts it.
pub const BYTE_DOCUMENT_SEPARATOR: u32 = 0;

/// Texts longer than this are split at safe line boundaries and encoded in parallel.
const PARALLEL_ENCODE_MIN_BYTES: usize = 1 << 20;
/// Target size of one chunk for parallel encoding.
const PARALLEL_CHUNK_BYTES: usize = 256 << 10;

/// Which tokenizer to use (`--tokenizer byte|gpt2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// One token per UTF-8 byte; vocabulary 256, no end-of-text token.
    #[default]
    Byte,
    /// GPT-2 BPE (tiktoken `r50k_base`); vocabulary 50257, `<|endoftext|>` = 50256.
    Gpt2,
}

impl TokenizerKind {
    /// The name used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenizerKind::Byte => "byte",
            TokenizerKind::Gpt2 => "gpt2",
        }
    }

    /// Vocabulary size without building the tokenizer.
    pub fn vocab_size(self) -> usize {
        match self {
            TokenizerKind::Byte => BYTE_VOCAB_SIZE,
            TokenizerKind::Gpt2 => GPT2_VOCAB_SIZE,
        }
    }

    /// Builds the tokenizer (cheap after the first gpt2 build in a process).
    pub fn build(self) -> Result<Tokenizer> {
        Tokenizer::new(self)
    }
}

impl FromStr for TokenizerKind {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "byte" => Ok(TokenizerKind::Byte),
            "gpt2" | "r50k_base" => Ok(TokenizerKind::Gpt2),
            _ => Err(DataError::UnknownTokenizer(s.to_string())),
        }
    }
}

impl fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A ready-to-use tokenizer. Cloning is cheap (the GPT-2 tables are shared).
#[derive(Clone)]
pub enum Tokenizer {
    Byte,
    Gpt2(Arc<CoreBPE>),
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tokenizer({})", self.kind())
    }
}

/// The process-wide GPT-2 encoder; the error is kept as text so that it can be cloned out of the cell.
fn gpt2_bpe() -> Result<Arc<CoreBPE>> {
    static CELL: OnceLock<std::result::Result<Arc<CoreBPE>, String>> = OnceLock::new();
    CELL.get_or_init(|| tiktoken_rs::r50k_base().map(Arc::new).map_err(|e| e.to_string()))
        .clone()
        .map_err(DataError::TokenizerInit)
}

impl Tokenizer {
    /// Builds a tokenizer of the given kind.
    pub fn new(kind: TokenizerKind) -> Result<Self> {
        match kind {
            TokenizerKind::Byte => Ok(Tokenizer::Byte),
            TokenizerKind::Gpt2 => Ok(Tokenizer::Gpt2(gpt2_bpe()?)),
        }
    }

    pub fn kind(&self) -> TokenizerKind {
        match self {
            Tokenizer::Byte => TokenizerKind::Byte,
            Tokenizer::Gpt2(_) => TokenizerKind::Gpt2,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.kind().vocab_size()
    }

    /// The end-of-text token, where the vocabulary has one.
    pub fn eot(&self) -> Option<u32> {
        match self {
            Tokenizer::Byte => None,
            Tokenizer::Gpt2(_) => Some(GPT2_EOT),
        }
    }

    /// The token that precedes each document in pre-tokenized shards: `<|endoftext|>` for gpt2 (as llm.c's
    /// scripts do), [`BYTE_DOCUMENT_SEPARATOR`] for bytes.
    pub fn document_separator(&self) -> u32 {
        self.eot().unwrap_or(BYTE_DOCUMENT_SEPARATOR)
    }

    /// Encodes text as ordinary text: `<|endoftext|>` written in the text is *not* turned into the special
    /// token, so that a corpus cannot smuggle control tokens in.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            Tokenizer::Byte => text.bytes().map(u32::from).collect(),
            Tokenizer::Gpt2(bpe) => encode_gpt2(bpe, text),
        }
    }

    /// Decodes tokens for display. Partial UTF-8 sequences and ids outside the vocabulary become U+FFFD.
    pub fn decode(&self, tokens: &[u32]) -> String {
        match self {
            Tokenizer::Byte => {
                let bytes: Vec<u8> = tokens.iter().map(|&t| u8::try_from(t).unwrap_or(b'?')).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Gpt2(bpe) => {
                let mut out = String::new();
                let mut run: Vec<u32> = Vec::new();
                let flush = |run: &mut Vec<u32>, out: &mut String| {
                    if !run.is_empty() {
                        let bytes: Vec<u8> = bpe._decode_native_and_split(std::mem::take(run)).flatten().collect();
                        out.push_str(&String::from_utf8_lossy(&bytes));
                    }
                };
                for &t in tokens {
                    // Every id below 50257 is either a BPE token or <|endoftext|>, so the decoder knows it.
                    if (t as usize) < GPT2_VOCAB_SIZE {
                        run.push(t);
                    } else {
                        flush(&mut run, &mut out);
                        out.push(char::REPLACEMENT_CHARACTER);
                    }
                }
                flush(&mut run, &mut out);
                out
            }
        }
    }
}

/// GPT-2 encoding of a long text, parallel over chunks.
///
/// GPT-2's pre-tokenizer never joins a newline with the letter, digit or punctuation that follows it, and a
/// single newline after a non-space character is always a piece of its own. Cutting the text right after such
/// a newline therefore yields exactly the pieces of the whole text, so the parallel result is identical to a
/// single `encode_ordinary` call (a unit test checks this).
fn encode_gpt2(bpe: &CoreBPE, text: &str) -> Vec<u32> {
    if text.len() < PARALLEL_ENCODE_MIN_BYTES {
        return bpe.encode_ordinary(text);
    }
    let chunks = split_at_safe_newlines(text, PARALLEL_CHUNK_BYTES);
    let parts: Vec<Vec<u32>> = chunks.par_iter().map(|c| bpe.encode_ordinary(c)).collect();
    parts.concat()
}

/// Splits `text` into chunks of roughly `target` bytes, cutting only after a `\n` that is preceded by a
/// non-whitespace character and followed by a non-whitespace character.
fn split_at_safe_newlines(text: &str, target: usize) -> Vec<&str> {
    let bytes = text.as_bytes();
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < bytes.len() {
        let mut cut = None;
        let mut i = (start + target).max(start + 1);
        while i < bytes.len() {
            // bytes[i] starts the next chunk; ASCII checks keep cuts on char boundaries.
            let safe = i >= 2
                && bytes[i - 1] == b'\n'
                && !bytes[i - 2].is_ascii_whitespace()
                && bytes[i - 2].is_ascii()
                && bytes[i].is_ascii_graphic();
            if safe {
                cut = Some(i);
                break;
            }
            i += 1;
        }
        let end = cut.unwrap_or(bytes.len());
        chunks.push(&text[start..end]);
        start = end;
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_kinds() {
        assert_eq!("byte".parse::<TokenizerKind>().unwrap(), TokenizerKind::Byte);
        assert_eq!("GPT2".parse::<TokenizerKind>().unwrap(), TokenizerKind::Gpt2);
        let err = "bpe".parse::<TokenizerKind>().unwrap_err().to_string();
        assert!(
            err.contains("\"bpe\"") && err.contains("byte") && err.contains("gpt2"),
            "{err}"
        );
    }

    #[test]
    fn byte_roundtrip_and_lossy_decode() {
        let t = Tokenizer::new(TokenizerKind::Byte).unwrap();
        let ids = t.encode("héllo");
        assert_eq!(ids.len(), 6);
        assert_eq!(t.decode(&ids), "héllo");
        // A cut through a multi-byte character must not panic.
        assert_eq!(t.decode(&ids[..2]), "h\u{fffd}");
        assert_eq!(t.eot(), None);
        assert_eq!(t.vocab_size(), 256);
    }

    #[test]
    fn gpt2_decode_out_of_vocab_is_replacement() {
        let t = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
        assert_eq!(t.decode(&[31373, 99_999, 995]), "hello\u{fffd} world");
        assert_eq!(t.decode(&[GPT2_EOT]), "<|endoftext|>");
    }

    #[test]
    fn safe_split_cuts_only_after_single_newlines() {
        let text = "a b.\nC d\n\n e.\nf";
        let chunks = split_at_safe_newlines(text, 1);
        assert_eq!(chunks.concat(), text);
        assert_eq!(chunks, vec!["a b.\n", "C d\n\n e.\n", "f"]);
    }

    #[test]
    fn parallel_gpt2_encoding_matches_serial() {
        let bpe = gpt2_bpe().unwrap();
        let text = super::super::synthetic::train_text();
        assert!(text.len() >= PARALLEL_ENCODE_MIN_BYTES);
        assert_eq!(encode_gpt2(&bpe, &text), bpe.encode_ordinary(&text));
    }
}
