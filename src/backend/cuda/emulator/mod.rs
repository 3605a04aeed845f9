//! A [`Gpu`] on the CPU, for tests: `kernels/*.cu` compiled by the system's C++ compiler against
//! `shim.h` (each block's threads as fibers that meet at every `__syncthreads`), and the GEMMs as plain
//! column-major loops. It runs the CUDA backend's own op logic, kernels and GEMM layouts, so the conformance
//! suite checks all three on a machine without a GPU; only the driver calls are left to a GPU run.
//!
//! Every transfer, fill, copy and GEMM operand is checked to lie inside one allocation, so an op that
//! addresses memory wrongly fails here instead of corrupting it.

use super::super::BackendError;
use super::compile::{kernel_names, FAMILIES};
use super::gpu::{Addr, Gemm, Gpu, Op, Param};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The launcher the compiled library exports: `emu_launch(name, blocks, threads, params)`, 0 on success.
type Launch = unsafe extern "C" fn(*const std::ffi::c_char, u32, u32, *mut *mut std::ffi::c_void) -> i32;

/// The C++ program: the shim, each family in a namespace of its own (families may reuse helper names),
/// and a launcher naming every kernel.
fn program() -> String {
    let mut text = String::from(include_str!("shim.h"));
    let common = include_str!("../../../../kernels/common.cuh");
    let mut dispatch = String::new();
    for (stem, source) in FAMILIES {
        text += &format!(
            "namespace family_{stem} {{\n#line 1 \"kernels/common.cuh\"\n{common}\n#line 1 \"kernels/{stem}.cu\"\n{source}\n}}\n"
        );
        for name in kernel_names(source) {
            dispatch += &format!(
                "    if (strcmp(name, \"{name}\") == 0) {{ emu::grid(family_{stem}::{name}, blocks, threads, params); return 0; }}\n"
            );
        }
    }
    text + &format!(
        "extern \"C\" int emu_launch(const char* name, unsigned blocks, unsigned threads, void** params) {{\n{dispatch}    return -1;\n}}\n"
    )
}

/// How the error starts when there is no C++ compiler to run (the one case the tests may skip).
pub(in crate::backend::cuda) const NO_COMPILER: &str = "no C++ compiler";

/// The kernels compiled and loaded, once per process; the error says why they are not. The build folder
/// is removed once the library is loaded.
fn library() -> Result<&'static libloading::Library, String> {
    static LOADED: OnceLock<Result<libloading::Library, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("ringtrain-cuda-emulator-{}", std::process::id()));
            let built = build(&dir).and_then(|path| {
                // SAFETY: the library was just built from the kernels and the shim; loading it runs no code
                // beyond C++ static initialisers of plain arrays.
                unsafe { libloading::Library::new(&path) }.map_err(|e| e.to_string())
            });
            let _ = std::fs::remove_dir_all(&dir);
            built
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Compiles `program()` into a shared library in `dir`.
fn build(dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let source = dir.join("kernels.cpp");
    let library = dir.join("libkernels.so");
    std::fs::write(&source, program()).map_err(|e| format!("writing {}: {e}", source.display()))?;
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let output = std::process::Command::new(&compiler)
        .args([
            "-std=c++20",
            "-O2",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-shared",
            "-fPIC",
            "-w",
        ])
        .arg("-o")
        .arg(&library)
        .arg(&source)
        .output()
        .map_err(|e| format!("{NO_COMPILER} ({compiler}: {e})"))?;
    if !output.status.success() {
        return Err(format!(
            "{compiler} could not compile the kernels for the emulator:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(library)
}

/// The emulated device.
pub(in crate::backend::cuda) struct Emulator {
    /// `emu_launch` of the loaded library, which lives as long as the process.
    launch: Launch,
    /// Every allocation by its address: the address is the memory's own host address, so the kernels
    /// dereference it directly.
    allocations: HashMap<Addr, Box<[u32]>>,
    /// Finished reads by ticket (the emulator runs everything at once).
    reads: HashMap<u64, Vec<f32>>,
    next_ticket: u64,
    /// GEMM inputs rounded to TF32 ([`Gpu::set_tf32`]).
    tf32: bool,
}

/// `x` rounded to TF32 (10 mantissa bits) to nearest, ties away from zero, as the tensor cores' input
/// conversion does; infinities and NaN pass unchanged.
fn to_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits((x.to_bits() + 0x1000) & 0xffff_e000)
}

impl Emulator {
    /// Compiles the kernels (once per process) and loads them; the error says what is missing.
    pub(in crate::backend::cuda) fn new() -> Result<Self, String> {
        let library = library()?;
        // SAFETY: `emu_launch` is defined by `program()` with exactly the `Launch` signature, and the library
        // stays loaded for the rest of the process.
        let launch = *unsafe { library.get::<Launch>(b"emu_launch\0") }.map_err(|e| e.to_string())?;
        Ok(Emulator {
            launch,
            allocations: HashMap::new(),
            reads: HashMap::new(),
            next_ticket: 0,
            tf32: false,
        })
    }

    /// Panics unless `[addr, addr + bytes)` lies inside one allocation: a wrong address is a bug in the op.
    fn check(&self, addr: Addr, bytes: usize, what: &str) {
        let inside = self
            .allocations
            .iter()
            .any(|(&start, words)| addr >= start && addr + bytes as u64 <= start + 4 * words.len() as u64);
        assert!(
            inside,
            "{what}: {bytes} bytes at {addr:#x} are outside every allocation"
        );
    }

    /// Panics unless a column-major `rows x cols` operand with leading dimension `ld` lies inside one
    /// allocation.
    fn check_matrix(&self, addr: Addr, rows: usize, cols: usize, ld: usize, what: &str) {
        assert!(ld >= rows.max(1), "{what}: leading dimension {ld} below {rows} rows");
        if rows > 0 && cols > 0 {
            self.check(addr, 4 * ((cols - 1) * ld + rows), what);
        }
    }
}

impl Gpu for Emulator {
    fn describe(&self) -> String {
        "emulated on the CPU".into()
    }

    fn alloc(&mut self, words: usize, _what: &str) -> Result<Addr, BackendError> {
        let memory = vec![0u32; words.max(1)].into_boxed_slice();
        let addr = memory.as_ptr() as Addr;
        self.allocations.insert(addr, memory);
        Ok(addr)
    }

    fn free(&mut self, addr: Addr) -> Result<(), BackendError> {
        assert!(
            self.allocations.remove(&addr).is_some(),
            "freeing {addr:#x}, which is not an allocation"
        );
        Ok(())
    }

    fn write(&mut self, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        self.check(dst, src.len(), "write");
        // SAFETY: checked to lie inside one live allocation; `src` is a separate host slice.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn read(&mut self, src: Addr, dst: &mut [u8]) -> Result<(), BackendError> {
        self.check(src, dst.len(), "read");
        // SAFETY: checked to lie inside one live allocation; `dst` is a separate host slice.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn fill(&mut self, dst: Addr, bits: u32, words: usize) -> Result<(), BackendError> {
        self.check(dst, 4 * words, "fill");
        // SAFETY: checked to lie inside one live allocation of 4-byte-aligned words.
        unsafe { std::slice::from_raw_parts_mut(dst as *mut u32, words) }.fill(bits);
        Ok(())
    }

    fn copy(&mut self, dst: Addr, src: Addr, bytes: usize) -> Result<(), BackendError> {
        self.check(dst, bytes, "copy destination");
        self.check(src, bytes, "copy source");
        // SAFETY: both checked to lie inside live allocations; `copy` handles overlap (the ops forbid it).
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn launch(
        &mut self,
        kernel: &'static str,
        blocks: u32,
        threads: u32,
        params: &[Param],
    ) -> Result<(), BackendError> {
        assert!((1..=256).contains(&threads), "{kernel}: {threads} threads per block");
        // Each parameter in an 8-byte slot: a pointer fills it; a u32 or f32 sits in its first 4 bytes, where a
        // little-endian read of that size finds it.
        let mut slots: Vec<u64> = params
            .iter()
            .map(|p| match *p {
                Param::Ptr(a) => a,
                Param::U32(u) => u as u64,
                Param::F32(f) => f.to_bits() as u64,
            })
            .collect();
        let mut pointers: Vec<*mut std::ffi::c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut _).collect();
        let name = std::ffi::CString::new(kernel).expect("kernel names hold no NUL");
        // The shim's fibers and the kernels' `__shared__` arrays are process-wide statics: one launch at a
        // time, whichever test thread asks.
        static ONE_LAUNCH_AT_A_TIME: Mutex<()> = Mutex::new(());
        let _turn = ONE_LAUNCH_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the launcher calls the named kernel with each parameter read through `pointers` at the
        // kernel's declared type, as cuLaunchKernel does; the device addresses are live host memory.
        let status = unsafe { (self.launch)(name.as_ptr(), blocks, threads, pointers.as_mut_ptr()) };
        assert_eq!(status, 0, "the emulator has no kernel named {kernel}");
        Ok(())
    }

    fn gemm(&mut self, g: &Gemm) -> Result<(), BackendError> {
        let dims = |op, rows, cols| if op == Op::N { (rows, cols) } else { (cols, rows) };
        let (a_rows, a_cols) = dims(g.op_a, g.m, g.k);
        let (b_rows, b_cols) = dims(g.op_b, g.k, g.n);
        self.check_matrix(g.a, a_rows, a_cols, g.lda, "gemm A");
        self.check_matrix(g.b, b_rows, b_cols, g.ldb, "gemm B");
        self.check_matrix(g.c, g.m, g.n, g.ldc, "gemm C");
        let tf32 = self.tf32;
        let at = |base: Addr, ld: usize, op: Op, i: usize, j: usize| -> f32 {
            let (r, c) = if op == Op::N { (i, j) } else { (j, i) };
            // SAFETY: (r, c) lies inside the operand checked above.
            let x = unsafe { *((base as *const f32).add(c * ld + r)) };
            if tf32 {
                to_tf32(x)
            } else {
                x
            }
        };
        for j in 0..g.n {
            for i in 0..g.m {
                let mut sum = 0f32;
                for p in 0..g.k {
                    sum += at(g.a, g.lda, g.op_a, i, p) * at(g.b, g.ldb, g.op_b, p, j);
                }
                // SAFETY: (i, j) lies inside C, checked above; no other reference to it is live.
                let c = unsafe { &mut *((g.c as *mut f32).add(j * g.ldc + i)) };
                *c = if g.beta == 0.0 { sum } else { g.beta * *c + sum };
            }
        }
        Ok(())
    }

    fn set_tf32(&mut self, on: bool) -> Result<(), BackendError> {
        self.tf32 = on;
        Ok(())
    }

    fn begin_read(&mut self, src: Addr, words: usize) -> Result<u64, BackendError> {
        let mut host = vec![0f32; words];
        self.read(src, bytemuck::cast_slice_mut(&mut host))?;
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.reads.insert(ticket, host);
        Ok(ticket)
    }

    fn read_ready(&mut self, ticket: u64) -> Result<bool, BackendError> {
        Ok(self.reads.contains_key(&ticket))
    }

    fn finish_read(&mut self, ticket: u64, host: &mut Vec<f32>) -> Result<(), BackendError> {
        *host = self
            .reads
            .remove(&ticket)
            .ok_or_else(|| BackendError::InvalidView(format!("read #{ticket} is not in flight")))?;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    fn free_memory(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests;
