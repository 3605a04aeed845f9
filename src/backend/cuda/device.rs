//! The CUDA backend's state: the context, the streams, the kernels, the allocations, and the transfers.

use super::super::{BackendError, TokenView, View};
use super::api::{self, check, DeviceInfo, Library};
use super::blas::Blas;
use super::compile;
use super::readback::Readbacks;
use anyhow::Result;
use cudarc::driver::sys as cu;
use std::collections::HashMap;

/// Threads per block of every kernel (`WG` in kernels/common.cuh).
pub(super) const WG: usize = 256;

/// One f32 allocation.
pub(super) struct DeviceBuffer {
    /// Device address of element 0.
    pub(super) ptr: cu::CUdeviceptr,
    /// Elements.
    pub(super) len: usize,
}

/// One token allocation, with the host copy the embedding backward groups positions by.
pub(super) struct TokenBuffer {
    pub(super) ptr: cu::CUdeviceptr,
    /// host [len]: what `upload_tokens` wrote, the only writer of token buffers.
    pub(super) host: Vec<u32>,
}

/// A backend running every op on one CUDA device.
pub struct CudaBackend {
    pub(super) info: DeviceInfo,
    ordinal: usize,
    /// The device's primary context, retained for the backend's life.
    pub(super) context: cu::CUcontext,
    /// Every op, copy in and cuBLAS call, in program order.
    pub(super) compute: cu::CUstream,
    /// Read-backs begun early (`begin_download`), ordered after the compute work before them by events.
    pub(super) copy: cu::CUstream,
    modules: Vec<cu::CUmodule>,
    /// Every kernel by name.
    pub(super) kernels: HashMap<&'static str, cu::CUfunction>,
    pub(super) blas: Option<Blas>,
    /// The allocations, indexed by `View::buf`; `None` once freed (ids are never reused).
    pub(super) bufs: Vec<Option<DeviceBuffer>>,
    pub(super) tok_bufs: Vec<Option<TokenBuffer>>,
    /// `sum_squares`' per-block sums: partial [capacity], grown on demand.
    pub(super) partials: Option<DeviceBuffer>,
    /// The embedding backward's token index `[rows | starts | positions]` (u32) [capacity], grown on demand.
    pub(super) embed_index: Option<DeviceBuffer>,
    pub(super) readbacks: Readbacks,
    /// The first failure since the last synchronisation point.
    pub(super) error: Option<BackendError>,
}

// SAFETY: the CUDA driver API may be called from any thread; every entry point makes the backend's context
// current on the calling thread first (`bind`), and `&mut self` keeps calls from overlapping.
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    /// Opens device `ordinal`: its primary context, two streams, cuBLAS, and every kernel compiled for its
    /// architecture (from the cache when it has them).
    pub fn new(ordinal: usize) -> Result<Self> {
        let info = api::device_info(ordinal)?;
        // Checked before any allocation, so the message names the missing library, not a failed call.
        api::require(Library::Nvrtc)?;
        api::require(Library::Cublas)?;
        let mut context: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is initialised (`device_info`) and `info.handle` is a valid device.
        check(
            unsafe { cu::cuDevicePrimaryCtxRetain(&mut context, info.handle) },
            "retaining the device's context",
        )?;
        let mut backend = CudaBackend {
            info,
            ordinal,
            context,
            compute: std::ptr::null_mut(),
            copy: std::ptr::null_mut(),
            modules: Vec::new(),
            kernels: HashMap::new(),
            blas: None,
            bufs: Vec::new(),
            tok_bufs: Vec::new(),
            partials: None,
            embed_index: None,
            readbacks: Readbacks::default(),
            error: None,
        };
        // From here on `Drop` releases whatever was made.
        backend.bind()?;
        for stream in [&mut backend.compute, &mut backend.copy] {
            // SAFETY: the context is current; `stream` is a valid out-pointer. Non-blocking: the legacy default
            // stream, which nothing here uses, must not serialise them.
            check(
                unsafe { cu::cuStreamCreate(stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
                "creating a CUDA stream",
            )?;
        }
        backend.load_kernels()?;
        backend.blas = Some(Blas::new(backend.compute)?);
        Ok(backend)
    }

    /// Makes the backend's context current on this thread (cheap; needed when the backend moved threads).
    pub(super) fn bind(&self) -> Result<(), BackendError> {
        // SAFETY: the context was retained by `new` and is released only by `Drop`.
        check(
            unsafe { cu::cuCtxSetCurrent(self.context) },
            "making the CUDA context current",
        )
    }

    /// Compiles (or loads from the cache) every family and looks up its kernels.
    fn load_kernels(&mut self) -> Result<()> {
        for (stem, source) in compile::FAMILIES {
            let cubin = compile::cubin(stem, source, self.info.capability)?;
            let mut module: cu::CUmodule = std::ptr::null_mut();
            // SAFETY: the context is current; `cubin` is a complete CUBIN image (NVRTC's output, or a cache
            // file whose hash matched) that outlives the call.
            check(
                unsafe { cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const _) },
                &format!(
                    "loading kernels/{stem}.cu's native code for sm_{}{}",
                    self.info.capability.0, self.info.capability.1
                ),
            )?;
            self.modules.push(module);
            for name in compile::kernel_names(source) {
                let c_name = std::ffi::CString::new(name).expect("kernel names hold no NUL");
                let mut function: cu::CUfunction = std::ptr::null_mut();
                // SAFETY: `module` was loaded above; the name is NUL-terminated.
                check(
                    unsafe { cu::cuModuleGetFunction(&mut function, module, c_name.as_ptr()) },
                    &format!("finding kernel {name} in kernels/{stem}.cu"),
                )?;
                let name: &'static str = compile::FAMILIES
                    .iter()
                    .flat_map(|(_, s)| compile::kernel_names(s))
                    .find(|n| *n == name)
                    .expect("the name came from a family");
                self.kernels.insert(name, function);
            }
        }
        Ok(())
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

    /// Waits for the compute stream, then returns the first failure.
    pub(super) fn wait_compute(&mut self) -> Result<()> {
        let status = self.bind().and_then(|()| {
            // SAFETY: the stream lives as long as the backend.
            check(unsafe { cu::cuStreamSynchronize(self.compute) }, "waiting for the GPU")
        });
        self.record(status);
        self.take_error()
    }

    /// The allocation behind `buf`; panics when it was freed (a stale view is a programming error).
    pub(super) fn buffer(&self, buf: usize) -> &DeviceBuffer {
        self.bufs
            .get(buf)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("view into freed or unknown CUDA buffer {buf}"))
    }

    /// The device address of `view`'s first element; panics when the view is out of its buffer.
    pub(super) fn ptr(&self, view: View) -> cu::CUdeviceptr {
        let buffer = self.buffer(view.buf);
        assert!(
            view.end() <= buffer.len,
            "view {view:?} out of a buffer of {}",
            buffer.len
        );
        buffer.ptr + 4 * view.offset as u64
    }

    /// The device address of `view`'s first token.
    pub(super) fn token_ptr(&self, view: TokenView) -> cu::CUdeviceptr {
        let buffer = self.token_buffer(view.buf);
        assert!(
            view.offset + view.len <= buffer.host.len(),
            "token view {view:?} out of its buffer"
        );
        buffer.ptr + 4 * view.offset as u64
    }

    pub(super) fn token_buffer(&self, buf: usize) -> &TokenBuffer {
        self.tok_bufs
            .get(buf)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("view into freed or unknown CUDA token buffer {buf}"))
    }

    /// `len` zero-filled 4-byte elements on the compute stream (at least one, so every buffer has an address).
    pub(super) fn alloc_words(&mut self, len: usize, what: &str) -> Result<cu::CUdeviceptr> {
        self.bind()?;
        let bytes = len.max(1).checked_mul(4).ok_or_else(|| BackendError::OutOfMemory {
            what: what.to_string(),
            bytes: None,
        })?;
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: the context is current, the stream is live, `ptr` is a valid out-pointer.
        check(unsafe { cu::cuMemAllocAsync(&mut ptr, bytes, self.compute) }, what).map_err(|e| match e {
            BackendError::OutOfMemory { what, .. } => BackendError::OutOfMemory {
                what,
                bytes: Some(bytes as u64),
            },
            other => other,
        })?;
        // SAFETY: `ptr` holds `len.max(1)` words, allocated on this stream just above.
        check(unsafe { cu::cuMemsetD32Async(ptr, 0, len.max(1), self.compute) }, what)?;
        Ok(ptr)
    }

    /// Frees `ptr` in stream order, after every read-back that may still copy from it.
    pub(super) fn free_words(&mut self, ptr: cu::CUdeviceptr) {
        let result = self.bind().and_then(|()| {
            self.readbacks.order_before(self.copy, self.compute)?;
            // SAFETY: `ptr` came from `cuMemAllocAsync` and is freed once; work queued on it completes first.
            check(unsafe { cu::cuMemFreeAsync(ptr, self.compute) }, "freeing GPU memory")
        });
        self.record(result);
    }

    /// Copies `src` into device words at `dst`, in stream order. Pageable memory is staged before the call
    /// returns, so `src` may change afterwards.
    pub(super) fn copy_in<T: Copy>(&mut self, dst: cu::CUdeviceptr, src: &[T]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` holds `size_of_val(src)` bytes (callers check the view's bounds); `src` is valid for
        // the call, and CUDA stages pageable memory before returning.
        check(
            unsafe {
                cu::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const _, std::mem::size_of_val(src), self.compute)
            },
            "copying to the GPU",
        )
    }

    /// Reads `dst.len()` floats from `src` on the compute stream and waits for them.
    pub(super) fn copy_out(&mut self, src: cu::CUdeviceptr, dst: &mut [f32]) -> Result<()> {
        if !dst.is_empty() {
            self.bind()?;
            // SAFETY: `src` holds `dst.len()` floats (callers check the view's bounds); a copy into pageable
            // memory returns only once it is complete, and `wait_compute` waits anyway.
            let status = unsafe {
                cu::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr() as *mut _,
                    src,
                    std::mem::size_of_val(dst),
                    self.compute,
                )
            };
            self.record(check(status, "copying from the GPU"));
        }
        self.wait_compute()
    }

    /// A device buffer of at least `len` words in `slot`, grown (never shrunk) as needed.
    pub(super) fn scratch(&mut self, which: Scratch, len: usize) -> Result<cu::CUdeviceptr> {
        let current = match which {
            Scratch::Partials => &self.partials,
            Scratch::EmbedIndex => &self.embed_index,
        };
        if let Some(buffer) = current.as_ref().filter(|b| b.len >= len) {
            return Ok(buffer.ptr);
        }
        let len = len.next_power_of_two();
        let ptr = self.alloc_words(len, "a scratch buffer")?;
        let old = match which {
            Scratch::Partials => self.partials.replace(DeviceBuffer { ptr, len }),
            Scratch::EmbedIndex => self.embed_index.replace(DeviceBuffer { ptr, len }),
        };
        if let Some(old) = old {
            self.free_words(old.ptr);
        }
        Ok(ptr)
    }

    /// Free device memory in bytes, as the driver reports it.
    pub(super) fn free_memory(&self) -> Option<u64> {
        self.bind().ok()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: the context is current; both are valid out-pointers.
        check(
            unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) },
            "asking free GPU memory",
        )
        .ok()?;
        Some(free as u64)
    }

    /// A short name, e.g. `cuda (NVIDIA H200, sm_90, 139.8 GiB)`.
    pub(super) fn describe(&self) -> String {
        format!(
            "cuda (device {}: {}, sm_{}{}, {:.1} GiB)",
            self.ordinal,
            self.info.name,
            self.info.capability.0,
            self.info.capability.1,
            self.info.total_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

/// The backend's grown-on-demand device buffers.
#[derive(Clone, Copy)]
pub(super) enum Scratch {
    Partials,
    EmbedIndex,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: everything below was made by this backend in this context and is released once, after the
        // streams finished all queued work; errors are ignored (there is nobody left to tell).
        unsafe {
            if !self.compute.is_null() {
                cu::cuStreamSynchronize(self.compute);
            }
            if !self.copy.is_null() {
                cu::cuStreamSynchronize(self.copy);
            }
            self.readbacks.release();
            self.blas = None;
            let buffers = self.bufs.drain(..).flatten().map(|b| b.ptr);
            let tokens = self.tok_bufs.drain(..).flatten().map(|b| b.ptr);
            let scratch = [self.partials.take(), self.embed_index.take()]
                .into_iter()
                .flatten()
                .map(|b| b.ptr);
            for ptr in buffers.chain(tokens).chain(scratch).collect::<Vec<_>>() {
                cu::cuMemFreeAsync(ptr, self.compute);
            }
            for stream in [self.compute, self.copy] {
                if !stream.is_null() {
                    cu::cuStreamSynchronize(stream);
                    cu::cuStreamDestroy_v2(stream);
                }
            }
            for module in self.modules.drain(..) {
                cu::cuModuleUnload(module);
            }
            cu::cuDevicePrimaryCtxRelease_v2(self.info.handle);
        }
    }
}
