//! `ringtrain bench kernels [--backend cpu|wgpu|auto] [--sizes 512,1024] [--iters K]`: matmul GFLOP/s and
//! elementwise bandwidth of one backend, timed through the Backend trait (ops queued, then `synchronize`).
//! The references run in the same process, timed in rounds that alternate with the backend's so that both
//! see the same machine (on a shared machine the CPU figure moves 3x between minutes): a plain Rust loop on
//! the same cores for the elementwise op, and, for a backend other than the CPU one, the CPU backend's
//! matmul.

use super::backend::{open_backend, parse_backend};
use anyhow::{ensure, Result};
use ringtrain::backend::factory::{self, BackendChoice, BackendKind};
use ringtrain::backend::matmul_bench::MatmulBench;
use ringtrain::backend::{AddInplace, Backend};
use std::time::Instant;

/// Elements of the elementwise benchmark: 128M f32 (512 MiB per operand), past any L3 cache (this
/// project's CI machines have 260 MiB of it), so both sides measure memory bandwidth.
const ELEMENTWISE_LEN: usize = 1 << 27;

pub fn run_bench_kernels(backend: &str, sizes: &[usize], iters: usize) -> Result<()> {
    ensure!(
        !sizes.is_empty() && sizes.iter().all(|&s| (1..=8192).contains(&s)),
        "--sizes must be in 1..=8192"
    );
    ensure!((1..=1000).contains(&iters), "--iters must be in 1..=1000");
    let (be, selection) = open_backend(parse_backend(Some(backend))?, 0)?;
    println!("# {}", selection.reason);
    bench_all(be, selection.kind != BackendKind::Cpu, sizes, iters)
}

/// Timed rounds, each alternating the backend with its reference: the CPU backend's matmul (per size, for
/// a non-CPU backend) and the native element-wise loop.
const REFERENCE_ROUNDS: usize = 3;

fn bench_all<B: Backend>(mut be: B, with_cpu_reference: bool, sizes: &[usize], iters: usize) -> Result<()> {
    println!("# backend: {}", be.name());
    let mut cpu = if with_cpu_reference {
        Some(factory::open(BackendChoice::Cpu, 0)?.0)
    } else {
        None
    };
    for &s in sizes {
        let mut subject = MatmulBench::new(&mut be, s, s, s)?;
        let Some(cpu) = cpu.as_mut() else {
            let gflops = subject.gflops(&mut be, iters)?;
            println!(
                "{}",
                serde_json::json!({"op": "matmul_forward", "m": s, "k": s, "n": s, "backend": be.name(), "gflops": gflops})
            );
            continue;
        };
        let mut reference = MatmulBench::new(cpu, s, s, s)?;
        let (mut rounds, mut ratios) = (Vec::new(), Vec::new());
        for _ in 0..REFERENCE_ROUNDS {
            let (mine, theirs) = (subject.gflops(&mut be, iters)?, reference.gflops(cpu, iters)?);
            rounds.push(serde_json::json!({"gflops": mine, "cpu_gflops": theirs}));
            ratios.push(mine / theirs);
        }
        let (worst, best) = min_max(&ratios);
        println!(
            "{}",
            serde_json::json!({"op": "matmul_forward", "m": s, "k": s, "n": s, "backend": be.name(),
                "rounds": rounds, "ratio_to_cpu_min": worst, "ratio_to_cpu_max": best})
        );
    }
    let rounds = bench_add(&mut be, iters)?;
    // Whole-run rates (each round moves the same bytes), and the ratio of each round.
    let harmonic = |rates: Vec<f64>| rates.len() as f64 / rates.iter().map(|r| 1.0 / r).sum::<f64>();
    let backend_gbs = harmonic(rounds.iter().map(|r| r.0).collect());
    let native_gbs = harmonic(rounds.iter().map(|r| r.1).collect());
    let (worst, best) = min_max(&rounds.iter().map(|(b, n)| b / n).collect::<Vec<_>>());
    println!(
        "{}",
        serde_json::json!({"op": "add_inplace", "len": ELEMENTWISE_LEN, "backend": be.name(),
            "gb_per_s": backend_gbs, "native_loop_gb_per_s": native_gbs, "ratio": backend_gbs / native_gbs,
            "rounds": rounds.iter().map(|(b, n)| serde_json::json!({"gb_per_s": b, "native_loop_gb_per_s": n})).collect::<Vec<_>>(),
            "ratio_min": worst, "ratio_max": best})
    );
    Ok(())
}

fn min_max(values: &[f64]) -> (f64, f64) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    (min, values.iter().copied().fold(f64::NEG_INFINITY, f64::max))
}

/// `dst += src` over [`ELEMENTWISE_LEN`] elements: bytes moved = 3 × 4 × len per call (read both, write one).
/// Returns, for each of [`REFERENCE_ROUNDS`] rounds, the backend's GB/s and then a native single-pass Rust
/// loop's (rayon over the same cores), so that both see the same machine.
fn bench_add<B: Backend>(be: &mut B, iters: usize) -> Result<Vec<(f64, f64)>> {
    use rayon::prelude::*;
    let n = ELEMENTWISE_LEN;
    let bytes = 12.0 * n as f64 * iters as f64;
    let (dst, src) = (be.alloc(n)?, be.alloc(n)?); // [n] each
    be.fill(src, 1.0);
    be.add_inplace(AddInplace { dst, src }.checked());
    be.synchronize()?;
    let (mut d, s) = (vec![0f32; n], vec![1f32; n]); // [n] each
    let native_add = |d: &mut [f32]| {
        d.par_chunks_mut(1 << 16)
            .zip(s.par_chunks(1 << 16))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += s))
    };
    native_add(&mut d);
    let mut rounds = Vec::new();
    for _ in 0..REFERENCE_ROUNDS {
        let started = Instant::now();
        for _ in 0..iters {
            be.add_inplace(AddInplace { dst, src }.checked());
        }
        be.synchronize()?;
        let backend = bytes / started.elapsed().as_secs_f64() / 1e9;
        let started = Instant::now();
        for _ in 0..iters {
            native_add(&mut d);
        }
        let native = bytes / started.elapsed().as_secs_f64() / 1e9;
        rounds.push((backend, native));
    }
    std::hint::black_box(&d);
    Ok(rounds)
}
