//! The CUDA kernels (`kernels/*.cu`) compile with NVRTC, without a GPU: every family is compiled to CUBIN
//! for `sm_80` and `sm_90` with the options of `kernels/nvrtc.options`, and any error or warning fails the
//! test with NVRTC's log (which names the family's file and line). NVRTC is a host library, loaded at run
//! time: `RINGTRAIN_NVRTC_LIBS` lists library paths separated by `:` (each one is compiled against in turn,
//! e.g. the newest NVRTC and the 13.0 series), and without it the loader's default search looks for
//! `libnvrtc.so.13`. Where none is found the test prints a notice and passes, except under `CI=true`, where
//! it fails (`run-tests.sh` installs NVRTC from pip there).
//!
//! A second test checks the sources' rules without NVRTC: each family has a WGSL twin in `shaders/`, its
//! kernels are entry points of that twin, and there are no atomics and no includes.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Compute capabilities every kernel is compiled for: A100 (8.0) and H100/H200 (9.0).
const ARCHITECTURES: [u32; 2] = [80, 90];

/// Kernels with no WGSL entry point of the same name, and why.
const CUDA_ONLY_KERNELS: &[(&str, &str)] = &[(
    "matmul_forward_bias",
    "cuBLAS computes the product; the WGSL matmul adds the bias inside its own kernel",
)];

/// Library names the default search tries, in order.
const DEFAULT_LIBRARIES: [&str; 2] = ["libnvrtc.so.13", "libnvrtc.so"];

/// A minimal binding of the NVRTC C API: the calls that compile a program to CUBIN and read its log.
mod nvrtc {
    use super::*;

    type Program = *mut c_void;
    type Status = c_int;
    const SUCCESS: Status = 0;

    /// One loaded NVRTC library.
    pub struct Nvrtc {
        version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
        error_string: unsafe extern "C" fn(Status) -> *const c_char,
        create_program: unsafe extern "C" fn(
            *mut Program,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> Status,
        compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
        program_log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
        program_log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
        cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
        cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
        destroy_program: unsafe extern "C" fn(*mut Program) -> Status,
        // Declared last so that they are dropped after nothing can call the pointers above any more.
        _library: libloading::Library,
        _builtins: Option<libloading::Library>,
    }

    /// What one compilation produced.
    pub struct Compiled {
        pub cubin: Vec<u8>,
        /// NVRTC's log, empty when there was nothing to say.
        pub log: String,
    }

    /// NVRTC opens its builtins library (`libnvrtc-builtins.so.<major>.<minor>`) by name through the
    /// loader's search, which knows nothing of a pip wheel's folder. Loading the one beside `library` first
    /// makes that search find it already loaded (the loader matches loaded libraries by soname), so a path in
    /// `RINGTRAIN_NVRTC_LIBS` is enough on its own and two versions can be loaded in one process.
    fn load_builtins_beside(library: &Path) -> Result<Option<libloading::Library>, String> {
        let Some(dir) = library.parent().filter(|d| !d.as_os_str().is_empty()) else {
            return Ok(None);
        };
        let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let builtins = entries.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("libnvrtc-builtins.so.") && !name.contains(".alt.")
        });
        builtins
            .map(|p| {
                // SAFETY: as for NVRTC itself: its initialisers have no preconditions on this process.
                unsafe { libloading::Library::new(&p) }.map_err(|e| format!("{}: {e}", p.display()))
            })
            .transpose()
    }

    impl Nvrtc {
        /// Loads `library`: a path, or a bare name for the dynamic loader's search.
        pub fn load(library: &str) -> Result<Nvrtc, String> {
            let path = Path::new(library);
            if path.components().count() > 1 && !path.is_file() {
                return Err(format!("{library}: no such file"));
            }
            let builtins = load_builtins_beside(Path::new(library))?;
            // SAFETY: loading NVRTC runs its initialisers, which have no preconditions on this process.
            let lib = unsafe { libloading::Library::new(library) }.map_err(|e| format!("{library}: {e}"))?;
            macro_rules! symbol {
                ($name:literal) => {
                    // SAFETY: the symbol is the NVRTC C API function of that name, whose signature is the
                    // field's type (nvrtc.h); the pointer is copied out but `_library` keeps it loaded.
                    *unsafe { lib.get($name) }.map_err(|e| format!("{library}: {e}"))?
                };
            }
            Ok(Nvrtc {
                version: symbol!(b"nvrtcVersion\0"),
                error_string: symbol!(b"nvrtcGetErrorString\0"),
                create_program: symbol!(b"nvrtcCreateProgram\0"),
                compile_program: symbol!(b"nvrtcCompileProgram\0"),
                program_log_size: symbol!(b"nvrtcGetProgramLogSize\0"),
                program_log: symbol!(b"nvrtcGetProgramLog\0"),
                cubin_size: symbol!(b"nvrtcGetCUBINSize\0"),
                cubin: symbol!(b"nvrtcGetCUBIN\0"),
                destroy_program: symbol!(b"nvrtcDestroyProgram\0"),
                _library: lib,
                _builtins: builtins,
            })
        }

        /// `(major, minor)`.
        pub fn version(&self) -> Result<(i32, i32), String> {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: both pointers are valid for one write each.
            self.check("nvrtcVersion", unsafe { (self.version)(&mut major, &mut minor) })?;
            Ok((major, minor))
        }

        /// Compiles `source` (named `name` in messages) with `options`. `Err` carries NVRTC's status and log.
        pub fn compile(&self, source: &str, name: &str, options: &[String]) -> Result<Compiled, String> {
            let source = CString::new(source).map_err(|_| "source holds a NUL byte".to_string())?;
            let name = CString::new(name).map_err(|_| "name holds a NUL byte".to_string())?;
            let options: Vec<CString> = options
                .iter()
                .map(|o| CString::new(o.as_str()).map_err(|_| format!("option {o:?} holds a NUL byte")))
                .collect::<Result<_, _>>()?;
            let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
            let mut program: Program = std::ptr::null_mut();
            // SAFETY: `source` and `name` are NUL-terminated and outlive the call; no headers are passed, so
            // the two null arrays are never read.
            let created = unsafe {
                (self.create_program)(
                    &mut program,
                    source.as_ptr(),
                    name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            };
            self.check("nvrtcCreateProgram", created)?;
            let result = self.compile_created(program, &option_ptrs);
            // SAFETY: `program` was created above and is destroyed once, here.
            unsafe { (self.destroy_program)(&mut program) };
            result
        }

        fn compile_created(&self, program: Program, options: &[*const c_char]) -> Result<Compiled, String> {
            let count = c_int::try_from(options.len()).map_err(|_| "too many options".to_string())?;
            // SAFETY: `program` is live; `options` holds `count` NUL-terminated strings owned by the caller.
            let status = unsafe { (self.compile_program)(program, count, options.as_ptr()) };
            let log = self.log(program)?;
            if status != SUCCESS {
                return Err(format!("{}\n{log}", self.describe(status)));
            }
            let mut size = 0usize;
            // SAFETY: `program` is live and compiled; `size` is valid for one write.
            self.check("nvrtcGetCUBINSize", unsafe { (self.cubin_size)(program, &mut size) })?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` holds exactly the `size` bytes NVRTC said it will write.
            self.check("nvrtcGetCUBIN", unsafe {
                (self.cubin)(program, cubin.as_mut_ptr().cast())
            })?;
            Ok(Compiled { cubin, log })
        }

        fn log(&self, program: Program) -> Result<String, String> {
            let mut size = 0usize;
            // SAFETY: `program` is live; `size` is valid for one write.
            self.check("nvrtcGetProgramLogSize", unsafe {
                (self.program_log_size)(program, &mut size)
            })?;
            let mut log = vec![0u8; size.max(1)];
            // SAFETY: `log` holds the `size` bytes (NUL included) NVRTC said it will write.
            self.check("nvrtcGetProgramLog", unsafe {
                (self.program_log)(program, log.as_mut_ptr().cast())
            })?;
            let text = CStr::from_bytes_until_nul(&log).map_err(|_| "log without a NUL".to_string())?;
            Ok(text.to_string_lossy().trim().to_string())
        }

        fn check(&self, call: &str, status: Status) -> Result<(), String> {
            if status == SUCCESS {
                Ok(())
            } else {
                Err(format!("{call}: {}", self.describe(status)))
            }
        }

        fn describe(&self, status: Status) -> String {
            // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any status.
            let text = unsafe { CStr::from_ptr((self.error_string)(status)) };
            format!("{} (status {status})", text.to_string_lossy())
        }
    }
}

fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// One `kernels/<stem>.cu` file.
struct Family {
    stem: String,
    source: String,
}

/// Every `kernels/*.cu`, by stem.
fn families() -> Vec<Family> {
    let mut families: Vec<Family> = std::fs::read_dir(kernels_dir())
        .expect("kernels/ is readable")
        .map(|e| e.expect("kernels/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| Family {
            stem: p.file_stem().unwrap().to_string_lossy().into_owned(),
            source: std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        })
        .collect();
    families.sort_by(|a, b| a.stem.cmp(&b.stem));
    assert!(!families.is_empty(), "no kernels/*.cu found");
    families
}

/// The source NVRTC compiles for a family: `common.cuh`, then the family, each under a `#line` that names
/// its own file, so that messages point at the right file and line.
fn program_source(family: &Family) -> String {
    let common = std::fs::read_to_string(kernels_dir().join("common.cuh")).expect("kernels/common.cuh");
    format!(
        "#line 1 \"kernels/common.cuh\"\n{common}\n#line 1 \"kernels/{}.cu\"\n{}",
        family.stem, family.source
    )
}

/// The options of `kernels/nvrtc.options` (one a line, `#` comments), then the architecture.
fn options(arch: u32) -> Vec<String> {
    let text = std::fs::read_to_string(kernels_dir().join("nvrtc.options")).expect("kernels/nvrtc.options");
    let mut options: Vec<String> = text
        .lines()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    options.push(format!("--gpu-architecture=sm_{arch}"));
    options
}

/// The names of the `extern "C" __global__` kernels a source defines, in order.
fn kernel_names(source: &str) -> Vec<String> {
    const MARKER: &str = "extern \"C\" __global__";
    source
        .match_indices(MARKER)
        .map(|(at, _)| {
            let rest = source[at + MARKER.len()..].trim_start();
            let rest = rest.strip_prefix("void").expect("a kernel returns void").trim_start();
            let rest = match rest.strip_prefix("__launch_bounds__") {
                Some(r) => r[r.find(')').expect("__launch_bounds__(...)") + 1..].trim_start(),
                None => rest,
            };
            let end = rest
                .find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                .unwrap_or(rest.len());
            rest[..end].to_string()
        })
        .collect()
}

/// The entry points of a WGSL source (`@compute ... fn name(`).
fn wgsl_entry_points(source: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut compute = false;
    for line in source.lines() {
        let line = line.trim_start();
        if line.starts_with("@compute") {
            compute = true;
        }
        if compute {
            if let Some(rest) = line.strip_prefix("fn ") {
                names.insert(rest[..rest.find('(').unwrap_or(rest.len())].trim().to_string());
                compute = false;
            }
        }
    }
    names
}

#[test]
fn kernel_sources_follow_the_rules() {
    let shaders = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut all = BTreeSet::new();
    for family in families() {
        let file = format!("kernels/{}.cu", family.stem);
        let wgsl = std::fs::read_to_string(shaders.join(format!("{}.wgsl", family.stem)))
            .unwrap_or_else(|e| panic!("{file} has no WGSL twin shaders/{}.wgsl: {e}", family.stem));
        let entry_points = wgsl_entry_points(&wgsl);
        let names = kernel_names(&family.source);
        assert!(!names.is_empty(), "{file} defines no extern \"C\" __global__ kernel");
        for name in names {
            let cuda_only = CUDA_ONLY_KERNELS.iter().any(|&(k, _)| k == name);
            assert!(
                entry_points.contains(&name) || cuda_only,
                "{file}: kernel {name} is not an entry point of shaders/{}.wgsl ({entry_points:?}) nor listed in \
                 CUDA_ONLY_KERNELS",
                family.stem
            );
            assert!(all.insert(name.clone()), "kernel {name} is defined twice");
        }
        // atomicAdd, atomicCAS, ...: an atomic float sum's order depends on timing.
        let atomic_call = family
            .source
            .match_indices("atomic")
            .any(|(at, w)| family.source[at + w.len()..].starts_with(|ch: char| ch.is_ascii_uppercase()));
        assert!(!atomic_call, "{file} calls an atomic: reductions must use fixed trees");
        assert!(
            !family.source.contains("#include"),
            "{file} includes a header: NVRTC has none without the toolkit"
        );
    }
    for (name, _) in CUDA_ONLY_KERNELS {
        assert!(
            all.contains(*name),
            "CUDA_ONLY_KERNELS lists {name}, which no kernels/*.cu defines"
        );
    }
}

/// The NVRTC libraries to compile against: `RINGTRAIN_NVRTC_LIBS`, or the first default name that loads.
/// `Ok(empty)` means none was found by the default search.
fn libraries() -> Result<Vec<(String, nvrtc::Nvrtc)>, String> {
    if let Ok(list) = std::env::var("RINGTRAIN_NVRTC_LIBS") {
        let paths: Vec<&str> = list.split(':').filter(|p| !p.is_empty()).collect();
        if paths.is_empty() {
            return Err("RINGTRAIN_NVRTC_LIBS is set but names no library".into());
        }
        return paths
            .into_iter()
            .map(|p| {
                Ok((
                    p.to_string(),
                    nvrtc::Nvrtc::load(p).map_err(|e| format!("RINGTRAIN_NVRTC_LIBS: {e}"))?,
                ))
            })
            .collect();
    }
    Ok(DEFAULT_LIBRARIES
        .iter()
        .find_map(|name| nvrtc::Nvrtc::load(name).ok().map(|lib| vec![(name.to_string(), lib)]))
        .unwrap_or_default())
}

#[test]
fn every_kernel_compiles_to_cubin_without_warnings() {
    let libs = libraries().unwrap_or_else(|e| panic!("{e}"));
    if libs.is_empty() {
        let notice = format!(
            "no NVRTC library found ({}; set RINGTRAIN_NVRTC_LIBS to library paths, or `pip install \
             nvidia-cuda-nvrtc`)",
            DEFAULT_LIBRARIES.join(", ")
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: {notice}");
        eprintln!("SKIP: {notice}");
        return;
    }
    let families = families();
    let mut failures = Vec::new();
    for (path, lib) in &libs {
        let (major, minor) = lib.version().unwrap_or_else(|e| panic!("{path}: {e}"));
        for arch in ARCHITECTURES {
            let options = options(arch);
            let mut total = Duration::ZERO;
            let mut times = Vec::new();
            for family in &families {
                let name = format!("{}.cu", family.stem);
                let what = format!("NVRTC {major}.{minor} ({path}), sm_{arch}, kernels/{name}");
                let start = Instant::now();
                let compiled = lib.compile(&program_source(family), &name, &options);
                let elapsed = start.elapsed();
                total += elapsed;
                times.push(format!("{} {:.0} ms", family.stem, elapsed.as_secs_f64() * 1e3));
                match compiled {
                    Err(e) => failures.push(format!("{what}: {e}")),
                    Ok(c) if !c.log.is_empty() => failures.push(format!("{what}: warnings\n{}", c.log)),
                    Ok(c) => {
                        if !c.cubin.starts_with(b"\x7fELF") {
                            failures.push(format!("{what}: the CUBIN is not an ELF image"));
                        }
                        for kernel in kernel_names(&family.source) {
                            if !c.cubin.windows(kernel.len()).any(|w| w == kernel.as_bytes()) {
                                failures.push(format!("{what}: kernel {kernel} is missing from the CUBIN"));
                            }
                        }
                    }
                }
            }
            println!(
                "NVRTC {major}.{minor} ({path}) sm_{arch}: {} families in {:.2} s ({})",
                families.len(),
                total.as_secs_f64(),
                times.join(", ")
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
