//! The real device: the CUDA driver API on one GPU. The primary context, two non-blocking streams (compute
//! and copies out), the kernels loaded from CUBIN, cuBLAS, and the early read-backs.

use super::super::BackendError;
use super::api::{self, check, DeviceInfo, Library};
use super::blas::Blas;
use super::compile;
use super::gpu::{Addr, Gemm, Gpu, Param};
use super::readback::Readbacks;
use super::staging::Staging;
use cudarc::driver::sys as cu;
use std::collections::HashMap;

/// One CUDA device, ready to run the kernels.
pub struct Driver {
    pub(super) info: DeviceInfo,
    ordinal: usize,
    /// The device's primary context, retained for the driver's life.
    context: cu::CUcontext,
    /// Every op, copy in and cuBLAS call, in program order.
    compute: cu::CUstream,
    /// Read-backs begun early, ordered after the compute work before them by events.
    copy: cu::CUstream,
    modules: Vec<cu::CUmodule>,
    kernels: HashMap<&'static str, cu::CUfunction>,
    blas: Option<Blas>,
    readbacks: Readbacks,
    staging: Staging,
}

// SAFETY: the CUDA driver API may be called from any thread; every entry point makes the context current on
// the calling thread first (`bind`), and `&mut self` keeps calls from overlapping.
unsafe impl Send for Driver {}

impl Driver {
    /// Opens device `ordinal`: its primary context, two streams, cuBLAS, and every kernel compiled for its
    /// architecture (from the cache when it has them).
    pub(super) fn open(ordinal: usize) -> Result<Self, BackendError> {
        let info = api::device_info(ordinal)?;
        // Checked before any allocation, so the message names the missing library or the old version, not
        // a failed call.
        api::require(Library::Nvrtc)?;
        api::require(Library::Cublas)?;
        api::require_cuda_13()?;
        let mut pools = 0;
        // SAFETY: valid out-pointer, valid device.
        check(
            unsafe {
                cu::cuDeviceGetAttribute(
                    &mut pools,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
                    info.handle,
                )
            },
            "asking whether the device has memory pools",
        )?;
        if pools == 0 {
            return Err(BackendError::NoAdapter(format!(
                "cuda backend: {} does not support stream-ordered memory pools (cuMemAllocAsync), which the backend allocates with",
                info.name
            )));
        }
        let mut context: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is initialised (`device_info`) and `info.handle` is a valid device.
        check(
            unsafe { cu::cuDevicePrimaryCtxRetain(&mut context, info.handle) },
            "retaining the device's context",
        )?;
        let mut driver = Driver {
            info,
            ordinal,
            context,
            compute: std::ptr::null_mut(),
            copy: std::ptr::null_mut(),
            modules: Vec::new(),
            kernels: HashMap::new(),
            blas: None,
            readbacks: Readbacks::default(),
            staging: Staging::default(),
        };
        // From here on `Drop` releases whatever was made.
        driver.bind()?;
        for stream in [&mut driver.compute, &mut driver.copy] {
            // SAFETY: the context is current; `stream` is a valid out-pointer. Non-blocking: the legacy
            // default stream, which nothing here uses, must not serialise them.
            check(
                unsafe { cu::cuStreamCreate(stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
                "creating a CUDA stream",
            )?;
        }
        driver.keep_freed_memory()?;
        driver.load_kernels()?;
        driver.blas = Some(Blas::new(driver.compute)?);
        Ok(driver)
    }

    /// Makes the context current on this thread (cheap; needed when the backend moved threads).
    fn bind(&self) -> Result<(), BackendError> {
        // SAFETY: the context was retained by `open` and is released only by `Drop`.
        check(
            unsafe { cu::cuCtxSetCurrent(self.context) },
            "making the CUDA context current",
        )
    }

    /// Keeps freed memory in the device's pool instead of returning it at every synchronisation, so that
    /// buffers freed and allocated again (a new batch shape, the scratch buffers growing) cost no new mapping.
    fn keep_freed_memory(&self) -> Result<(), BackendError> {
        let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
        let mut threshold = u64::MAX;
        // SAFETY: valid device and out-pointer; the attribute takes a u64, passed by pointer.
        unsafe {
            check(
                cu::cuDeviceGetDefaultMemPool(&mut pool, self.info.handle),
                "finding the memory pool",
            )?;
            check(
                cu::cuMemPoolSetAttribute(
                    pool,
                    cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut _,
                ),
                "setting the memory pool's release threshold",
            )
        }
    }

    /// Compiles (or loads from the cache) every family and looks up its kernels.
    fn load_kernels(&mut self) -> Result<(), BackendError> {
        let (major, minor) = self.info.capability;
        for (stem, source) in compile::FAMILIES {
            let cubin = compile::cubin(stem, source, self.info.capability)?;
            let mut module: cu::CUmodule = std::ptr::null_mut();
            // SAFETY: the context is current; `cubin` is a complete CUBIN image (NVRTC's output, or a cache
            // file whose hash matched) that outlives the call.
            check(
                unsafe { cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const _) },
                &format!("loading kernels/{stem}.cu's native code for sm_{major}{minor}"),
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
                self.kernels.insert(name, function);
            }
        }
        Ok(())
    }

    /// Waits for `stream`.
    fn wait(&self, stream: cu::CUstream) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: the stream lives as long as the driver.
        check(unsafe { cu::cuStreamSynchronize(stream) }, "waiting for the GPU")
    }
}

impl Gpu for Driver {
    fn describe(&self) -> String {
        let (major, minor) = self.info.capability;
        let gib = self.info.total_bytes as f64 / (1u64 << 30) as f64;
        format!(
            "device {}: {}, sm_{major}{minor}, {gib:.1} GiB",
            self.ordinal, self.info.name
        )
    }

    fn alloc(&mut self, words: usize, what: &str) -> Result<Addr, BackendError> {
        self.bind()?;
        let words = words.max(1);
        let bytes = words.checked_mul(4).ok_or_else(|| BackendError::OutOfMemory {
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
        // SAFETY: `ptr` holds `words` words, allocated on this stream just above.
        check(unsafe { cu::cuMemsetD32Async(ptr, 0, words, self.compute) }, what)?;
        Ok(ptr)
    }

    fn free(&mut self, addr: Addr) -> Result<(), BackendError> {
        self.bind()?;
        self.readbacks.order_before(self.copy, self.compute)?;
        // SAFETY: `addr` came from `cuMemAllocAsync` and is freed once; work queued on it, read-backs
        // included (ordered just above), completes first.
        check(unsafe { cu::cuMemFreeAsync(addr, self.compute) }, "freeing GPU memory")
    }

    fn write(&mut self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.staging.upload(self.compute, dst, src)
    }

    fn read(&mut self, src: Addr, dst: &mut [u8]) -> Result<(), BackendError> {
        self.bind()?;
        if !dst.is_empty() {
            // SAFETY: `src` holds `dst.len()` bytes; a copy into pageable memory returns once complete, and
            // the wait below covers it anyway.
            check(
                unsafe { cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut _, src, dst.len(), self.compute) },
                "copying from the GPU",
            )?;
        }
        self.wait(self.compute)
    }

    fn fill(&mut self, dst: Addr, bits: u32, words: usize) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: `dst` holds `words` words.
        check(unsafe { cu::cuMemsetD32Async(dst, bits, words, self.compute) }, "fill")
    }

    fn copy(&mut self, dst: Addr, src: Addr, bytes: usize) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: both hold `bytes` bytes of live buffers, without overlap (the ops assert it).
        check(
            unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.compute) },
            "copy",
        )
    }

    fn launch(
        &mut self,
        kernel: &'static str,
        blocks: u32,
        threads: u32,
        params: &[Param],
    ) -> Result<(), BackendError> {
        let function = *self
            .kernels
            .get(kernel)
            .unwrap_or_else(|| panic!("no CUDA kernel named {kernel}"));
        let mut values: Vec<Param> = params.to_vec();
        let mut pointers: Vec<*mut std::ffi::c_void> = values
            .iter_mut()
            .map(|p| match p {
                Param::Ptr(a) => a as *mut u64 as *mut _,
                Param::U32(u) => u as *mut u32 as *mut _,
                Param::F32(f) => f as *mut f32 as *mut _,
            })
            .collect();
        self.bind()?;
        // SAFETY: `function` belongs to the current context; `pointers` holds one pointer per kernel
        // parameter, in order and of the parameter's size (device pointers as u64, sizes as u32, scalars as
        // f32), each valid for the call (the driver copies them at launch); every device address is in a
        // live buffer whose extent the kernel's sizes describe.
        check(
            unsafe {
                cu::cuLaunchKernel(
                    function,
                    blocks,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    self.compute,
                    pointers.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            kernel,
        )
    }

    fn gemm(&mut self, gemm: &Gemm) -> Result<(), BackendError> {
        self.bind()?;
        self.blas.as_ref().expect("cuBLAS is set up by `open`").run(gemm)
    }

    fn set_tf32(&mut self, on: bool) -> Result<(), BackendError> {
        self.bind()?;
        self.blas.as_ref().expect("cuBLAS is set up by `open`").set_tf32(on)
    }

    fn begin_read(&mut self, src: Addr, words: usize) -> Result<u64, BackendError> {
        self.bind()?;
        self.readbacks.begin(self.compute, self.copy, src, words)
    }

    fn read_ready(&mut self, ticket: u64) -> Result<bool, BackendError> {
        self.bind()?;
        self.readbacks.ready(ticket)
    }

    fn finish_read(&mut self, ticket: u64, host: &mut Vec<f32>) -> Result<(), BackendError> {
        self.bind()?;
        self.readbacks.finish(ticket, host)
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.wait(self.copy)?;
        self.wait(self.compute)
    }

    fn free_memory(&self) -> Option<u64> {
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
}

impl Drop for Driver {
    fn drop(&mut self) {
        if self.bind().is_err() {
            // No context to release resources in (the driver is shutting down, say): leave them to the
            // process's end, but give back the context reference, which needs none.
            std::mem::forget(self.blas.take());
            // SAFETY: retained by `open`, released once.
            unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.info.handle) };
            return;
        }
        // SAFETY: everything below was made by this driver in this context and is released once, after the
        // streams finished all queued work (the backend freed its buffers before dropping this); errors are
        // ignored, as there is nobody left to tell.
        unsafe {
            for stream in [self.compute, self.copy] {
                if !stream.is_null() {
                    cu::cuStreamSynchronize(stream);
                }
            }
            self.readbacks.release();
            self.staging.release();
            self.blas = None;
            for stream in [self.compute, self.copy] {
                if !stream.is_null() {
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
