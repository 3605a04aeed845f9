//! Recycled f32 message buffers for the QUIC data path.
//!
//! Every ring message is a sub-chunk of at most `sub_chunk` f32 values (256 KiB by default). Allocating a
//! fresh buffer for each reduced message costs a zero-fill and, for allocations this large, fresh pages
//! (page faults) every time; the profile of a 64 MiB all-reduce showed both. Instead, a payload handed to
//! quinn returns its storage to the pool when quinn drops it (once the data is acknowledged), and the ring
//! engine takes the buffer it writes the next received partial sum into from there (received payloads
//! carry the pool, see `le_pieces.rs`). A recycled buffer is overwritten in full by the sum, so it needs
//! no zeroing.
//!
//! The pool holds at most `max_bytes` of idle buffers; beyond that, returned buffers are freed.

use super::ring::PayloadStorage;
use std::sync::{Arc, Mutex};

/// Idle f32 buffers, shared by a rank's ring engine and its sending side.
pub struct BufferPool {
    idle: Mutex<Idle>,
    max_bytes: usize,
}

/// The idle buffers and their total capacity in bytes, kept together under one lock.
#[derive(Default)]
struct Idle {
    /// Contents are stale and meaningless.
    buffers: Vec<Vec<f32>>,
    bytes: usize,
}

impl BufferPool {
    /// A pool that keeps at most `max_bytes` of idle buffer capacity.
    pub fn new(max_bytes: usize) -> Arc<Self> {
        Arc::new(BufferPool {
            idle: Mutex::new(Idle::default()),
            max_bytes,
        })
    }

    /// A buffer of exactly `len` elements whose contents are unspecified (the caller overwrites them).
    pub fn take(&self, len: usize) -> Vec<f32> {
        let recycled = {
            let mut idle = self.lock();
            let v = idle.buffers.pop();
            idle.bytes -= v.as_ref().map_or(0, |v| v.capacity() * 4);
            v
        };
        let mut v = recycled.unwrap_or_default();
        // Only elements past the recycled buffer's old length are zero-filled.
        v.resize(len, 0.0);
        v
    }

    /// A buffer of `len` elements for the caller to overwrite: from `pool` when there is one, else a fresh
    /// zeroed one.
    pub fn take_from(pool: Option<&Self>, len: usize) -> Vec<f32> {
        match pool {
            Some(pool) => pool.take(len),
            None => vec![0.0; len],
        }
    }

    /// Returns `v`'s storage to the pool, or frees it when the pool is full.
    pub fn give(&self, v: Vec<f32>) {
        if v.capacity() == 0 {
            return;
        }
        let mut idle = self.lock();
        let bytes = v.capacity() * 4;
        if idle.bytes + bytes <= self.max_bytes {
            // The stale contents stay (no clear): `take` then zero-fills nothing it can reuse.
            idle.buffers.push(v);
            idle.bytes += bytes;
        }
    }

    /// Number of idle buffers (for tests).
    pub fn idle(&self) -> usize {
        self.lock().buffers.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        // No code that can panic runs between a change to the list and the matching change to its byte
        // count, so a poisoned lock still holds a consistent pool.
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An f32 payload laid out little-endian in memory, handed to quinn without a copy; its storage goes back
/// to the pool when quinn drops it.
pub struct PooledLeF32 {
    /// `[len]` f32, little-endian in memory.
    data: Vec<f32>,
    pool: Arc<BufferPool>,
}

impl PooledLeF32 {
    pub fn new(mut data: Vec<f32>, pool: Arc<BufferPool>) -> Self {
        if cfg!(target_endian = "big") {
            for x in data.iter_mut() {
                *x = f32::from_bits(x.to_bits().to_le());
            }
        }
        PooledLeF32 { data, pool }
    }
}

impl AsRef<[u8]> for PooledLeF32 {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.data)
    }
}

impl Drop for PooledLeF32 {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.data));
    }
}

/// The QUIC driver hands its pool to the ring engine as the storage of the payloads it builds.
impl PayloadStorage for BufferPool {
    fn take(&self, len: usize) -> Vec<f32> {
        BufferPool::take(self, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_payloads_are_recycled_up_to_the_limit() {
        let pool = BufferPool::new(3 * 1024 * 4);
        for _ in 0..5 {
            drop(PooledLeF32::new(vec![1.0; 1024], pool.clone()));
        }
        // Nothing was taken out, so only the first three fit under the limit.
        assert_eq!(pool.idle(), 3);
        let v = pool.take(1000);
        assert_eq!(v.len(), 1000);
        assert!(v.capacity() >= 1024, "a recycled buffer was reused");
        assert_eq!(pool.idle(), 2);
    }

    #[test]
    fn take_grows_a_small_recycled_buffer() {
        let pool = BufferPool::new(1 << 20);
        pool.give(vec![7.0; 4]);
        let v = pool.take(10);
        assert_eq!(v.len(), 10);
        assert_eq!(&v[4..], &[0.0; 6]);
    }

    #[test]
    fn payload_bytes_are_little_endian_f32() {
        let pool = BufferPool::new(1 << 20);
        let p = PooledLeF32::new(vec![1.0, -2.5], pool);
        let mut want = 1.0f32.to_le_bytes().to_vec();
        want.extend_from_slice(&(-2.5f32).to_le_bytes());
        assert_eq!(p.as_ref(), &want[..]);
    }
}
