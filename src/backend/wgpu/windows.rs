//! Windows: how a view is bound. A [`View`] is bound as a *window* of its segment: the binding starts at
//! the view's offset rounded down to `min_storage_buffer_offset_alignment`, and the remaining element offset
//! travels in the kernel's uniform parameters (so no 256-byte binding alignment is needed). A window that
//! straddles two segments (rare: the views that cross a segment boundary) is gathered into a temporary
//! buffer before the dispatch and written back after it (`submit.rs`). Ops whose windows would exceed
//! `max_storage_buffer_binding_size` split their work; the helpers here say how much one window holds.

use super::binding::BufferId;
use super::{TokenView, View, WgpuBackend};

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

impl WgpuBackend {
    /// Largest number of elements a window may cover wherever it starts.
    pub(super) fn max_window_elems(&self) -> usize {
        ((self.max_binding - self.align) / 4) as usize
    }

    /// Whether elements `[first, end)` of one buffer fit one window.
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
        let a = self.allocation(buf);
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

    /// Window over view `v`.
    pub(super) fn win(&mut self, v: View) -> Win {
        self.win_range(v.buf, v.offset, v.end())
    }

    /// Window over token view `v`.
    pub(super) fn twin(&self, v: TokenView) -> Win {
        let b = self.token_buffer(v.buf);
        self.win_of(
            &b.device.buffer,
            Some(b.device.id),
            b.host.len(),
            v.offset,
            v.offset + v.len,
        )
    }

    /// A window binding nothing the kernel reads: for an absent operand or an empty range.
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
    fn rows_per_window(&self, row_len: usize) -> usize {
        (self.max_window_elems() / row_len.max(1)).max(1)
    }

    /// The row ranges `[r0, r1)` of a `[rows, row_len]` tensor, in order, each as many rows as one window holds.
    pub(super) fn row_windows(&self, rows: usize, row_len: usize) -> impl Iterator<Item = (usize, usize)> {
        let per = self.rows_per_window(row_len);
        (0..rows).step_by(per).map(move |r0| (r0, (r0 + per).min(rows)))
    }
}
