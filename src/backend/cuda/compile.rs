//! `kernels/*.cu` compiled by NVRTC to CUBIN for one device architecture, once per process, and the on-disk
//! cache of the results.
//!
//! CUBIN, not PTX: an NVRTC newer than the driver emits PTX the driver refuses to JIT, while native code for
//! the device's own architecture loads on any driver that supports the device.
//!
//! Cache: one file per (family, architecture) in `RINGTRAIN_CUDA_CACHE`, else `$XDG_CACHE_HOME/ringtrain/
//! cuda`, else `~/.cache/ringtrain/cuda`. Its name carries a hash of the program text, the options and the
//! NVRTC version, so any change compiles afresh. A cache file is untrusted input: it starts with the BLAKE3
//! hash of the CUBIN after it, and one that does not match is compiled again (and rewritten). Failing to
//! write the cache only costs the next process a compile.

use super::super::BackendError;
use super::api::{self, Library};
use cudarc::nvrtc::sys as nvrtc;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The helpers every family starts with.
const COMMON: &str = include_str!("../../../kernels/common.cuh");
/// The NVRTC options, one a line, `#` comments (the same file `tests/nvrtc_kernels.rs` compiles with).
const OPTIONS: &str = include_str!("../../../kernels/nvrtc.options");

/// Every family: its stem (the WGSL twin's) and its source.
pub(super) const FAMILIES: [(&str, &str); 9] = [
    ("adamw", include_str!("../../../kernels/adamw.cu")),
    ("attention", include_str!("../../../kernels/attention.cu")),
    ("crossentropy", include_str!("../../../kernels/crossentropy.cu")),
    ("encoder", include_str!("../../../kernels/encoder.cu")),
    ("gelu", include_str!("../../../kernels/gelu.cu")),
    ("layernorm", include_str!("../../../kernels/layernorm.cu")),
    ("matmul", include_str!("../../../kernels/matmul.cu")),
    ("reduce", include_str!("../../../kernels/reduce.cu")),
    ("residual", include_str!("../../../kernels/residual.cu")),
];

/// Where to find the entry points of a family: every `extern "C" __global__` kernel's name.
pub(super) fn kernel_names(source: &str) -> Vec<&str> {
    source
        .split("extern \"C\" __global__ void")
        .skip(1)
        .filter_map(|rest| {
            let rest = rest.trim_start();
            // Past `__launch_bounds__(...)`, whatever its block size.
            let rest = match rest.strip_prefix("__launch_bounds__") {
                Some(r) => r[r.find(')')? + 1..].trim_start(),
                None => rest,
            };
            rest.split('(').next().map(str::trim)
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// The program NVRTC compiles for `stem`: the common helpers, then the family, each with a `#line` so that
/// messages name the right file and line.
fn program_text(stem: &str, source: &str) -> String {
    format!("#line 1 \"kernels/common.cuh\"\n{COMMON}\n#line 1 \"kernels/{stem}.cu\"\n{source}")
}

/// The options of `nvrtc.options` plus the architecture.
fn options(capability: (i32, i32)) -> Vec<String> {
    let mut options: Vec<String> = OPTIONS
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    options.push(format!("--gpu-architecture=sm_{}{}", capability.0, capability.1));
    options
}

/// The CUBIN of family `stem` for a device of `capability`, from the cache or compiled now.
/// Compiled once per process: a second backend in the same process (the sim's workers) reuses the first one's.
pub(super) fn cubin(stem: &str, source: &str, capability: (i32, i32)) -> Result<Vec<u8>, BackendError> {
    type Compiled = HashMap<(String, (i32, i32)), Vec<u8>>;
    static COMPILED: Mutex<Option<Compiled>> = Mutex::new(None);
    let key = (stem.to_string(), capability);
    if let Some(cubin) = COMPILED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_default()
        .get(&key)
    {
        return Ok(cubin.clone());
    }
    let cubin = cubin_cached_in(cache_dir().as_deref(), stem, source, capability)?;
    COMPILED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_default()
        .insert(key, cubin.clone());
    Ok(cubin)
}

/// [`cubin`] with the cache in `cache` (none: always compile).
fn cubin_cached_in(
    cache: Option<&Path>,
    stem: &str,
    source: &str,
    capability: (i32, i32),
) -> Result<Vec<u8>, BackendError> {
    api::require(Library::Nvrtc)?;
    let text = program_text(stem, source);
    let options = options(capability);
    let version = api::nvrtc_version()?;
    let mut key = blake3::Hasher::new();
    key.update(text.as_bytes());
    for option in &options {
        key.update(option.as_bytes());
        key.update(b"\n");
    }
    key.update(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    let key = key.finalize().to_hex();
    let file = cache.map(|dir| {
        dir.join(format!(
            "{stem}-sm_{}{}-{}.cubin",
            capability.0,
            capability.1,
            &key[..24]
        ))
    });
    if let Some(cubin) = file.as_deref().and_then(read_cached) {
        return Ok(cubin);
    }
    let cubin = compile(stem, &text, &options)?;
    if let Some(file) = file {
        if let Err(e) = write_cached(&file, &cubin) {
            tracing::warn!("could not cache the CUDA kernels in {}: {e}", file.display());
        }
    }
    Ok(cubin)
}

/// The cache folder, when one can be named.
fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("RINGTRAIN_CUDA_CACHE").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ringtrain").join("cuda"))
}

/// A cached CUBIN whose hash matches, or `None` (missing, short or corrupt).
fn read_cached(file: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(file).ok()?;
    if bytes.len() <= 32 {
        return None;
    }
    let (hash, cubin) = bytes.split_at(32);
    (blake3::hash(cubin).as_bytes() == hash).then(|| cubin.to_vec())
}

/// Writes `cubin` behind its hash, atomically (a temporary file renamed), so a crash leaves no half file.
fn write_cached(file: &Path, cubin: &[u8]) -> std::io::Result<()> {
    let dir = file.parent().expect("cache files live in a folder");
    std::fs::create_dir_all(dir)?;
    // Unique per process and thread, so that two writers never share a temporary file.
    let tmp = file.with_extension(format!("tmp{}-{:?}", std::process::id(), std::thread::current().id()));
    let mut bytes = blake3::hash(cubin).as_bytes().to_vec();
    bytes.extend_from_slice(cubin);
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, file).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Runs NVRTC on `text`; on failure the error holds NVRTC's log, whose lines name `kernels/<file>(<line>)`.
fn compile(stem: &str, text: &str, options: &[String]) -> Result<Vec<u8>, BackendError> {
    let failed = |what: &str, status: nvrtc::nvrtcResult| {
        BackendError::Driver(format!(
            "cuda backend: NVRTC {what} for kernels/{stem}.cu failed: {status:?}"
        ))
    };
    let ok = |status: nvrtc::nvrtcResult| status == nvrtc::nvrtcResult::NVRTC_SUCCESS;
    let source = CString::new(text).map_err(|_| BackendError::Driver(format!("kernels/{stem}.cu holds a NUL byte")))?;
    let name = CString::new(format!("{stem}.cu")).expect("stems hold no NUL");
    let options: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options hold no NUL"))
        .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut program: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC loads (checked by the caller); the strings are NUL-terminated and outlive the call; no
    // headers are passed (0, null).
    let status = unsafe {
        nvrtc::nvrtcCreateProgram(
            &mut program,
            source.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if !ok(status) {
        return Err(failed("creating the program", status));
    }
    // SAFETY: `program` was created above; the option pointers are valid for the call.
    let compiled = unsafe { nvrtc::nvrtcCompileProgram(program, option_ptrs.len() as i32, option_ptrs.as_ptr()) };
    let log = program_log(program);
    let result = if !ok(compiled) {
        Err(BackendError::Driver(format!(
            "cuda backend: NVRTC could not compile kernels/{stem}.cu ({compiled:?}):\n{log}"
        )))
    } else {
        if !log.trim().is_empty() {
            tracing::warn!("NVRTC warnings for kernels/{stem}.cu:\n{log}");
        }
        let mut size = 0usize;
        // SAFETY: the program compiled; `size` is a valid out-pointer.
        let status = unsafe { nvrtc::nvrtcGetCUBINSize(program, &mut size) };
        if !ok(status) || size == 0 {
            Err(failed("reading the CUBIN's size", status))
        } else {
            let mut cubin = vec![0u8; size];
            // SAFETY: the buffer holds exactly the `size` bytes NVRTC reported.
            let status = unsafe { nvrtc::nvrtcGetCUBIN(program, cubin.as_mut_ptr() as *mut c_char) };
            if ok(status) {
                Ok(cubin)
            } else {
                Err(failed("reading the CUBIN", status))
            }
        }
    };
    // SAFETY: `program` is live and destroyed once.
    unsafe { nvrtc::nvrtcDestroyProgram(&mut program) };
    result
}

/// NVRTC's log for `program` (errors and warnings), empty when there is none.
fn program_log(program: nvrtc::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `program` is live; valid out-pointer.
    if unsafe { nvrtc::nvrtcGetProgramLogSize(program, &mut size) } != nvrtc::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return String::new();
    }
    let mut log = vec![0 as c_char; size];
    // SAFETY: the buffer holds the `size` bytes (terminating NUL included) NVRTC reported.
    if unsafe { nvrtc::nvrtcGetProgramLog(program, log.as_mut_ptr()) } != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    // SAFETY: NVRTC NUL-terminated the log within the buffer.
    unsafe { CStr::from_ptr(log.as_ptr()) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_kernels_and_the_options_name_the_architecture() {
        for (stem, source) in FAMILIES {
            let names = kernel_names(source);
            assert!(!names.is_empty(), "{stem}");
            assert!(
                names
                    .iter()
                    .all(|n| n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')),
                "{stem}: {names:?}"
            );
        }
        assert_eq!(kernel_names(FAMILIES[0].1), ["adamw"]);
        let options = options((9, 0));
        assert!(options.contains(&"--fmad=false".to_string()), "{options:?}");
        assert_eq!(options.last().unwrap(), "--gpu-architecture=sm_90");
        assert!(program_text("gelu", "x").contains("#line 1 \"kernels/gelu.cu\"\nx"));
    }

    /// The backend's own compile path, where NVRTC loads (`run-tests.sh` puts the pip wheel's folder on
    /// `LD_LIBRARY_PATH` for this test): every family to CUBIN for sm_90, then the same again from the cache.
    /// Without NVRTC it says so and passes, except under `CI=true`, where it fails.
    #[test]
    fn every_family_compiles_to_cubin_and_is_cached() {
        if !Library::Nvrtc.present() {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but NVRTC (libnvrtc.so.13) is not on the loader's path"
            );
            println!("SKIP: NVRTC (libnvrtc.so.13) is not on the loader's path");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for (stem, source) in FAMILIES {
            let first = cubin_cached_in(Some(dir.path()), stem, source, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
            // An ELF image, not PTX text.
            assert_eq!(&first[..4], b"\x7fELF", "{stem}");
            assert_eq!(
                cubin_cached_in(Some(dir.path()), stem, source, (9, 0)).unwrap(),
                first,
                "{stem} from the cache"
            );
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), FAMILIES.len());
        let broken = compile(
            "broken",
            &program_text("broken", "extern \"C\" __global__ void k() { int x = ; }"),
            &options((9, 0)),
        );
        let message = broken.unwrap_err().to_string();
        assert!(
            message.contains("kernels/broken.cu(1)") && message.contains("error"),
            "{message}"
        );
    }

    #[test]
    fn a_corrupt_cache_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("k.cubin");
        write_cached(&file, b"native code").unwrap();
        assert_eq!(read_cached(&file).unwrap(), b"native code");
        let mut bytes = std::fs::read(&file).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&file, &bytes).unwrap();
        assert!(read_cached(&file).is_none());
        std::fs::write(&file, b"short").unwrap();
        assert!(read_cached(&file).is_none());
    }
}
