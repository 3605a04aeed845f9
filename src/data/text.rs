//! UTF-8 text corpora: read, validated, tokenized into a u16 `TokenStream`.
//!
//! The whole file is read because the tokenizer needs it; UTF-8 is checked first so that a binary file
//! passed by mistake gets an error with the byte offset instead of silently training on garbage.

use std::path::Path;

use super::error::{DataError, Result};
use super::stream::TokenStream;
use super::tokenizer::Tokenizer;

/// Reads a UTF-8 text file. Empty files and invalid UTF-8 are errors naming the file (and the offset).
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    if bytes.is_empty() {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    String::from_utf8(bytes).map_err(|e| DataError::InvalidUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Tokenizes text into a stream. Every supported vocabulary fits in u16, so tokens are stored narrow.
pub fn tokenize_text(name: &str, text: &str, tokenizer: &Tokenizer) -> Result<TokenStream> {
    let tokens = tokenizer.encode(text);
    if tokens.is_empty() {
        return Err(DataError::NoTokens {
            source_name: name.to_string(),
        });
    }
    TokenStream::from_tokens(name, &tokens)
}

/// Reads and tokenizes a `.txt` file.
pub fn load_text_file(path: &Path, tokenizer: &Tokenizer) -> Result<TokenStream> {
    let text = read_text(path)?;
    tokenize_text(&path.display().to_string(), &text, tokenizer)
}
