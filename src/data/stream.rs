//! `TokenStream`: a read-only sequence of tokens, held as u16 in memory or memory-mapped from shards.
//!
//! Training reads a few windows per step, so the stream only needs cheap random access: `copy_range` copies
//! `tokens[i..j]` into a caller's `u32` buffer. Tokens are never widened to u32 in storage (every supported
//! vocabulary fits in 16 bits, like llm.c's shards), and a stream over shards never copies them. A stream is a
//! view (`start`, `len`) over shared storage, so a train/val split costs nothing and clones are cheap.

use std::sync::Arc;

use rayon::prelude::*;

use super::error::{DataError, Result};
use super::shard::Shard;

/// Granularity of the parallel vocabulary check.
const VALIDATE_CHUNK: u64 = 1 << 20;

enum Store {
    /// Tokens produced in memory by a tokenizer (text files, the synthetic corpus).
    Owned(Vec<u16>),
    /// Memory-mapped shards; `starts[i]` is the global index of shard `i`'s first token, and
    /// `starts[shards.len()]` the total length.
    Shards { shards: Vec<Shard>, starts: Vec<u64> },
}

/// A sequence of tokens with cheap random access. See the module docs.
#[derive(Clone)]
pub struct TokenStream {
    store: Arc<Store>,
    name: Arc<str>,
    start: u64,
    len: u64,
}

impl std::fmt::Debug for TokenStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStream")
            .field("name", &self.name)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

impl TokenStream {
    /// A stream over tokens already in memory. `name` describes the source in error messages.
    pub fn from_u16(name: impl Into<String>, tokens: Vec<u16>) -> Self {
        let len = tokens.len() as u64;
        TokenStream {
            store: Arc::new(Store::Owned(tokens)),
            name: name.into().into(),
            start: 0,
            len,
        }
    }

    /// A stream over u32 tokens, which must each fit in 16 bits.
    pub fn from_tokens(name: impl Into<String>, tokens: &[u32]) -> Result<Self> {
        let narrow = tokens
            .iter()
            .enumerate()
            .map(|(index, &t)| u16::try_from(t).map_err(|_| DataError::TokenTooLarge { token: t, index }))
            .collect::<Result<Vec<u16>>>()?;
        Ok(Self::from_u16(name, narrow))
    }

    /// A stream that concatenates already-validated shards in the given order.
    pub fn from_shards(name: impl Into<String>, shards: Vec<Shard>) -> Self {
        let mut starts = Vec::with_capacity(shards.len() + 1);
        let mut total = 0u64;
        for s in &shards {
            starts.push(total);
            total += s.len() as u64;
        }
        starts.push(total);
        TokenStream {
            store: Arc::new(Store::Shards { shards, starts }),
            name: name.into().into(),
            start: 0,
            len: total,
        }
    }

    /// Describes the source (file, directory, glob or "synthetic").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of tokens.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of training windows of `t` inputs: window j covers tokens `[j·t, j·t + t + 1)`, so
    /// `(len - 1) / t`. Zero when `t == 0` or the stream is empty.
    pub fn n_windows(&self, t: usize) -> u64 {
        n_windows(self.len, t)
    }

    /// A sub-stream of tokens `[start, end)`, sharing storage.
    pub fn slice(&self, start: u64, end: u64) -> Result<TokenStream> {
        self.check_range(start, end)?;
        Ok(TokenStream {
            store: self.store.clone(),
            name: self.name.clone(),
            start: self.start + start,
            len: end - start,
        })
    }

    /// Copies tokens `[start, start + dst.len())` into `dst`.
    pub fn copy_range(&self, start: u64, dst: &mut [u32]) -> Result<()> {
        let end = start.checked_add(dst.len() as u64).ok_or(DataError::OutOfRange {
            start,
            end: u64::MAX,
            len: self.len,
        })?;
        self.check_range(start, end)?;
        let abs = self.start + start;
        match &*self.store {
            Store::Owned(v) => {
                let src = &v[abs as usize..abs as usize + dst.len()];
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = u32::from(s);
                }
            }
            Store::Shards { shards, starts } => {
                let mut pos = abs;
                let mut out = dst;
                // The last shard whose first token is at or before `pos`.
                let mut i = starts.partition_point(|&s| s <= pos).saturating_sub(1);
                while !out.is_empty() {
                    let within = (pos - starts[i]) as usize;
                    let take = (shards[i].len() - within).min(out.len());
                    let (head, tail) = out.split_at_mut(take);
                    shards[i].copy_into(within, head);
                    out = tail;
                    pos += take as u64;
                    i += 1;
                }
            }
        }
        Ok(())
    }

    /// Convenience: tokens `[start, end)` as a new vector.
    pub fn to_vec(&self, start: u64, end: u64) -> Result<Vec<u32>> {
        self.check_range(start, end)?;
        let mut v = vec![0u32; (end - start) as usize];
        self.copy_range(start, &mut v)?;
        Ok(v)
    }

    /// Checks that every token is `< vocab_size`. The error names the first offending token, its position in
    /// this stream and, for shards, the file and the position within it. Runs in parallel.
    pub fn validate_vocab(&self, vocab_size: usize) -> Result<()> {
        if vocab_size > usize::from(u16::MAX) {
            return Ok(()); // every stored token is a u16
        }
        let (lo, hi) = (self.start, self.start + self.len);
        // Work items: (shard index or usize::MAX for owned data, absolute start, absolute end).
        let mut items: Vec<(usize, u64, u64)> = Vec::new();
        let mut push_chunks = |tag: usize, a: u64, b: u64| {
            let mut s = a;
            while s < b {
                let e = (s + VALIDATE_CHUNK).min(b);
                items.push((tag, s, e));
                s = e;
            }
        };
        match &*self.store {
            Store::Owned(_) => push_chunks(usize::MAX, lo, hi),
            Store::Shards { starts, .. } => {
                for i in 0..starts.len() - 1 {
                    let (a, b) = (starts[i].max(lo), starts[i + 1].min(hi));
                    if a < b {
                        push_chunks(i, a, b);
                    }
                }
            }
        }
        let first = items
            .par_iter()
            .filter_map(|&(tag, a, b)| match &*self.store {
                Store::Owned(v) => v[a as usize..b as usize]
                    .iter()
                    .position(|&t| usize::from(t) >= vocab_size)
                    .map(|i| (a + i as u64, u32::from(v[a as usize + i]), tag)),
                Store::Shards { shards, starts } => {
                    let base = starts[tag];
                    shards[tag]
                        .first_out_of_vocab((a - base) as usize, (b - base) as usize, vocab_size)
                        .map(|(i, t)| (base + i as u64, t, tag))
                }
            })
            .min_by_key(|&(pos, _, _)| pos);
        match first {
            None => Ok(()),
            Some((abs, token, tag)) => {
                let location = match &*self.store {
                    Store::Owned(_) => self.name.to_string(),
                    Store::Shards { shards, starts } => format!(
                        "{} ({}, token {} of that shard)",
                        self.name,
                        shards[tag].path().display(),
                        abs - starts[tag]
                    ),
                };
                Err(DataError::TokenOutOfVocab {
                    token,
                    position: abs - self.start,
                    vocab_size,
                    location,
                })
            }
        }
    }

    fn check_range(&self, start: u64, end: u64) -> Result<()> {
        if start > end || end > self.len {
            return Err(DataError::OutOfRange {
                start,
                end,
                len: self.len,
            });
        }
        Ok(())
    }
}

/// `(len - 1) / t`: the number of windows of `t` inputs plus one shifted target in `len` tokens.
pub fn n_windows(len: u64, t: usize) -> u64 {
    if t == 0 || len == 0 {
        0
    } else {
        (len - 1) / t as u64
    }
}

#[cfg(test)]
mod tests {
    use super::super::shard::write_shard;
    use super::*;

    #[test]
    fn owned_copy_and_slice() {
        let s = TokenStream::from_tokens("mem", &[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(s.len(), 6);
        assert_eq!(s.to_vec(1, 4).unwrap(), vec![2, 3, 4]);
        let tail = s.slice(4, 6).unwrap();
        assert_eq!(tail.to_vec(0, 2).unwrap(), vec![5, 6]);
        assert!(tail.to_vec(0, 3).is_err());
        assert!(s.slice(5, 7).is_err());
        assert_eq!(s.n_windows(2), 2);
        assert_eq!(n_windows(1, 4), 0);
    }

    #[test]
    fn copies_across_shard_boundaries_and_validates() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.bin");
        let b = dir.path().join("b.bin");
        let c = dir.path().join("c.bin");
        write_shard(&a, &[10, 11, 12]).unwrap();
        write_shard(&b, &[]).unwrap();
        write_shard(&c, &[13, 14, 300]).unwrap();
        let shards = [&a, &b, &c].iter().map(|p| Shard::open(p).unwrap()).collect();
        let s = TokenStream::from_shards("dir", shards);
        assert_eq!(s.len(), 6);
        assert_eq!(s.to_vec(1, 6).unwrap(), vec![11, 12, 13, 14, 300]);
        assert_eq!(s.slice(2, 5).unwrap().to_vec(0, 3).unwrap(), vec![12, 13, 14]);
        s.validate_vocab(301).unwrap();
        let err = s.validate_vocab(256).unwrap_err().to_string();
        assert!(
            err.contains("token 300 at position 5") && err.contains("c.bin") && err.contains("token 2 of"),
            "{err}"
        );
        s.slice(0, 5).unwrap().validate_vocab(256).unwrap();
    }
}
