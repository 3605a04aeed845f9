//! The CUDA backend's own state, on top of a [`Gpu`]: the allocations behind views, the token buffers' host
//! copies, the grown-on-demand scratch buffers, and the first failure since the last synchronisation point.

use super::super::{BackendError, TokenView, View};
use super::driver::Driver;
use super::gpu::{Addr, Gpu};
use anyhow::Result;

/// One allocation (f32 or token).
pub(super) struct DeviceBuffer {
    /// Device address of element 0.
    pub(super) addr: Addr,
    /// Elements.
    pub(super) len: usize,
}

/// One token allocation, with the host copy the embedding backward groups positions by.
pub(super) struct TokenBuffer {
    pub(super) addr: Addr,
    /// host [len]: what `upload_tokens` wrote, the only writer of token buffers.
    pub(super) host: Vec<u32>,
}

/// A backend running every op on one CUDA device (`G` is the driver, or the tests' emulator).
pub struct CudaBackend<G: Gpu = Driver> {
    pub(super) gpu: G,
    /// The allocations, indexed by `View::buf`; `None` once freed (ids are never reused).
    pub(super) bufs: Vec<Option<DeviceBuffer>>,
    pub(super) tok_bufs: Vec<Option<TokenBuffer>>,
    /// `sum_squares`' per-block sums: partial [capacity], grown on demand.
    partials: Option<DeviceBuffer>,
    /// The embedding backward's token index `[rows | starts | positions]` (u32) [capacity], grown on demand.
    embed_index: Option<DeviceBuffer>,
    /// The first failure since the last synchronisation point.
    error: Option<BackendError>,
}

impl CudaBackend<Driver> {
    /// Opens CUDA device `ordinal` and compiles (or loads from the cache) every kernel.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self::on(Driver::open(ordinal)?))
    }
}

impl<G: Gpu> CudaBackend<G> {
    /// The backend on an opened device.
    pub(super) fn on(gpu: G) -> Self {
        CudaBackend {
            gpu,
            bufs: Vec::new(),
            tok_bufs: Vec::new(),
            partials: None,
            embed_index: None,
            error: None,
        }
    }

    /// Keeps the first failure until the next synchronisation point.
    pub(super) fn record(&mut self, result: Result<(), BackendError>) {
        if let Err(e) = result {
            self.error.get_or_insert(e);
        }
    }

    /// The first failure since the last synchronisation point, cleared.
    pub(super) fn take_error(&mut self) -> Result<()> {
        match self.error.take() {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// The allocation behind `buf`; panics when it was freed (a stale view is a programming error).
    fn buffer(&self, buf: usize) -> &DeviceBuffer {
        self.bufs
            .get(buf)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("view into freed or unknown CUDA buffer {buf}"))
    }

    /// The device address of `view`'s first element; panics when the view is out of its buffer.
    pub(super) fn addr(&self, view: View) -> Addr {
        let buffer = self.buffer(view.buf);
        assert!(
            view.end() <= buffer.len,
            "view {view:?} out of a buffer of {}",
            buffer.len
        );
        buffer.addr + 4 * view.offset as u64
    }

    /// The device address of `view`'s first token.
    pub(super) fn token_addr(&self, view: TokenView) -> Addr {
        let buffer = self.token_buffer(view.buf);
        assert!(
            view.offset + view.len <= buffer.host.len(),
            "token view {view:?} out of its buffer"
        );
        buffer.addr + 4 * view.offset as u64
    }

    pub(super) fn token_buffer(&self, buf: usize) -> &TokenBuffer {
        self.tok_bufs
            .get(buf)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("view into freed or unknown CUDA token buffer {buf}"))
    }

    /// A device buffer of at least `len` words in `which`, grown (never shrunk) as needed.
    pub(super) fn scratch(&mut self, which: Scratch, len: usize) -> Result<Addr, BackendError> {
        if let Some(buffer) = self.scratch_slot(which).as_ref().filter(|b| b.len >= len) {
            return Ok(buffer.addr);
        }
        let len = len.next_power_of_two();
        let addr = self.gpu.alloc(len, "a scratch buffer")?;
        if let Some(old) = self.scratch_slot(which).replace(DeviceBuffer { addr, len }) {
            let freed = self.gpu.free(old.addr);
            self.record(freed);
        }
        Ok(addr)
    }

    fn scratch_slot(&mut self, which: Scratch) -> &mut Option<DeviceBuffer> {
        match which {
            Scratch::Partials => &mut self.partials,
            Scratch::EmbedIndex => &mut self.embed_index,
        }
    }
}

/// The backend's grown-on-demand device buffers.
#[derive(Clone, Copy)]
pub(super) enum Scratch {
    Partials,
    EmbedIndex,
}

impl<G: Gpu> Drop for CudaBackend<G> {
    fn drop(&mut self) {
        let buffers = self.bufs.drain(..).flatten().map(|b| b.addr);
        let tokens = self.tok_bufs.drain(..).flatten().map(|b| b.addr);
        let scratch = [self.partials.take(), self.embed_index.take()]
            .into_iter()
            .flatten()
            .map(|b| b.addr);
        for addr in buffers.chain(tokens).chain(scratch).collect::<Vec<_>>() {
            // Nobody is left to tell of a failure.
            let _ = self.gpu.free(addr);
        }
        let _ = self.gpu.synchronize();
    }
}
