//! Portable randomness for data decisions that every rank and every machine must make identically.
//!
//! `rand`'s convenience samplers (`gen_range`, `shuffle`) may change their algorithm between versions, which
//! would silently change which windows form a batch after a dependency bump. So we use only the raw ChaCha8
//! word stream (fixed by the ChaCha spec: key, nonce 0, block counter) and do the integer math ourselves.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A ChaCha8 stream keyed by a domain tag (so unrelated uses never share a stream) and two integers.
/// The key is `tag` (zero-padded/truncated to 16 bytes) ‖ `a` (u64 LE) ‖ `b` (u64 LE).
pub(crate) fn keyed_rng(tag: &[u8], a: u64, b: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    let n = tag.len().min(16);
    key[..n].copy_from_slice(&tag[..n]);
    key[16..24].copy_from_slice(&a.to_le_bytes());
    key[24..32].copy_from_slice(&b.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// A uniform integer in `[0, bound)` by rejection sampling, with no modulo bias. `bound` must be > 0.
///
/// Draws 64-bit words and rejects the `2^64 mod bound` smallest values, so the accepted range is an exact
/// multiple of `bound`. The expected number of draws is below 2.
pub(crate) fn uniform_below(rng: &mut ChaCha8Rng, bound: u64) -> u64 {
    debug_assert!(bound > 0);
    if bound <= 1 {
        return 0;
    }
    let reject_below = bound.wrapping_neg() % bound; // == 2^64 mod bound
    loop {
        let x = rng.next_u64();
        if x >= reject_below {
            return x % bound;
        }
    }
}

/// In-place Fisher–Yates shuffle driven by `uniform_below`.
pub(crate) fn shuffle<T>(rng: &mut ChaCha8Rng, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        let j = uniform_below(rng, i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_depends_only_on_the_key() {
        // Exact values are pinned through the sampler in tests/data.rs (shuffle_order_is_pinned).
        let mut r = keyed_rng(b"test", 1, 2);
        let v: Vec<u64> = (0..3).map(|_| uniform_below(&mut r, 1000)).collect();
        let mut r2 = keyed_rng(b"test", 1, 2);
        let v2: Vec<u64> = (0..3).map(|_| uniform_below(&mut r2, 1000)).collect();
        assert_eq!(v, v2);
        let mut r3 = keyed_rng(b"test", 1, 3);
        let v3: Vec<u64> = (0..3).map(|_| uniform_below(&mut r3, 1000)).collect();
        assert_ne!(v, v3);
    }

    #[test]
    fn uniform_covers_range() {
        let mut r = keyed_rng(b"u", 0, 0);
        let mut seen = [0u32; 7];
        for _ in 0..7000 {
            seen[uniform_below(&mut r, 7) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| (800..1200).contains(&c)), "{seen:?}");
        assert_eq!(uniform_below(&mut r, 1), 0);
    }
}
