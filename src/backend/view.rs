//! Views: a buffer id plus an element range. Cheap to copy; the backend owns the memory.

/// An f32 range of a backend buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct View {
    pub buf: usize,
    pub offset: usize,
    pub len: usize,
}

/// A token (u32) range of a backend token buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TokenView {
    pub buf: usize,
    pub offset: usize,
    pub len: usize,
}

impl View {
    /// The sub-range `[start, start + len)` of this view.
    pub fn sub(&self, start: usize, len: usize) -> View {
        assert!(
            start + len <= self.len,
            "sub-view [{start}, {}) out of a view of {}",
            start + len,
            self.len
        );
        View {
            buf: self.buf,
            offset: self.offset + start,
            len,
        }
    }

    pub fn end(&self) -> usize {
        self.offset + self.len
    }

    pub fn overlaps(&self, other: &View) -> bool {
        self.buf == other.buf && self.len > 0 && other.len > 0 && self.offset < other.end() && other.offset < self.end()
    }
}

impl TokenView {
    pub fn sub(&self, start: usize, len: usize) -> TokenView {
        assert!(
            start + len <= self.len,
            "sub-view [{start}, {}) out of a view of {}",
            start + len,
            self.len
        );
        TokenView {
            buf: self.buf,
            offset: self.offset + start,
            len,
        }
    }
}
