//! Device memory: the allocation table (tensors and token buffers, allocated, freed and transferred), the
//! segments of large allocations, and the few buffers the backend keeps for itself (the `sum_squares`
//! partial sums, the embedding backward's token index).
//!
//! An allocation is one storage buffer, or, past the adapter's `max_buffer_size` (capped at
//! [`MAX_SEGMENT_BYTES`](super::MAX_SEGMENT_BYTES)), several *segments* of at most that size; how views
//! are bound is `windows.rs`. A view's `buf` indexes the table; a freed entry stays empty, so ids are never
//! reused, and each wgpu buffer also has a [`BufferId`] from a counter for the bind-group cache, whose
//! entries binding a freed buffer are dropped with it.

use super::binding::BufferId;
use super::submit::Piece;
use super::windows::Win;
use super::{BackendError, TokenView, View, WgpuBackend};
use crate::backend::error::ensure_view;
use anyhow::Result;

/// A buffer the backend keeps, with the identity the bind-group cache knows it by.
#[derive(Clone)]
pub(super) struct Tracked {
    pub(super) id: BufferId,
    pub(super) buffer: wgpu::Buffer,
}

/// One allocation: segment `i` holds elements `[i * seg, min((i + 1) * seg, len))`.
pub(super) struct Alloc {
    pub(super) segs: Vec<Tracked>,
    pub(super) seg: usize,
    pub(super) len: usize,
}

impl Alloc {
    /// The pieces of `[first, end)`: (segment, element offset in the segment, offset in the range, length).
    pub(super) fn parts(&self, first: usize, end: usize) -> Vec<(usize, usize, usize, usize)> {
        let mut out = Vec::new();
        let mut at = first;
        while at < end {
            let s = at / self.seg;
            let stop = end.min((s + 1) * self.seg);
            out.push((s, at - s * self.seg, at - first, stop - at));
            at = stop;
        }
        out
    }

    pub(super) fn seg_len(&self, s: usize) -> usize {
        self.seg.min(self.len - s * self.seg)
    }
}

/// One token buffer: on the device, and the host copy the embedding backward groups positions from
/// (written only by `upload_tokens`).
pub(super) struct TokenBuffer {
    pub(super) device: Tracked,
    /// `[len]` token ids.
    pub(super) host: Vec<u32>,
}

/// The persistent index buffer of `encoder_backward`.
pub(super) struct EmbedIndex {
    pub(super) buf: Tracked,
    /// Capacity in u32 elements; the whole of it is bound, so the window (and bind group) never changes.
    pub(super) cap: usize,
    /// A dispatch recorded since the last submit reads it: the next rewrite must submit first, because a
    /// `write_buffer` lands before every command of the next submit.
    pub(super) read_by_pending: bool,
}

impl WgpuBackend {
    /// Allocation `buf`; panics when it was freed (a stale view is a programming error).
    pub(super) fn allocation(&self, buf: usize) -> &Alloc {
        self.bufs[buf]
            .as_ref()
            .unwrap_or_else(|| panic!("view into freed buffer {buf}"))
    }

    /// Token buffer `buf`; panics when it was freed.
    pub(super) fn token_buffer(&self, buf: usize) -> &TokenBuffer {
        self.tok_bufs[buf]
            .as_ref()
            .unwrap_or_else(|| panic!("view into freed token buffer {buf}"))
    }

    /// Bytes of the live tensor and token allocations.
    pub fn allocated_bytes(&self) -> u64 {
        let tensors: usize = self.bufs.iter().flatten().map(|a| a.len).sum();
        let tokens: usize = self.tok_bufs.iter().flatten().map(|t| t.host.len()).sum();
        (tensors + tokens) as u64 * 4
    }

    /// A new zero-filled allocation of `len` f32, in segments of `seg_elems`.
    pub(super) fn alloc_tensor(&mut self, len: usize) -> Result<View> {
        let seg = self.seg_elems;
        let mut segs = Vec::new();
        for s in 0..len.div_ceil(seg).max(1) {
            let buffer = self.new_buffer(seg.min(len - (s * seg).min(len)), "a tensor")?;
            segs.push(self.track(buffer));
        }
        self.bufs.push(Some(Alloc { segs, seg, len }));
        Ok(View {
            buf: self.bufs.len() - 1,
            offset: 0,
            len,
        })
    }

    /// A new zero-filled token buffer of `len` ids.
    pub(super) fn alloc_token_buffer(&mut self, len: usize) -> Result<TokenView> {
        let buffer = self.new_buffer(len, "a token buffer")?;
        let device = self.track(buffer);
        self.tok_bufs.push(Some(TokenBuffer {
            device,
            host: vec![0; len],
        }));
        Ok(TokenView {
            buf: self.tok_bufs.len() - 1,
            offset: 0,
            len,
        })
    }

    /// Drops allocation `buf` and every cached bind group binding one of its segments. wgpu keeps a
    /// buffer alive until the work recorded on it has run.
    pub(super) fn free_tensor(&mut self, buf: usize) {
        let alloc = self.bufs[buf]
            .take()
            .unwrap_or_else(|| panic!("buffer {buf} freed twice"));
        for seg in alloc.segs {
            self.bind_groups.forget(seg.id);
        }
    }

    /// Drops token buffer `buf` and every cached bind group binding it.
    pub(super) fn free_token_buffer(&mut self, buf: usize) {
        let tokens = self.tok_bufs[buf]
            .take()
            .unwrap_or_else(|| panic!("token buffer {buf} freed twice"));
        self.bind_groups.forget(tokens.device.id);
    }

    /// Writes `src` into `dst`, after the work recorded so far.
    pub(super) fn write_tensor(&mut self, dst: View, src: &[f32]) -> Result<()> {
        ensure_view!(
            src.len() == dst.len,
            "upload of {} values into a view of {}",
            src.len(),
            dst.len
        );
        ensure_view!(
            dst.end() <= self.allocation(dst.buf).len,
            "upload view {dst:?} out of bounds"
        );
        if src.is_empty() {
            return Ok(());
        }
        // Submit first: a `write_buffer` lands before every command of the next submit.
        self.flush();
        let a = self.allocation(dst.buf);
        for (s, local, at, n) in a.parts(dst.offset, dst.end()) {
            let bytes: &[u8] = bytemuck::cast_slice(&src[at..at + n]);
            self.ctx.queue.write_buffer(&a.segs[s].buffer, local as u64 * 4, bytes);
        }
        Ok(())
    }

    /// Writes `src` into `dst` and its host copy, after the work recorded so far.
    pub(super) fn write_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()> {
        ensure_view!(
            src.len() == dst.len,
            "upload of {} tokens into a view of {}",
            src.len(),
            dst.len
        );
        ensure_view!(
            dst.offset + dst.len <= self.token_buffer(dst.buf).host.len(),
            "token view {dst:?} out of bounds"
        );
        if src.is_empty() {
            return Ok(());
        }
        self.flush();
        let tokens = self.tok_bufs[dst.buf].as_mut().expect("checked above");
        tokens.host[dst.offset..dst.offset + dst.len].copy_from_slice(src);
        self.ctx
            .queue
            .write_buffer(&tokens.device.buffer, dst.offset as u64 * 4, bytemuck::cast_slice(src));
        Ok(())
    }

    /// Reads `src` into `dst` once the work recorded so far has run.
    pub(super) fn read_tensor(&mut self, src: View, dst: &mut [f32]) -> Result<()> {
        ensure_view!(
            dst.len() == src.len,
            "download of a view of {} into {} values",
            src.len,
            dst.len()
        );
        ensure_view!(
            src.end() <= self.allocation(src.buf).len,
            "download view {src:?} out of bounds"
        );
        if dst.is_empty() {
            return Ok(self.check_device_errors()?);
        }
        let bytes = self.read_back(&self.pieces(src))?;
        dst.copy_from_slice(bytemuck::cast_slice(&bytes));
        Ok(())
    }

    /// The byte ranges of the segments that hold `src`, in order.
    pub(super) fn pieces(&self, src: View) -> Vec<Piece> {
        let a = self.allocation(src.buf);
        a.parts(src.offset, src.end())
            .into_iter()
            .map(|(s, local, _, n)| (a.segs[s].buffer.clone(), local as u64 * 4, n as u64 * 4))
            .collect()
    }

    /// A new zero-filled storage buffer of `len` 4-byte elements. Fails with
    /// [`BackendError::ShapeUnsupported`] past the adapter's `max_buffer_size`, and with
    /// [`BackendError::OutOfMemory`] when the device has no room.
    pub(super) fn new_buffer(&self, len: usize, what: &str) -> Result<wgpu::Buffer, BackendError> {
        let bytes = (len as u64 * 4).max(4);
        if bytes > self.ctx.limits.max_buffer_size {
            return Err(BackendError::ShapeUnsupported {
                op: format!("allocating {what}"),
                detail: format!(
                    "of {bytes} bytes exceeds the {} bytes {} allows in one buffer",
                    self.ctx.limits.max_buffer_size, self.ctx.report.name
                ),
            });
        }
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
        self.create_buffer(what, bytes.div_ceil(4) * 4, usage)
    }

    /// A device buffer of `bytes` bytes, or [`BackendError::OutOfMemory`] naming `what` when the device has no
    /// room (the one place that turns wgpu's out-of-memory scope into an error).
    pub(super) fn create_buffer(
        &self,
        what: &str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer, BackendError> {
        let scope = self.ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes,
            usage,
            mapped_at_creation: false,
        });
        if pollster::block_on(scope.pop()).is_some() {
            return Err(BackendError::OutOfMemory {
                what: format!("{what} on {}", self.ctx.report.name),
                bytes: Some(bytes),
            });
        }
        Ok(buffer)
    }

    /// Gives `buffer` an identity for the bind-group cache.
    pub(super) fn track(&mut self, buffer: wgpu::Buffer) -> Tracked {
        Tracked {
            id: self.buffer_ids.next(),
            buffer,
        }
    }

    /// Writes `aux` to the start of the embedding index buffer (grown to a power of two when too small) and
    /// returns the window over its whole capacity.
    pub(super) fn write_embed_index(&mut self, aux: &[u32]) -> Win {
        if self.embed_index.as_ref().is_some_and(|ix| ix.read_by_pending) {
            self.flush();
        }
        if self.embed_index.as_ref().is_none_or(|ix| ix.cap < aux.len()) {
            let cap = aux
                .len()
                .next_power_of_two()
                .max(1024)
                .min(self.max_window_elems())
                .max(aux.len());
            let buffer = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("encoder_backward index"),
                size: cap as u64 * 4,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let buf = self.track(buffer);
            let fresh = EmbedIndex {
                buf,
                cap,
                read_by_pending: false,
            };
            if let Some(old) = self.embed_index.replace(fresh) {
                self.bind_groups.forget(old.buf.id);
            }
        }
        let ix = self.embed_index.as_mut().expect("just ensured");
        self.ctx
            .queue
            .write_buffer(&ix.buf.buffer, 0, bytemuck::cast_slice(aux));
        ix.read_by_pending = true;
        let (buffer, id, cap) = (ix.buf.buffer.clone(), ix.buf.id, ix.cap);
        self.win_of(&buffer, Some(id), cap, 0, cap)
    }

    /// A buffer of at least `blocks` elements for `sum_squares`' partial sums: the previous one when it is
    /// large enough, else a new one replacing it.
    pub(super) fn sum_squares_partials(&mut self, blocks: usize) -> Result<Tracked, BackendError> {
        self.scratch(|be| &mut be.partials, blocks, "sum_squares partials")
    }

    /// A buffer of at least `len` elements for split-K matmuls' partial products, kept like
    /// [`Self::sum_squares_partials`].
    pub(super) fn split_k_partials(&mut self, len: usize) -> Result<Tracked, BackendError> {
        self.scratch(|be| &mut be.split_k, len, "split-K partials")
    }

    /// The scratch buffer in `slot` when it holds `len` elements, else a new one replacing it.
    fn scratch(
        &mut self,
        slot: fn(&mut Self) -> &mut Option<(Tracked, usize)>,
        len: usize,
        label: &'static str,
    ) -> Result<Tracked, BackendError> {
        if let Some((kept, kept_len)) = slot(self) {
            if *kept_len >= len {
                return Ok(kept.clone());
            }
        }
        let buffer = self.new_buffer(len, label)?;
        let fresh = self.track(buffer);
        if let Some((old, _)) = slot(self).replace((fresh.clone(), len)) {
            // The old buffer is freed: its entries could never hit again but would keep its memory alive.
            self.bind_groups.forget(old.id);
        }
        Ok(fresh)
    }
}
