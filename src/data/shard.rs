//! llm.c token shards (`.bin`): a 1024-byte header of 256 little-endian i32 (`[0]` = 20240520 magic,
//! `[1]` = 1 version, `[2]` = token count) followed by `count` little-endian u16 tokens.
//!
//! A shard is validated from its header and its file size before anything is mapped, so a corrupt or
//! truncated file gives an error naming the problem instead of a panic or an allocation sized by a header
//! we have not checked. Token data is memory-mapped, never copied: a directory of many gigabytes of shards
//! costs only address space.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::{DataError, Result};

/// `header[0]` of every llm.c token shard.
pub const SHARD_MAGIC: i32 = 20240520;
/// `header[1]`: version 1 stores u16 tokens.
pub const SHARD_VERSION: i32 = 1;
/// Number of i32 slots in the header.
pub const HEADER_INTS: usize = 256;
/// Size of the header in bytes.
pub const HEADER_BYTES: usize = HEADER_INTS * 4;

/// An opened, validated shard whose tokens are memory-mapped (or, from [`Shard::from_bytes`], held in memory).
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    bytes: ShardBytes,
    len: usize,
}

/// Where a shard's bytes (header included) live.
#[derive(Debug)]
enum ShardBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl ShardBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            ShardBytes::Mapped(map) => map,
            ShardBytes::Owned(bytes) => bytes,
        }
    }
}

impl Shard {
    /// Opens and validates a shard: magic, version, and `count` against the file size (exactly
    /// `1024 + 2 * count` bytes).
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| DataError::io(path, e))?;
        let file_len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
        let mut header = [0u8; HEADER_BYTES];
        let header_read = if file_len >= HEADER_BYTES as u64 {
            file.read_exact(&mut header).map_err(|e| DataError::io(path, e))?;
            &header[..]
        } else {
            &[]
        };
        let count = check_header(path, header_read, file_len)?;
        let expected = HEADER_BYTES as u64 + 2 * count as u64;
        // SAFETY: the map is read-only and we only read it as bytes. Like every reader of memory-mapped data
        // we rely on the shard not being truncated or rewritten by another process while training runs;
        // llm.c and nanoGPT make the same assumption for their np.memmap'd shards.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
        if map.len() as u64 != expected {
            return Err(DataError::TruncatedShard {
                path: path.to_path_buf(),
                detail: format!("file changed size while being opened ({} bytes mapped)", map.len()),
            });
        }
        Ok(Shard {
            path: path.to_path_buf(),
            bytes: ShardBytes::Mapped(map),
            len: count,
        })
    }

    /// A shard held in memory (whole file, header included), validated exactly as [`Shard::open`] validates
    /// a file; `path` only names it in messages.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        let header = &bytes[..bytes.len().min(HEADER_BYTES)];
        let count = check_header(path, header, bytes.len() as u64)?;
        Ok(Shard {
            path: path.to_path_buf(),
            bytes: ShardBytes::Owned(bytes),
            len: count,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens in the shard.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw little-endian u16 token bytes.
    fn token_bytes(&self) -> &[u8] {
        &self.bytes.as_slice()[HEADER_BYTES..HEADER_BYTES + 2 * self.len]
    }

    /// Copies tokens `[start, start + dst.len())` into `dst`. The caller guarantees the range is in bounds.
    pub(crate) fn copy_into(&self, start: usize, dst: &mut [u32]) {
        let bytes = &self.token_bytes()[2 * start..2 * (start + dst.len())];
        for (d, pair) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
            *d = u32::from(u16::from_le_bytes([pair[0], pair[1]]));
        }
    }

    /// Index (within the shard, from `start`) and value of the first token `>= vocab_size` in
    /// `[start, end)`, if any.
    pub(crate) fn first_out_of_vocab(&self, start: usize, end: usize, vocab_size: usize) -> Option<(usize, u32)> {
        let bytes = &self.token_bytes()[2 * start..2 * end];
        bytes.chunks_exact(2).enumerate().find_map(|(i, pair)| {
            let t = u16::from_le_bytes([pair[0], pair[1]]);
            ((t as usize) >= vocab_size).then_some((start + i, u32::from(t)))
        })
    }
}

/// Validates a shard's header against its total size and returns the token count. `header` holds the
/// first [`HEADER_BYTES`] bytes, or nothing when the file is shorter than that. Nothing here allocates
/// for the count: it is only compared with `file_len`.
fn check_header(path: &Path, header: &[u8], file_len: u64) -> Result<usize> {
    if file_len == 0 {
        return Err(DataError::EmptyFile {
            path: path.to_path_buf(),
        });
    }
    if file_len < HEADER_BYTES as u64 || header.len() < HEADER_BYTES {
        return Err(DataError::TruncatedShard {
            path: path.to_path_buf(),
            detail: format!("file is {file_len} bytes, shorter than the {HEADER_BYTES}-byte header"),
        });
    }
    let word = |i: usize| i32::from_le_bytes([header[4 * i], header[4 * i + 1], header[4 * i + 2], header[4 * i + 3]]);
    let (magic, version, count) = (word(0), word(1), word(2));
    if magic != SHARD_MAGIC {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
            expected: SHARD_MAGIC,
        });
    }
    if version != SHARD_VERSION {
        return Err(DataError::BadVersion {
            path: path.to_path_buf(),
            found: version,
            expected: SHARD_VERSION,
        });
    }
    let Ok(count) = usize::try_from(count) else {
        return Err(DataError::BadTokenCount {
            path: path.to_path_buf(),
            count: count.into(),
        });
    };
    let expected = HEADER_BYTES as u64 + 2 * count as u64;
    if file_len < expected {
        return Err(DataError::TruncatedShard {
            path: path.to_path_buf(),
            detail: format!(
                "header says {count} tokens ({expected} bytes with the header) but the file has {file_len} bytes"
            ),
        });
    }
    if file_len > expected {
        return Err(DataError::OversizedShard {
            path: path.to_path_buf(),
            detail: format!(
                "header says {count} tokens ({expected} bytes with the header) but the file has {file_len} bytes \
                 ({} trailing bytes)",
                file_len - expected
            ),
        });
    }
    Ok(count)
}

/// The header of a version-1 shard holding `count` tokens: magic, version, count, then zeros.
pub fn shard_header(count: i32) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    for (slot, value) in header.chunks_exact_mut(4).zip([SHARD_MAGIC, SHARD_VERSION, count]) {
        slot.copy_from_slice(&value.to_le_bytes());
    }
    header
}

/// Writes tokens as an llm.c version-1 shard (used by tests and by tools that pre-tokenize a corpus).
/// Fails if a token does not fit in u16 or there are more tokens than an i32 count can describe.
pub fn write_shard(path: &Path, tokens: &[u32]) -> Result<()> {
    let count = i32::try_from(tokens.len())
        .map_err(|_| DataError::InvalidArgument(format!("{} tokens do not fit in one shard", tokens.len())))?;
    let mut buf = Vec::with_capacity(HEADER_BYTES + 2 * tokens.len());
    buf.extend_from_slice(&shard_header(count));
    for (index, &t) in tokens.iter().enumerate() {
        let t = u16::try_from(t).map_err(|_| DataError::TokenTooLarge { token: t, index })?;
        buf.extend_from_slice(&t.to_le_bytes());
    }
    let mut file = File::create(path).map_err(|e| DataError::io(path, e))?;
    file.write_all(&buf).map_err(|e| DataError::io(path, e))?;
    file.sync_all().map_err(|e| DataError::io(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_small_shard() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        let toks = [0u32, 1, 65535, 50256, 7];
        write_shard(&p, &toks).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1024 + 10);
        let s = Shard::open(&p).unwrap();
        assert_eq!(s.len(), 5);
        let mut out = [0u32; 3];
        s.copy_into(2, &mut out);
        assert_eq!(out, [65535, 50256, 7]);
        assert_eq!(s.first_out_of_vocab(0, 5, 50257), Some((2, 65535)));
        assert_eq!(s.first_out_of_vocab(3, 5, 50257), None);
    }

    #[test]
    fn write_rejects_wide_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_shard(&dir.path().join("w.bin"), &[1, 70_000])
            .unwrap_err()
            .to_string();
        assert!(err.contains("70000") && err.contains("index 1"), "{err}");
    }

    #[test]
    fn negative_count_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("n.bin");
        let mut bytes = vec![0u8; HEADER_BYTES];
        bytes[0..4].copy_from_slice(&SHARD_MAGIC.to_le_bytes());
        bytes[4..8].copy_from_slice(&SHARD_VERSION.to_le_bytes());
        bytes[8..12].copy_from_slice(&(-5i32).to_le_bytes());
        std::fs::write(&p, bytes).unwrap();
        let err = Shard::open(&p).unwrap_err().to_string();
        assert!(err.contains("invalid token count -5"), "{err}");
    }
}
