//! Device memory: allocations and their segments, the windows that bind views, and the few buffers the
//! backend keeps for itself (the `sum_squares` partial sums, the embedding backward's token index).
//!
//! An allocation is one storage buffer, or, past the adapter's `max_buffer_size` (capped at
//! [`MAX_SEGMENT_BYTES`](super::MAX_SEGMENT_BYTES)), several *segments* of at most that size. A [`View`] is bound as a *window* of
//! its segment: the binding starts at the view's offset rounded down to
//! `min_storage_buffer_offset_alignment`, and the remaining element offset travels in the kernel's
//! uniform parameters. A window that straddles two segments (rare: the views that cross a segment
//! boundary) is gathered into a temporary buffer before the dispatch and written back after it. Ops whose
//! windows would exceed `max_storage_buffer_binding_size` split their work (see the ops); the helpers
//! here say how much one window holds.

use super::binding::BufferId;
use super::{TokenView, View, WgpuBackend};
use anyhow::{bail, ensure, Result};

/// A buffer the backend keeps, with the identity the bind-group cache knows it by.
#[derive(Clone)]
pub(super) struct Tracked {
    pub(super) id: BufferId,
    pub(super) buffer: wgpu::Buffer,
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

/// A bound range of a buffer: `size` bytes from byte `start`; the view begins `off` elements into it.
/// `id` is `None` for a temporary buffer, whose bind groups are not cached.
/// `scatter` is set when the range straddles segments of an allocation and `buffer` is a temporary copy of
/// elements `[first, end)` of allocation `buf`: the copy is written back after each dispatch that binds it.
#[derive(Clone)]
pub(super) struct Win {
    pub(super) buffer: wgpu::Buffer,
    pub(super) id: Option<BufferId>,
    pub(super) start: u64,
    pub(super) size: u64,
    pub(super) off: u32,
    pub(super) scatter: Option<(usize, usize, usize)>,
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

    fn seg_len(&self, s: usize) -> usize {
        self.seg.min(self.len - s * self.seg)
    }
}

impl WgpuBackend {
    /// Largest number of elements a window may cover wherever it starts.
    pub(super) fn max_window_elems(&self) -> usize {
        ((self.max_binding - self.align) / 4) as usize
    }

    pub(super) fn fits(&self, first: usize, end: usize) -> bool {
        let start = (first as u64 * 4) / self.align * self.align;
        (end as u64 * 4).max(start + 4) - start <= self.max_binding
    }

    /// Window over elements `[first, end)` of `buffer` (of `buf_len` elements); `id` as in [`Win`].
    pub(super) fn win_of(
        &self,
        buffer: &wgpu::Buffer,
        id: Option<BufferId>,
        buf_len: usize,
        first: usize,
        end: usize,
    ) -> Win {
        assert!(end <= buf_len, "range [{first}, {end}) out of a buffer of {buf_len}");
        if first == end {
            return self.dummy_win();
        }
        let start = (first as u64 * 4) / self.align * self.align;
        let size = end as u64 * 4 - start;
        assert!(
            size <= self.max_binding,
            "a {size}-byte window exceeds the adapter's storage binding limit of {} bytes",
            self.max_binding
        );
        Win {
            buffer: buffer.clone(),
            id,
            start,
            size,
            off: ((first as u64 * 4 - start) / 4) as u32,
            scatter: None,
        }
    }

    /// Window over elements `[first, end)` of allocation `buf`. A range straddling two segments is gathered
    /// into a temporary buffer (and written back after each dispatch that binds it).
    pub(super) fn win_range(&mut self, buf: usize, first: usize, end: usize) -> Win {
        let a = &self.bufs[buf];
        assert!(end <= a.len, "range [{first}, {end}) out of an allocation of {}", a.len);
        if first == end {
            return self.dummy_win();
        }
        let (s0, s1) = (first / a.seg, (end - 1) / a.seg);
        if s0 == s1 {
            let base = s0 * a.seg;
            let (seg, seg_len) = (a.segs[s0].clone(), a.seg_len(s0));
            return self.win_of(&seg.buffer, Some(seg.id), seg_len, first - base, end - base);
        }
        let parts = a.parts(first, end);
        let segs: Vec<wgpu::Buffer> = parts.iter().map(|p| a.segs[p.0].buffer.clone()).collect();
        let len = end - first;
        assert!(
            len as u64 * 4 <= self.max_binding,
            "a {}-byte window exceeds the adapter's storage binding limit of {} bytes",
            len * 4,
            self.max_binding
        );
        let temp = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("straddling view"),
            size: len as u64 * 4,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let enc = self.encoder();
        for ((_, local, at, n), seg) in parts.iter().zip(&segs) {
            enc.copy_buffer_to_buffer(seg, *local as u64 * 4, &temp, *at as u64 * 4, *n as u64 * 4);
        }
        Win {
            buffer: temp,
            id: None,
            start: 0,
            size: len as u64 * 4,
            off: 0,
            scatter: Some((buf, first, end)),
        }
    }

    pub(super) fn win(&mut self, v: View) -> Win {
        self.win_range(v.buf, v.offset, v.end())
    }

    pub(super) fn twin(&self, v: TokenView) -> Win {
        let (b, len) = &self.tok_bufs[v.buf];
        self.win_of(&b.buffer, Some(b.id), *len, v.offset, v.offset + v.len)
    }

    pub(super) fn dummy_win(&self) -> Win {
        Win {
            buffer: self.dummy.buffer.clone(),
            id: Some(self.dummy.id),
            start: 0,
            size: 4,
            off: 0,
            scatter: None,
        }
    }

    /// Rows of `[rows, row_len]` that one window can hold.
    pub(super) fn rows_per_window(&self, row_len: usize) -> usize {
        (self.max_window_elems() / row_len.max(1)).max(1)
    }

    pub(super) fn new_buffer(&self, len: usize, what: &str) -> Result<wgpu::Buffer> {
        let bytes = (len as u64 * 4).max(4);
        ensure!(
            bytes <= self.ctx.limits.max_buffer_size,
            "cannot allocate {what} of {bytes} bytes: {} allows buffers of at most {} bytes",
            self.ctx.report.name,
            self.ctx.limits.max_buffer_size
        );
        let scope = self.ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes.div_ceil(4) * 4,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!(
                "cannot allocate {what} of {bytes} bytes on {}: {e}",
                self.ctx.report.name
            );
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
    pub(super) fn sum_squares_partials(&mut self, blocks: usize) -> Result<Tracked> {
        if let Some((partials, len)) = &self.partials {
            if *len >= blocks {
                return Ok(partials.clone());
            }
        }
        let buffer = self.new_buffer(blocks, "sum_squares partials")?;
        let partials = self.track(buffer);
        if let Some((old, _)) = self.partials.replace((partials.clone(), blocks)) {
            // The old buffer is freed: its entries could never hit again but would keep its memory alive.
            self.bind_groups.forget(old.id);
        }
        Ok(partials)
    }
}
