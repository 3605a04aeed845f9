//! f32 payloads as they come off a QUIC stream: little-endian bytes in pieces whose boundaries may fall
//! inside a value.
//!
//! quinn hands over each packet's stream data as its own [`Bytes`] without copying it. Reading those
//! pieces into an f32 buffer first and summing afterwards costs one extra pass over every received byte
//! (6.8% of an all-reduce's profile samples: BENCHMARKS.md, "Transport settings"); the ring engine instead
//! sums or stores straight from the pieces, and forwards all-gather pieces as they are.

use super::buffer_pool::BufferPool;
use bytes::Bytes;
use std::sync::Arc;

/// `len_bytes() / 4` f32 values, little-endian, split over `pieces` at arbitrary byte offsets.
#[derive(Clone)]
pub struct LePieces {
    pub pieces: Vec<Bytes>,
    /// Where the engine takes the buffers it writes sums into (`None`: plain allocations).
    pub pool: Option<Arc<BufferPool>>,
    /// The pieces lie in memory the transport lent and needs back promptly (a shared-memory ring, whose
    /// space returns in order): the engine must not hold them while it waits to send, so it stores them
    /// and forwards from its own buffer instead of forwarding the pieces.
    pub lent: bool,
}

impl LePieces {
    /// `values` as one piece (tests, and transports that hold whole buffers).
    pub fn from_f32(values: &[f32]) -> Self {
        LePieces {
            pieces: vec![le_bytes(values)],
            pool: None,
            lent: false,
        }
    }

    pub fn len_bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len()).sum()
    }

    /// The values, decoded into a new vector.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len_bytes() / 4];
        self.store_into(&mut out);
        out
    }

    /// A buffer of `len` values with unspecified contents, for the caller to overwrite.
    pub fn scratch(&self, len: usize) -> Vec<f32> {
        BufferPool::take_from(self.pool.as_deref(), len)
    }

    /// `dst = values`. `dst.len()` must be `len_bytes() / 4`.
    pub fn store_into(&self, dst: &mut [f32]) {
        self.for_each_run(|first, bytes| decode_le(&mut dst[first..first + bytes.len() / 4], bytes));
    }

    /// `out = values + own`, element-wise (the received partial sum plus this rank's contribution). All
    /// three have `len_bytes() / 4` elements.
    pub fn sum_into(&self, own: &[f32], out: &mut [f32]) {
        self.for_each_run(|first, bytes| {
            let end = first + bytes.len() / 4;
            add_le(&mut out[first..end], bytes, &own[first..end]);
        });
    }

    /// The last step of a sum, stored: `own = (values + own) / divisor` (no division for `None`). The bits
    /// equal a sum, then a division.
    pub fn finish_in_place(&self, own: &mut [f32], divisor: Option<f32>) {
        self.for_each_run(|first, bytes| {
            let own = &mut own[first..first + bytes.len() / 4];
            match divisor {
                Some(k) => finish_le(bytes, own, |sum| sum / k),
                None => finish_le(bytes, own, |sum| sum),
            }
        });
    }

    /// Calls `f(first, bytes)` for consecutive runs of whole values, in order: `bytes` holds values
    /// `first .. first + bytes.len() / 4`. A value split between two pieces is assembled on the stack and
    /// passed as a run of one. `len_bytes()` must be a multiple of 4 (the decoder checks it first).
    fn for_each_run(&self, mut f: impl FnMut(usize, &[u8])) {
        debug_assert_eq!(self.len_bytes() % 4, 0);
        let mut carry = [0u8; 4];
        let mut held = 0;
        let mut next = 0;
        for piece in &self.pieces {
            let mut rest: &[u8] = piece;
            if held > 0 {
                let take = (4 - held).min(rest.len());
                carry[held..held + take].copy_from_slice(&rest[..take]);
                held += take;
                rest = &rest[take..];
                if held < 4 {
                    continue;
                }
                f(next, &carry);
                next += 1;
            }
            let whole = rest.len() / 4 * 4;
            if whole > 0 {
                f(next, &rest[..whole]);
                next += whole / 4;
            }
            let tail = &rest[whole..];
            carry[..tail.len()].copy_from_slice(tail);
            held = tail.len();
        }
    }
}

impl std::fmt::Debug for LePieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LePieces({} bytes in {} pieces)",
            self.len_bytes(),
            self.pieces.len()
        )
    }
}

/// Equal when the bytes are, however they are split.
impl PartialEq for LePieces {
    fn eq(&self, other: &Self) -> bool {
        let flat = |p: &LePieces| p.pieces.iter().flat_map(|b| b.iter().copied()).collect::<Vec<u8>>();
        self.len_bytes() == other.len_bytes() && flat(self) == flat(other)
    }
}

/// `values` as little-endian bytes.
pub fn le_bytes(values: &[f32]) -> Bytes {
    Bytes::from(values.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
}

/// `dst[i] = f32::from_le_bytes(bytes[4i..4i + 4])`.
fn decode_le(dst: &mut [f32], bytes: &[u8]) {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(bytes);
    } else {
        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

/// `out[i] = f32::from_le_bytes(bytes[4i..4i + 4]) + own[i]`.
fn add_le(out: &mut [f32], bytes: &[u8], own: &[f32]) {
    for ((o, c), d) in out.iter_mut().zip(bytes.chunks_exact(4)).zip(own) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) + *d;
    }
}

/// `own[i] = finish(f32::from_le_bytes(bytes[4i..4i + 4]) + own[i])`.
#[inline(always)]
fn finish_le(bytes: &[u8], own: &mut [f32], finish: impl Fn(f32) -> f32) {
    for (c, d) in bytes.chunks_exact(4).zip(own.iter_mut()) {
        *d = finish(f32::from_le_bytes([c[0], c[1], c[2], c[3]]) + *d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `values` as little-endian bytes cut at `cuts` (byte offsets, any order, duplicates allowed).
    fn split(values: &[f32], cuts: &[usize]) -> LePieces {
        let bytes = le_bytes(values);
        let mut at: Vec<usize> = cuts.iter().map(|&c| c % (bytes.len() + 1)).collect();
        at.push(0);
        at.push(bytes.len());
        at.sort_unstable();
        LePieces {
            pieces: at.windows(2).map(|w| bytes.slice(w[0]..w[1])).collect(),
            pool: None,
            lent: false,
        }
    }

    proptest! {
        #[test]
        fn decode_and_sum_match_plain_f32_for_any_split(
            values in proptest::collection::vec(-1e6f32..1e6, 0..200),
            cuts in proptest::collection::vec(0usize..1000, 0..12),
        ) {
            let own: Vec<f32> = (0..values.len()).map(|i| i as f32 * 0.5 - 3.0).collect();
            let p = split(&values, &cuts);
            prop_assert_eq!(p.len_bytes(), values.len() * 4);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&p.to_f32()), bits(&values));
            let mut out = vec![f32::NAN; values.len()];
            p.sum_into(&own, &mut out);
            let want: Vec<f32> = values.iter().zip(&own).map(|(a, b)| a + b).collect();
            prop_assert_eq!(bits(&out), bits(&want));
            for divisor in [None, Some(3.0f32)] {
                let mut mine = own.clone();
                p.finish_in_place(&mut mine, divisor);
                let want: Vec<f32> = want.iter().map(|&s| divisor.map_or(s, |k| s / k)).collect();
                prop_assert_eq!(bits(&mine), bits(&want));
            }
            prop_assert_eq!(&p, &LePieces::from_f32(&values));
        }
    }

    #[test]
    fn a_value_split_over_three_pieces_is_assembled() {
        let p = split(&[1.5, -2.25], &[1, 2, 3, 5]);
        assert_eq!(p.pieces.len(), 5);
        assert_eq!(p.to_f32(), vec![1.5, -2.25]);
    }
}
