//! The CUDA libraries as this process finds them, and their status codes as [`BackendError`]s.
//!
//! cudarc loads each library on first use and panics when it is missing, so every entry point here asks
//! first whether the library loads ([`require`]) and turns a missing one into an error that says what to
//! install.

use super::super::BackendError;
use cudarc::cublas::sys as cublas;
use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as nvrtc;
use std::ffi::CStr;
use std::sync::OnceLock;

/// A CUDA library ringtrain loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Library {
    Driver,
    Nvrtc,
    Cublas,
}

impl Library {
    /// The file the loader looks for, and what to install when it is missing.
    fn describe(self) -> (&'static str, &'static str) {
        match self {
            Library::Driver => (
                "the CUDA driver library (libcuda.so.1)",
                "install the NVIDIA driver; a machine without an NVIDIA GPU has none",
            ),
            Library::Nvrtc => (
                "NVRTC, CUDA's run-time compiler (libnvrtc.so.13)",
                "install the CUDA 13 toolkit, or `pip install nvidia-cuda-nvrtc`, and put the folder holding libnvrtc.so.13 on LD_LIBRARY_PATH",
            ),
            Library::Cublas => (
                "cuBLAS (libcublas.so.13)",
                "install the CUDA 13 toolkit, or `pip install nvidia-cublas`, and put the folder holding libcublas.so.13 on LD_LIBRARY_PATH",
            ),
        }
    }

    /// Whether the library loads, asked once per process (each answer is a `dlopen`).
    pub(super) fn present(self) -> bool {
        static ANSWERS: [OnceLock<bool>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
        let slot = match self {
            Library::Driver => 0,
            Library::Nvrtc => 1,
            Library::Cublas => 2,
        };
        // SAFETY: each probe only `dlopen`s the library's candidate names and closes it again; loading a
        // shared library runs its initialisers, which the CUDA libraries are built to allow.
        *ANSWERS[slot].get_or_init(|| unsafe {
            match self {
                Library::Driver => cu::is_culib_present(),
                Library::Nvrtc => nvrtc::is_culib_present(),
                Library::Cublas => cublas::is_culib_present(),
            }
        })
    }

    /// The error for a missing library.
    pub(super) fn missing(self) -> BackendError {
        let (what, fix) = self.describe();
        BackendError::NoAdapter(format!("cuda backend: {what} was not found: {fix}"))
    }
}

/// `Ok` when `library` loads, else the error naming it.
pub(super) fn require(library: Library) -> Result<(), BackendError> {
    if library.present() {
        Ok(())
    } else {
        Err(library.missing())
    }
}

/// A driver status as a result; `what` says which call, for the message.
pub(super) fn check(status: cu::CUresult, what: &str) -> Result<(), BackendError> {
    use cu::CUresult as R;
    match status {
        R::CUDA_SUCCESS => Ok(()),
        R::CUDA_ERROR_OUT_OF_MEMORY => Err(BackendError::OutOfMemory {
            what: what.to_string(),
            bytes: None,
        }),
        // Errors after which the context is unusable: every later call fails the same way.
        R::CUDA_ERROR_ILLEGAL_ADDRESS
        | R::CUDA_ERROR_LAUNCH_FAILED
        | R::CUDA_ERROR_ECC_UNCORRECTABLE
        | R::CUDA_ERROR_HARDWARE_STACK_ERROR
        | R::CUDA_ERROR_ILLEGAL_INSTRUCTION
        | R::CUDA_ERROR_MISALIGNED_ADDRESS
        | R::CUDA_ERROR_INVALID_PC
        | R::CUDA_ERROR_DEVICE_UNAVAILABLE
        | R::CUDA_ERROR_ASSERT
        | R::CUDA_ERROR_LAUNCH_TIMEOUT
        | R::CUDA_ERROR_NVLINK_UNCORRECTABLE
        | R::CUDA_ERROR_CONTAINED => Err(BackendError::DeviceLost(format!("{what}: {}", error_name(status)))),
        _ => Err(BackendError::Driver(format!("{what}: {}", error_name(status)))),
    }
}

/// The driver's name for `status`, e.g. `CUDA_ERROR_NO_DEVICE`.
fn error_name(status: cu::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `cuGetErrorName` writes a pointer to a static string (or leaves it null) and may be called
    // before `cuInit`; the driver library is loaded, since `status` came from it.
    let known = unsafe { cu::cuGetErrorName(status, &mut name) } == cu::CUresult::CUDA_SUCCESS;
    if known && !name.is_null() {
        // SAFETY: non-null, and the driver's error names are NUL-terminated static strings.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    } else {
        format!("CUDA error {}", status as i32)
    }
}

/// A cuBLAS status as a result.
pub(super) fn check_blas(status: cublas::cublasStatus_t, what: &str) -> Result<(), BackendError> {
    if status == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Driver(format!("{what}: cuBLAS status {status:?}")))
    }
}

/// Loads the driver and initialises it (once it succeeds, never again); the error says what is missing.
pub(super) fn init() -> Result<(), BackendError> {
    static INITIALISED: OnceLock<()> = OnceLock::new();
    if INITIALISED.get().is_some() {
        return Ok(());
    }
    let result = (|| {
        require(Library::Driver)?;
        // SAFETY: the driver library loads (checked above); `cuInit(0)` is the documented first call and
        // may be repeated.
        let status = unsafe { cu::cuInit(0) };
        if status == cu::CUresult::CUDA_ERROR_NO_DEVICE {
            return Err(BackendError::NoAdapter(
                "cuda backend: the CUDA driver is installed but finds no NVIDIA GPU".into(),
            ));
        }
        check(status, "initialising the CUDA driver (cuInit)")
    })();
    if result.is_ok() {
        let _ = INITIALISED.set(());
    }
    result
}

/// The CUDA major version this build's bindings, kernels and library names are for.
pub(super) const CUDA_MAJOR: i32 = 13;

/// Refuses a driver, NVRTC or cuBLAS older than CUDA 13 with a message saying which (cudarc also loads the
/// `.so.12` libraries, whose CUBINs and entry points differ, and an older driver lacks functions the
/// backend calls, which cudarc would answer with a panic).
pub(super) fn require_cuda_13() -> Result<(), BackendError> {
    let (major, minor) = driver_version()?;
    if major < CUDA_MAJOR {
        return Err(BackendError::NoAdapter(format!(
            "cuda backend: the NVIDIA driver supports CUDA {major}.{minor}, and this build needs CUDA {CUDA_MAJOR} (driver 580 or newer)"
        )));
    }
    let (major, minor) = nvrtc_version()?;
    if major != CUDA_MAJOR {
        return Err(BackendError::NoAdapter(format!(
            "cuda backend: the NVRTC found is version {major}.{minor}, and this build needs NVRTC {CUDA_MAJOR} (libnvrtc.so.{CUDA_MAJOR})"
        )));
    }
    let major = cublas_major()?;
    if major != CUDA_MAJOR {
        return Err(BackendError::NoAdapter(format!(
            "cuda backend: the cuBLAS found is version {major}, and this build needs cuBLAS {CUDA_MAJOR} (libcublas.so.{CUDA_MAJOR})"
        )));
    }
    Ok(())
}

/// cuBLAS's major version.
pub(super) fn cublas_major() -> Result<i32, BackendError> {
    require(Library::Cublas)?;
    let mut major = 0;
    // SAFETY: cuBLAS loads; `cublasGetProperty` needs no handle; valid out-pointer.
    let status = unsafe { cublas::cublasGetProperty(cublas::libraryPropertyType::MAJOR_VERSION, &mut major) };
    check_blas(status, "asking cuBLAS's version")?;
    Ok(major)
}

/// The number of CUDA devices the driver sees.
pub(super) fn device_count() -> Result<usize, BackendError> {
    init()?;
    let mut count = 0;
    // SAFETY: the driver is initialised; `count` is a valid out-pointer.
    check(unsafe { cu::cuDeviceGetCount(&mut count) }, "counting CUDA devices")?;
    Ok(count.max(0) as usize)
}

/// The driver's CUDA version as (major, minor), e.g. (13, 0).
pub(super) fn driver_version() -> Result<(i32, i32), BackendError> {
    require(Library::Driver)?;
    let mut version = 0;
    // SAFETY: the driver library loads; `cuDriverGetVersion` may be called before `cuInit`.
    check(
        unsafe { cu::cuDriverGetVersion(&mut version) },
        "asking the driver's version",
    )?;
    Ok((version / 1000, version % 1000 / 10))
}

/// NVRTC's version as (major, minor).
pub(super) fn nvrtc_version() -> Result<(i32, i32), BackendError> {
    require(Library::Nvrtc)?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC loads; both are valid out-pointers.
    let status = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
    if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(BackendError::Driver(format!("asking NVRTC's version: {status:?}")));
    }
    Ok((major, minor))
}

/// What one device is.
#[derive(Clone, Debug)]
pub(super) struct DeviceInfo {
    pub(super) handle: cu::CUdevice,
    pub(super) name: String,
    pub(super) total_bytes: u64,
    /// Compute capability (major, minor): (9, 0) for an H100 or H200.
    pub(super) capability: (i32, i32),
}

/// Device `ordinal`'s name, memory and compute capability.
pub(super) fn device_info(ordinal: usize) -> Result<DeviceInfo, BackendError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(BackendError::NoAdapter(format!(
            "cuda backend: no CUDA device {ordinal}: the driver sees {count}"
        )));
    }
    let mut handle = 0;
    // SAFETY: the driver is initialised and `ordinal` is below the device count.
    check(
        unsafe { cu::cuDeviceGet(&mut handle, ordinal as i32) },
        "opening a CUDA device",
    )?;
    let mut raw_name = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer holds `len` bytes; the driver writes a NUL-terminated name into it.
    check(
        unsafe { cu::cuDeviceGetName(raw_name.as_mut_ptr(), raw_name.len() as i32, handle) },
        "asking a device's name",
    )?;
    // SAFETY: the driver NUL-terminated the name within the buffer.
    let name = unsafe { CStr::from_ptr(raw_name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut total = 0usize;
    // SAFETY: valid out-pointer, valid device.
    check(
        unsafe { cu::cuDeviceTotalMem_v2(&mut total, handle) },
        "asking a device's memory",
    )?;
    let attribute = |which| -> Result<i32, BackendError> {
        let mut value = 0;
        // SAFETY: valid out-pointer, valid device, and a compute-capability attribute every driver knows.
        check(
            unsafe { cu::cuDeviceGetAttribute(&mut value, which, handle) },
            "asking a device's compute capability",
        )?;
        Ok(value)
    };
    use cu::CUdevice_attribute as A;
    let capability = (
        attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    Ok(DeviceInfo {
        handle,
        name,
        total_bytes: total as u64,
        capability,
    })
}
