//! One error type for everything the data module can refuse.
//!
//! Every failure caused by external input (files, flags, sizes) is a variant here rather than a panic, and
//! each message names the file, offset, token or count involved so that a user can fix the input without
//! reading the source.

use std::path::PathBuf;

/// Result alias used throughout `ringtrain::data`.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Errors raised while loading, validating or sampling training data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("unknown tokenizer {0:?}: expected \"byte\" or \"gpt2\"")]
    UnknownTokenizer(String),

    #[error("could not build the gpt2 (r50k_base) tokenizer: {0}")]
    TokenizerInit(String),

    /// The I/O error is part of the message rather than a `source`, so that printing the chain (`{:#}`)
    /// does not repeat it.
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },

    #[error("{path}: file is empty")]
    EmptyFile { path: PathBuf },

    #[error("{path}: invalid UTF-8 at byte offset {offset}")]
    InvalidUtf8 { path: PathBuf, offset: usize },

    #[error("{path}:{line}: invalid UTF-8 at byte offset {offset}")]
    InvalidUtf8AtLine { path: PathBuf, line: u64, offset: u64 },

    #[error("{path}:{line}: {detail}")]
    BadDocument { path: PathBuf, line: u64, detail: String },

    #[error("{dir}: already contains token shards ({found}); write into an empty or new directory")]
    ShardsExist { dir: PathBuf, found: String },

    #[error("{path}: not an llm.c token shard: header magic is {found}, expected {expected}")]
    BadMagic { path: PathBuf, found: i32, expected: i32 },

    #[error("{path}: unsupported llm.c shard version {found} (only version {expected} holds u16 tokens)")]
    BadVersion { path: PathBuf, found: i32, expected: i32 },

    #[error("{path}: shard is truncated: {detail}")]
    TruncatedShard { path: PathBuf, detail: String },

    #[error("{path}: shard is oversized: {detail}")]
    OversizedShard { path: PathBuf, detail: String },

    #[error("{path}: invalid token count {count} in shard header")]
    BadTokenCount { path: PathBuf, count: i64 },

    #[error("no .bin shards found for {spec:?}")]
    NoShards { spec: String },

    #[error("data path {spec:?} does not exist (expected \"synthetic\", a .txt or .bin file, a directory or a glob)")]
    NotFound { spec: String },

    #[error("invalid glob pattern {spec:?}: {detail}")]
    BadGlob { spec: String, detail: String },

    #[error("{source_name}: contains no tokens")]
    NoTokens { source_name: String },

    #[error(
        "token {token} at position {position} of {location} is out of range for a vocabulary of {vocab_size}{hint}",
        hint = vocab_hint(*.token, *.vocab_size)
    )]
    TokenOutOfVocab {
        token: u32,
        position: u64,
        vocab_size: usize,
        location: String,
    },

    #[error("token {token} at index {index} does not fit in 16 bits")]
    TokenTooLarge { token: u32, index: usize },

    #[error("token range {start}..{end} is outside a stream of {len} tokens")]
    OutOfRange { start: u64, end: u64, len: u64 },

    #[error(
        "not enough data: {n_windows} windows but a global batch needs {global_batch}{needed}",
        needed = match .needed_tokens { Some(n) => format!(" (at least {n} tokens)"), None => String::new() }
    )]
    TooFewWindows {
        n_windows: u64,
        global_batch: u64,
        needed_tokens: Option<u64>,
    },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl DataError {
    /// Wraps an I/O error with the path it concerns.
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            error,
        }
    }
}

/// What to do about a token past the model's vocabulary: name the flag that sets the vocabulary.
fn vocab_hint(token: u32, vocab_size: usize) -> String {
    let gpt2 = super::GPT2_VOCAB_SIZE;
    if vocab_size < gpt2 && (token as usize) < gpt2 {
        format!(
            " (the data holds GPT-2 BPE tokens but the model has {vocab_size}: train with --tokenizer gpt2, \
             which gives the model GPT-2's {gpt2}-token vocabulary)"
        )
    } else {
        " (the data was tokenized with a larger vocabulary than the model's: pick the matching --tokenizer)".into()
    }
}
