//! Writes one token stream as llm.c shards in a directory, split into validation and training shards that
//! `ringtrain train --data DIR` recognises.
//!
//! Naming and split (llm.c's convention): shard 0 is `{prefix}_val_000000.bin` and holds the first
//! `shard_tokens` tokens; shards 1, 2, ... are `{prefix}_train_000001.bin`, ... and hold `shard_tokens`
//! tokens each, the last one the remainder. When the whole stream fits in shard 0, it is split instead: the
//! first `max(1, n / 10)` tokens stay in the validation shard and the rest become `..._train_000001.bin`,
//! so even a small corpus yields both. A stream of fewer than two tokens is an error.
//!
//! Safety:
//! - each shard is written to `{name}.tmp` in the directory, its header filled in, fsynced, then renamed,
//!   so a `.bin` file in the directory is always complete;
//! - a directory that already holds `.bin` files is refused, since training would mix them in;
//! - if writing does not reach [`ShardWriter::finish`] (an error, or the writer dropped), the temporary file
//!   and every shard this writer published are removed, leaving the directory as it was.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::error::{DataError, Result};
use super::shard::{shard_header, HEADER_BYTES};

/// When the whole stream fits in shard 0, `1 / SMALL_CORPUS_VAL_DIVISOR` of it is validation.
pub const SMALL_CORPUS_VAL_DIVISOR: u64 = 10;
/// Write buffer of an open shard.
const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// Which split a shard belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Val,
    Train,
}

impl Split {
    fn of_index(index: u32) -> Self {
        if index == 0 {
            Split::Val
        } else {
            Split::Train
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Split::Val => "val",
            Split::Train => "train",
        }
    }
}

/// A complete shard in the output directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenShard {
    pub path: PathBuf,
    pub split: Split,
    pub tokens: u64,
}

/// The file name of shard `index`: `{prefix}_{val|train}_{index:06}.bin`.
pub fn shard_file_name(prefix: &str, index: u32) -> String {
    format!("{prefix}_{}_{index:06}.bin", Split::of_index(index).as_str())
}

/// A shard being written under its temporary name. Dropping it unpublished removes the temporary file.
struct OpenShard {
    index: u32,
    temp_path: PathBuf,
    final_path: PathBuf,
    file: BufWriter<File>,
    tokens: u64,
    published: bool,
}

impl OpenShard {
    /// Creates `{name}.tmp` with a placeholder header.
    fn create(dir: &Path, prefix: &str, index: u32) -> Result<Self> {
        let name = shard_file_name(prefix, index);
        let final_path = dir.join(&name);
        let temp_path = dir.join(format!("{name}.tmp"));
        // Readable too: a small corpus's shard 0 is read back to split it.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp_path)
            .map_err(|e| DataError::io(&temp_path, e))?;
        let mut shard = OpenShard {
            index,
            temp_path,
            final_path,
            file: BufWriter::with_capacity(WRITE_BUFFER_BYTES, file),
            tokens: 0,
            published: false,
        };
        shard.write_bytes(&[0u8; HEADER_BYTES])?;
        Ok(shard)
    }

    fn io_error(&self, e: std::io::Error) -> DataError {
        DataError::io(&self.temp_path, e)
    }

    fn write_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.file.write_all(bytes).map_err(|e| self.io_error(e))
    }

    /// Writes the header for `self.tokens`, fsyncs, renames to the final name and fsyncs the directory.
    fn publish(&mut self, dir: &Path) -> Result<WrittenShard> {
        let count = i32::try_from(self.tokens)
            .map_err(|_| DataError::InvalidArgument(format!("{} tokens do not fit in one shard", self.tokens)))?;
        self.file.flush().map_err(|e| self.io_error(e))?;
        let file = self.file.get_mut();
        let written = file
            .seek(SeekFrom::Start(0))
            .and_then(|_| file.write_all(&shard_header(count)))
            .and_then(|_| file.sync_all());
        written.map_err(|e| self.io_error(e))?;
        std::fs::rename(&self.temp_path, &self.final_path).map_err(|e| DataError::io(&self.final_path, e))?;
        self.published = true;
        fsync_dir(dir)?;
        Ok(WrittenShard {
            path: self.final_path.clone(),
            split: Split::of_index(self.index),
            tokens: self.tokens,
        })
    }
}

impl Drop for OpenShard {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.temp_path);
        }
    }
}

#[cfg(unix)]
fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| DataError::io(dir, e))
}

/// Directories cannot be opened for fsync on this platform; renames there are as durable as the OS makes them.
#[cfg(not(unix))]
fn fsync_dir(_dir: &Path) -> Result<()> {
    Ok(())
}

/// Refuses a directory that already holds `.bin` files; creates it if it does not exist.
fn prepare_dir(dir: &Path) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(DataError::InvalidArgument(format!(
            "output {} exists and is not a directory",
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e))?;
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let path = entry.map_err(|e| DataError::io(dir, e))?.path();
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("bin")) {
            found.push(path.file_name().unwrap_or_default().to_string_lossy().into_owned());
        }
    }
    if found.is_empty() {
        return Ok(());
    }
    found.sort();
    let shown = found.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    let more = found.len().saturating_sub(3);
    Err(DataError::ShardsExist {
        dir: dir.to_path_buf(),
        found: if more > 0 {
            format!("{shown} and {more} more")
        } else {
            shown
        },
    })
}

/// Writes a stream of tokens as shards; see the module documentation.
pub struct ShardWriter {
    dir: PathBuf,
    prefix: String,
    shard_tokens: u64,
    open: Option<OpenShard>,
    published: Vec<WrittenShard>,
    finished: bool,
    /// Little-endian u16 bytes of the tokens being written.
    scratch: Vec<u8>,
}

impl ShardWriter {
    /// Prepares `dir` (created if missing; refused if it holds `.bin` files) and opens shard 0, so that an
    /// unwritable directory fails before any input is read. `shard_tokens` is between 1 and `i32::MAX`.
    pub fn create(dir: &Path, prefix: &str, shard_tokens: u64) -> Result<Self> {
        if shard_tokens == 0 || shard_tokens > i32::MAX as u64 {
            return Err(DataError::InvalidArgument(format!(
                "shard size {shard_tokens} tokens: must be between 1 and {} (a shard's count is an i32)",
                i32::MAX
            )));
        }
        prepare_dir(dir)?;
        let open = OpenShard::create(dir, prefix, 0)?;
        Ok(ShardWriter {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            shard_tokens,
            open: Some(open),
            published: Vec::new(),
            finished: false,
            scratch: Vec::new(),
        })
    }

    /// Appends tokens, publishing each shard as it fills. Every token must fit in u16.
    pub fn write(&mut self, tokens: &[u32]) -> Result<()> {
        let mut rest = tokens;
        while !rest.is_empty() {
            let used = self.shard_with_room()?.tokens;
            let room = (self.shard_tokens - used).min(rest.len() as u64) as usize;
            let (now, later) = rest.split_at(room);
            self.scratch.clear();
            for (index, &t) in now.iter().enumerate() {
                let t = u16::try_from(t).map_err(|_| DataError::TokenTooLarge { token: t, index })?;
                self.scratch.extend_from_slice(&t.to_le_bytes());
            }
            let shard = self.open.as_mut().expect("shard_with_room leaves a shard open");
            shard
                .file
                .write_all(&self.scratch)
                .map_err(|e| DataError::io(&shard.temp_path, e))?;
            shard.tokens += room as u64;
            rest = later;
        }
        Ok(())
    }

    /// The open shard, after publishing a full one and opening the next.
    fn shard_with_room(&mut self) -> Result<&mut OpenShard> {
        let full = self.open.as_ref().is_none_or(|s| s.tokens == self.shard_tokens);
        if full {
            let next_index = match self.open.take() {
                Some(mut shard) => {
                    self.published.push(shard.publish(&self.dir)?);
                    shard.index + 1
                }
                None => 0,
            };
            self.open = Some(OpenShard::create(&self.dir, &self.prefix, next_index)?);
        }
        Ok(self.open.as_mut().expect("a shard was just opened"))
    }

    /// Publishes the last shard (splitting a stream that fits in shard 0) and returns every shard written,
    /// in order.
    pub fn finish(mut self) -> Result<Vec<WrittenShard>> {
        let mut last = self
            .open
            .take()
            .expect("a writer always has an open shard until finish");
        if last.index == 0 {
            self.split_single_shard(last)?;
        } else if last.tokens > 0 {
            self.published.push(last.publish(&self.dir)?);
        }
        self.finished = true;
        Ok(std::mem::take(&mut self.published))
    }

    /// Moves all but the first `max(1, n / 10)` tokens of shard 0 into train shard 1, then publishes both.
    fn split_single_shard(&mut self, mut val: OpenShard) -> Result<()> {
        let total = val.tokens;
        if total < 2 {
            return Err(DataError::InvalidArgument(format!(
                "the input gave {total} token(s); at least 2 are needed for a validation and a training shard"
            )));
        }
        let val_tokens = (total / SMALL_CORPUS_VAL_DIVISOR).max(1);
        let mut train = OpenShard::create(&self.dir, &self.prefix, 1)?;
        let moved = move_tail(&mut val.file, HEADER_BYTES as u64 + 2 * val_tokens, &mut train.file);
        moved.map_err(|e| val.io_error(e))?;
        val.tokens = val_tokens;
        train.tokens = total - val_tokens;
        self.published.push(val.publish(&self.dir)?);
        self.published.push(train.publish(&self.dir)?);
        Ok(())
    }
}

/// Appends the bytes of `src` from `from` to its end to `dst`, then truncates `src` at `from`.
fn move_tail(src: &mut BufWriter<File>, from: u64, dst: &mut BufWriter<File>) -> std::io::Result<()> {
    src.flush()?;
    let file = src.get_mut();
    file.seek(SeekFrom::Start(from))?;
    std::io::copy(&mut Read::by_ref(file), dst)?;
    file.set_len(from)
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        // The open shard's own drop removes its temporary file.
        if !self.finished {
            for shard in &self.published {
                let _ = std::fs::remove_file(&shard.path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard::Shard;

    fn tokens_of(path: &Path) -> Vec<u32> {
        let shard = Shard::open(path).unwrap();
        let mut out = vec![0u32; shard.len()];
        shard.copy_into(0, &mut out);
        out
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn fills_shards_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), "p", 4).unwrap();
        let all: Vec<u32> = (0..11).map(|t| t * 1000).collect();
        w.write(&all[..3]).unwrap();
        w.write(&all[3..]).unwrap();
        let shards = w.finish().unwrap();
        assert_eq!(
            names(dir.path()),
            ["p_train_000001.bin", "p_train_000002.bin", "p_val_000000.bin"]
        );
        assert_eq!(
            shards.iter().map(|s| (s.split, s.tokens)).collect::<Vec<_>>(),
            [(Split::Val, 4), (Split::Train, 4), (Split::Train, 3)]
        );
        let joined: Vec<u32> = shards.iter().flat_map(|s| tokens_of(&s.path)).collect();
        assert_eq!(joined, all);
    }

    #[test]
    fn exactly_full_last_shard_leaves_no_empty_shard() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), "p", 3).unwrap();
        w.write(&[1, 2, 3, 4, 5, 6]).unwrap();
        let shards = w.finish().unwrap();
        assert_eq!(shards.len(), 2);
        assert_eq!(names(dir.path()), ["p_train_000001.bin", "p_val_000000.bin"]);
    }

    #[test]
    fn small_stream_is_split_one_tenth_val() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), "p", 1000).unwrap();
        let all: Vec<u32> = (0..25).collect();
        w.write(&all).unwrap();
        let shards = w.finish().unwrap();
        assert_eq!(tokens_of(&shards[0].path), &all[..2]);
        assert_eq!(tokens_of(&shards[1].path), &all[2..]);
        assert_eq!((shards[0].split, shards[1].split), (Split::Val, Split::Train));
        assert_eq!(names(dir.path()), ["p_train_000001.bin", "p_val_000000.bin"]);
    }

    #[test]
    fn too_few_tokens_is_an_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), "p", 1000).unwrap();
        w.write(&[7]).unwrap();
        let err = w.finish().unwrap_err().to_string();
        assert!(err.contains("at least 2"), "{err}");
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn dropping_unfinished_removes_published_and_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), "p", 2).unwrap();
        w.write(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!(
            names(dir.path()).len(),
            3,
            "two published shards and one temporary file"
        );
        drop(w);
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn refuses_existing_shards_and_wide_tokens() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("old.bin"), b"x").unwrap();
        let err = ShardWriter::create(dir.path(), "p", 10).err().unwrap().to_string();
        assert!(err.contains("already contains token shards (old.bin)"), "{err}");
        let fresh = dir.path().join("fresh");
        let mut w = ShardWriter::create(&fresh, "p", 10).unwrap();
        let err = w.write(&[1, 70_000]).unwrap_err().to_string();
        assert!(err.contains("70000"), "{err}");
        assert!(ShardWriter::create(&fresh, "p", 0).is_err());
    }
}
