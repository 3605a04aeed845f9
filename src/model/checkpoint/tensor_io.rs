//! Low-level safetensors and file-system helpers shared by the model and trainer-state files.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors, View};

/// A safetensors file smaller than this cannot even hold its header length.
const HEADER_LEN_BYTES: u64 = 8;

/// A borrowed F32 tensor: lets `serialize_to_file` stream each tensor straight from the flat buffer
/// instead of building a second copy of the whole model.
pub(crate) struct F32View<'a> {
    pub shape: Vec<usize>,
    pub data: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        f32_bytes(self.data)
    }

    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.data)
    }
}

/// The little-endian bytes of `data`: borrowed where the machine is little-endian (no copy).
#[cfg(target_endian = "little")]
fn f32_bytes(data: &[f32]) -> Cow<'_, [u8]> {
    Cow::Borrowed(bytemuck::cast_slice(data))
}

#[cfg(not(target_endian = "little"))]
fn f32_bytes(data: &[f32]) -> Cow<'_, [u8]> {
    Cow::Owned(data.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// Writes a safetensors file and fsyncs it, so that a later directory rename publishes complete data.
pub(crate) fn write_tensors(
    path: &Path,
    tensors: Vec<(String, F32View<'_>)>,
    meta: HashMap<String, String>,
) -> Result<()> {
    safetensors::serialize_to_file(tensors, Some(meta), path).with_context(|| format!("writing {}", path.display()))?;
    fsync_file(path)
}

/// Writes a small file and fsyncs it.
pub(crate) fn write_small_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    fsync_file(path)
}

pub(crate) fn fsync_file(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("fsync {}", path.display()))
}

/// Makes the entries of a directory (creations, renames, removals) durable.
#[cfg(unix)]
pub(crate) fn fsync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("fsync directory {}", path.display()))
}

/// Directories cannot be opened for fsync on this platform; renames there are as durable as the OS makes them.
#[cfg(not(unix))]
pub(crate) fn fsync_dir(_path: &Path) -> Result<()> {
    Ok(())
}

/// Reads a file that must be small (a config), refusing a huge one before allocating for it: at most
/// `max_bytes + 1` bytes are read, so that [`check_small`] can tell the file was too large.
pub(crate) fn read_small_file(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut bytes = Vec::new();
    file.take(max_bytes + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(bytes)
}

/// The text of a small file read whole (from disk or memory): at most `max_bytes` of UTF-8. `name` names
/// the file in messages.
pub(crate) fn check_small<'a>(bytes: &'a [u8], max_bytes: u64, name: &str) -> Result<&'a str> {
    if bytes.len() as u64 > max_bytes {
        bail!("{name} is larger than {max_bytes} bytes; it is not a model config");
    }
    std::str::from_utf8(bytes).with_context(|| format!("reading {name}: it is not UTF-8 text"))
}

/// Memory-maps a safetensors file and hands its parsed view to `f` (see [`with_safetensors_bytes`]).
///
/// Mapping instead of reading keeps a 500 MB model at one copy in memory. The file must not be truncated by
/// another process while it is mapped.
pub(crate) fn with_safetensors<R>(
    path: &Path,
    f: impl FnOnce(&SafeTensors<'_>, &HashMap<String, String>) -> Result<R>,
) -> Result<R> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the map is read-only and private to this call; we only read it through `SafeTensors`, which
    // bounds-checks every access. Concurrent truncation of the file by another process is not supported.
    let map = unsafe { Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))?;
    with_safetensors_bytes(&map, &path.display().to_string(), f)
}

/// Parses a whole safetensors file held in memory and hands its view and metadata to `f`. `name` names the
/// file in messages.
///
/// `safetensors` bounds the header at 100 MB, requires it to lie inside `bytes` and checks every tensor's
/// offsets against the length of `bytes`, so a corrupt header cannot make it allocate for data the file
/// does not hold.
pub(crate) fn with_safetensors_bytes<R>(
    bytes: &[u8],
    name: &str,
    f: impl FnOnce(&SafeTensors<'_>, &HashMap<String, String>) -> Result<R>,
) -> Result<R> {
    if (bytes.len() as u64) < HEADER_LEN_BYTES {
        bail!(
            "{name} is not a safetensors file: it has {} bytes, fewer than the 8-byte header length",
            bytes.len()
        );
    }
    let invalid = |e| anyhow::anyhow!("{name} is not a valid safetensors file: {e}");
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(invalid)?;
    let tensors = SafeTensors::deserialize(bytes).map_err(invalid)?;
    f(&tensors, header.metadata().as_ref().unwrap_or(&HashMap::new()))
}

/// Decodes a floating-point tensor into `dst`, converting F16 and BF16 to f32 exactly.
pub(crate) fn decode_into(view: &TensorView<'_>, key: &str, dst: &mut [f32]) -> Result<()> {
    decode_bytes(view.dtype(), view.data(), key, dst)
}

fn decode_bytes(dtype: Dtype, bytes: &[u8], key: &str, dst: &mut [f32]) -> Result<()> {
    let width = float_width(dtype, key)?;
    if bytes.len() != dst.len() * width {
        bail!(
            "tensor {key}: holds {} bytes, expected {} ({} {dtype:?} values)",
            bytes.len(),
            dst.len() * width,
            dst.len()
        );
    }
    match dtype {
        Dtype::F32 => decode_chunks::<4>(bytes, dst, f32::from_le_bytes),
        Dtype::F16 => decode_chunks::<2>(bytes, dst, |b| f16_to_f32(u16::from_le_bytes(b))),
        _ => decode_chunks::<2>(bytes, dst, |b| bf16_to_f32(u16::from_le_bytes(b))),
    }
    Ok(())
}

/// Whether a floating-point tensor holds exactly `expected` (bitwise after conversion to f32), decoding it
/// in small chunks rather than into a second full-size buffer.
pub(crate) fn decoded_equals(view: &TensorView<'_>, key: &str, expected: &[f32]) -> Result<bool> {
    const CHUNK: usize = 1 << 16;
    let (dtype, bytes) = (view.dtype(), view.data());
    let width = float_width(dtype, key)?;
    if bytes.len() != expected.len() * width {
        return Ok(false);
    }
    let mut scratch = vec![0f32; CHUNK.min(expected.len())];
    for (want, raw) in expected.chunks(CHUNK).zip(bytes.chunks(CHUNK * width)) {
        let got = &mut scratch[..want.len()];
        decode_bytes(dtype, raw, key, got)?;
        if got.iter().zip(want).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Bytes per element of the dtypes we accept as parameters.
pub(crate) fn float_width(dtype: Dtype, key: &str) -> Result<usize> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::F16 | Dtype::BF16 => Ok(2),
        other => bail!("tensor {key}: dtype {other:?} is not supported; expected F32, F16 or BF16"),
    }
}

fn decode_chunks<const N: usize>(bytes: &[u8], dst: &mut [f32], f: impl Fn([u8; N]) -> f32) {
    for (d, chunk) in dst.iter_mut().zip(bytes.chunks_exact(N)) {
        let mut b = [0u8; N];
        b.copy_from_slice(chunk);
        *d = f(b);
    }
}

/// bfloat16 is the top half of an f32, so widening is a shift.
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// IEEE half to single precision; every half value, subnormals and NaN payloads included, is exact in f32.
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    let bits = match exp {
        0 if mant == 0 => sign,
        0 => {
            // Subnormal half: mant * 2^-24, exact in f32 because mant < 2^10.
            let magnitude = mant as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -magnitude } else { magnitude };
        }
        0x1f => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
    }

    #[test]
    fn bf16_conversion() {
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc040), -3.0);
    }
}
