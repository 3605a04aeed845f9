//! Compact wire formats for reduced values (`--wire f32|bf16|int8`).
//!
//! A reducing ring collective ([`super::RingOp::AllReduce`], [`super::RingOp::ReduceScatter`]) may send its
//! values in a compact format instead of f32. The engine sums in f32 and rounds only what it sends, at
//! fixed points (see `ring.rs`, "Compact wire formats"), so every rank still computes the same bits.
//!
//! - **bf16**: each value rounded to nearest, ties to even, to bfloat16 (the top 16 bits of an f32); NaN
//!   stays NaN, overflow rounds to infinity. One rounding moves a value by at most `2^-8 |x|`.
//! - **int8**: blocks of [`INT8_BLOCK`] values, each sent as an f32 scale (`max |x| / 127` over the block,
//!   little-endian) and one signed byte per value, `round_ties_even(x / scale)` clamped to ±127; decoded as
//!   `q * scale`. One rounding moves a value by at most `max |x| / 254` of its block (plus f32 rounding of
//!   the scale). A block holding a non-finite value is sent with a NaN scale and decodes to NaN, so a
//!   non-finite gradient is still seen as one by every rank. A sub-chunk of `n` values takes
//!   `4 ceil(n / 64) + n` bytes: scales first, then the bytes.
//!
//! Error bound of a ring sum over `N` ranks (f32 rounding aside): the partial sum is rounded at each of the
//! `N - 1` hops and an all-reduce's finished sum once more, each partial bounded by `S = sum_i |x_i|`, so
//! `|result - exact| <= N * 2^-8 * S` for bf16, and `<= N * max_block(S) / 254` for int8, where
//! `max_block(S)` is the largest `S` within the value's block. A mean divides both sides by `N`.
//! `tests/wire.rs` checks both bounds.

use std::fmt;

/// Values per int8 block (one f32 scale each).
pub const INT8_BLOCK: usize = 64;

/// How a reducing collective's values travel between ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Wire {
    /// Plain little-endian f32 (exact; the default).
    #[default]
    F32,
    /// bfloat16, rounded to nearest even: half the bytes.
    Bf16,
    /// Blockwise-scaled int8: a little over a quarter of the bytes.
    Int8,
}

impl Wire {
    pub fn as_str(self) -> &'static str {
        match self {
            Wire::F32 => "f32",
            Wire::Bf16 => "bf16",
            Wire::Int8 => "int8",
        }
    }

    /// Whether values are rounded on the way (every format but f32).
    pub fn is_compact(self) -> bool {
        self != Wire::F32
    }

    /// Bytes that `n` values take in this format.
    pub fn encoded_len(self, n: usize) -> usize {
        match self {
            Wire::F32 => 4 * n,
            Wire::Bf16 => 2 * n,
            Wire::Int8 => 4 * n.div_ceil(INT8_BLOCK) + n,
        }
    }

    /// `values` in this format, appended to `out`.
    pub fn encode(self, values: &[f32], out: &mut Vec<u8>) {
        out.reserve(self.encoded_len(values.len()));
        match self {
            Wire::F32 => values.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Wire::Bf16 => values
                .iter()
                .for_each(|&x| out.extend_from_slice(&bf16_bits(x).to_le_bytes())),
            Wire::Int8 => {
                let scales: Vec<f32> = values.chunks(INT8_BLOCK).map(int8_scale).collect();
                scales.iter().for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
                for (block, &scale) in values.chunks(INT8_BLOCK).zip(&scales) {
                    out.extend(block.iter().map(|&x| int8_quantize(x, scale) as u8));
                }
            }
        }
    }

    /// Decodes `bytes` into `out`; the length must be exactly [`Wire::encoded_len`] of `out.len()`.
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) -> Result<(), WireError> {
        let want = self.encoded_len(out.len());
        if bytes.len() != want {
            return Err(WireError {
                wire: self,
                got: bytes.len(),
                want,
                values: out.len(),
            });
        }
        match self {
            Wire::F32 => {
                for (d, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Wire::Bf16 => {
                for (d, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
                }
            }
            Wire::Int8 => {
                let (scales, q) = bytes.split_at(4 * out.len().div_ceil(INT8_BLOCK));
                for ((block, qs), s) in out
                    .chunks_mut(INT8_BLOCK)
                    .zip(q.chunks(INT8_BLOCK))
                    .zip(scales.chunks_exact(4))
                {
                    let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    for (d, &b) in block.iter_mut().zip(qs) {
                        *d = f32::from(b as i8) * scale;
                    }
                }
            }
        }
        Ok(())
    }

    /// `values` in this format (the message to send), with `values` replaced by exactly what the receiver
    /// decodes: the owner of a finished sum keeps the bits every other rank will get.
    pub fn round_in_place(self, values: &mut [f32]) -> Vec<u8> {
        let mut bytes = Vec::new();
        self.encode(values, &mut bytes);
        self.decode(&bytes, values).expect("encoded length matches");
        bytes
    }
}

impl fmt::Display for Wire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A compact payload whose length does not fit the values it should hold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{wire} payload of {got} bytes, expected {want} for {values} values")]
pub struct WireError {
    pub wire: Wire,
    pub got: usize,
    pub want: usize,
    pub values: usize,
}

/// bfloat16 bits of `x`, rounded to nearest, ties to even (a NaN stays a quiet NaN of the same sign).
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    // Adding 0x7fff plus the lowest kept bit rounds the dropped half to nearest even; a carry into the
    // exponent is the correct rounding (up to infinity past the largest bf16).
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// The scale of one int8 block: `max |x| / 127`; NaN when the block holds a non-finite value.
fn int8_scale(block: &[f32]) -> f32 {
    let mut max = 0f32;
    for &x in block {
        if !x.is_finite() {
            return f32::NAN;
        }
        max = max.max(x.abs());
    }
    max / 127.0
}

fn int8_quantize(x: f32, scale: f32) -> i8 {
    if scale.is_nan() || scale == 0.0 {
        // A NaN scale decodes every value to NaN whatever the byte; a zero scale means an all-zero block.
        return 0;
    }
    (x / scale).round_ties_even().clamp(-127.0, 127.0) as i8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_specials() {
        let round = |x: f32| Wire::Bf16.round_in_place(&mut [x]);
        let decoded = |x: f32| {
            let mut v = [x];
            Wire::Bf16.round_in_place(&mut v);
            v[0]
        };
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even neighbour, 1.
        assert_eq!(decoded(1.0 + 2f32.powi(-8)), 1.0);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: the even neighbour is 1 + 2^-6.
        assert_eq!(decoded(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(decoded(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 1.0 + 2f32.powi(-7));
        assert_eq!(decoded(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(decoded(f32::INFINITY), f32::INFINITY);
        assert_eq!(
            decoded(f32::MAX),
            f32::INFINITY,
            "past the largest bf16 rounds to infinity"
        );
        assert!(decoded(f32::NAN).is_nan());
        assert!(decoded(-f32::NAN).is_nan());
        assert_eq!(round(1.0), 0x3f80u16.to_le_bytes().to_vec());
    }

    #[test]
    fn int8_blocks_carry_their_scale_and_bound_the_error() {
        let values: Vec<f32> = (0..150).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let mut got = values.clone();
        let bytes = Wire::Int8.round_in_place(&mut got);
        assert_eq!(bytes.len(), 3 * 4 + 150);
        for (block, (orig, dec)) in values.chunks(INT8_BLOCK).zip(got.chunks(INT8_BLOCK)).enumerate() {
            let max = orig.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in orig.iter().zip(dec) {
                assert!((x - y).abs() <= max / 254.0 * 1.0001, "block {block}: {x} -> {y}");
            }
        }
        // Encoding what was decoded gives the same bytes back only where the scale survives; the owner
        // keeps the decoded values and sends the first bytes, so nothing depends on that.
        let mut zeros = vec![0.0f32; 10];
        Wire::Int8.round_in_place(&mut zeros);
        assert!(zeros.iter().all(|&z| z == 0.0));
        let mut with_inf = vec![1.0, f32::INFINITY, 2.0];
        Wire::Int8.round_in_place(&mut with_inf);
        assert!(with_inf.iter().all(|x| x.is_nan()), "a non-finite block decodes to NaN");
    }

    #[test]
    fn decoding_checks_the_length() {
        let mut out = [0f32; 65];
        assert_eq!(Wire::Int8.encoded_len(65), 8 + 65);
        assert!(Wire::Int8.decode(&[0; 72], &mut out).is_err());
        assert!(Wire::Bf16.decode(&[0; 129], &mut out).is_err());
        assert!(Wire::F32.decode(&[0; 260], &mut out).is_ok());
        for name in ["f32", "bf16", "int8"] {
            let parsed = <Wire as clap::ValueEnum>::from_str(name, false).unwrap();
            assert_eq!(parsed.as_str(), name, "the flag's names are the display names");
            assert_eq!(serde_json::to_string(&parsed).unwrap(), format!("\"{name}\""));
        }
    }
}
