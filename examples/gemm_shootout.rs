//! Single-threaded sgemm: matrixmultiply against the `gemm` crate on the shapes of one training step of the
//! `tiny` and `small` presets, and a check that each library's output bits do not depend on how many rows
//! one call covers (the trainer splits a gemm's rows across threads).
//!
//! `cargo run --release --features gemm-shootout --example gemm_shootout [ROUNDS]` prints one line per shape: the median GFLOP/s
//! of each library over ROUNDS alternating rounds (default 7), and whether row-block calls reproduce the
//! full call bit for bit. `gemm_shootout bits` lists, per shape, every row-block size up to 64 that does
//! not reproduce the full call.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// One gemm of a training step: `c [m, n] = a [m, k] @ b [k, n] (+ c if accumulate)`, with element
/// strides (row, column) for a and b; c is row-major.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    m: usize,
    k: usize,
    n: usize,
    a: (usize, usize),
    b: (usize, usize),
    accumulate: bool,
}

/// A linear layer `[rows, cin] -> [rows, cout]`: forward, dinp and dW, for a weight stored `[cin, cout]`
/// (`out_in` false) or `[cout, cin]` (the tied LM head).
fn linear(out: &mut Vec<Shape>, name: &'static str, rows: usize, cin: usize, cout: usize, out_in: bool) {
    // W as a cin x cout matrix, and its transpose.
    let w = if out_in { (1, cin) } else { (cout, 1) };
    let w_t = (w.1, w.0);
    let s = |name, m, k, n, a, b, accumulate| Shape {
        name,
        m,
        k,
        n,
        a,
        b,
        accumulate,
    };
    out.push(s(name, rows, cin, cout, (cin, 1), w, false));
    out.push(s("  dinp", rows, cout, cin, (cout, 1), w_t, false));
    if out_in {
        // dW [cout, cin] += dout^T @ inp
        out.push(s("  dW", cout, rows, cin, (1, cout), (cin, 1), true));
    } else {
        // dW [cin, cout] += inp^T @ dout
        out.push(s("  dW", cin, rows, cout, (1, cin), (cout, 1), true));
    }
}

/// Per (sequence, head) products of attention with t positions, width c and head size hs, as the CPU
/// backend issues them (full square and one 32-row causal block).
fn attention(out: &mut Vec<Shape>, t: usize, c: usize, hs: usize) {
    let qkv = 3 * c;
    let s = |name, m, k, n, a, b| Shape {
        name,
        m,
        k,
        n,
        a,
        b,
        accumulate: false,
    };
    out.push(s("att Q Kt", t, hs, t, (qkv, 1), (1, qkv)));
    out.push(s("att P V", t, t, hs, (t, 1), (qkv, 1)));
    out.push(s("att Q Kt blk32", 32, hs, t, (qkv, 1), (1, qkv)));
    out.push(s("att P V blk32", 32, t, hs, (t, 1), (qkv, 1)));
    out.push(s("att Pt dO", t, t, hs, (1, t), (c, 1)));
    out.push(s("att dS K", t, t, hs, (t, 1), (qkv, 1)));
}

fn step_shapes(rows: usize, t: usize, c: usize, nh: usize, vocab: usize) -> Vec<Shape> {
    let mut v = Vec::new();
    linear(&mut v, "qkv", rows, c, 3 * c, false);
    linear(&mut v, "attproj", rows, c, c, false);
    linear(&mut v, "fc", rows, c, 4 * c, false);
    linear(&mut v, "fcproj", rows, 4 * c, c, false);
    linear(&mut v, "lm head", rows, c, vocab, true);
    attention(&mut v, t, c, c / nh);
    v
}

#[derive(Clone, Copy, PartialEq)]
enum Lib {
    MatrixMultiply,
    Gemm,
}

/// The elements a strided matrix needs.
fn extent(rows: usize, cols: usize, (rs, cs): (usize, usize)) -> usize {
    (rows - 1) * rs + (cols - 1) * cs + 1
}

/// `c[r0..r1] (=|+=) a[r0..r1] @ b` with `lib`.
fn call(lib: Lib, s: &Shape, r0: usize, r1: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, k, n) = (r1 - r0, s.k, s.n);
    assert!(r0 < r1 && r1 <= s.m);
    assert!(r0 * s.a.0 + extent(m, k, s.a) <= a.len() && extent(k, n, s.b) <= b.len());
    assert!(r1 * n <= c.len());
    let a = &a[r0 * s.a.0..];
    let c = &mut c[r0 * n..];
    let i = |x: usize| x as isize;
    let beta = if s.accumulate { 1.0 } else { 0.0 };
    // SAFETY: the asserts above bound every index both libraries touch inside `a`, `b` and `c`; `c` is
    // a unique borrow.
    unsafe {
        match lib {
            Lib::MatrixMultiply => matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                i(s.a.0),
                i(s.a.1),
                b.as_ptr(),
                i(s.b.0),
                i(s.b.1),
                beta,
                c.as_mut_ptr(),
                i(n),
                1,
            ),
            // gemm: dst = alpha * dst + beta * lhs @ rhs, with (column, row) stride order.
            Lib::Gemm => gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                i(n),
                s.accumulate,
                a.as_ptr(),
                i(s.a.1),
                i(s.a.0),
                b.as_ptr(),
                i(s.b.1),
                i(s.b.0),
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            ),
        }
    }
}

/// Whether calls over row blocks of `rows` rows give the full call's bits.
fn row_blocks_match(lib: Lib, s: &Shape, a: &[f32], b: &[f32], c0: &[f32]) -> bool {
    let mut full = c0.to_vec();
    call(lib, s, 0, s.m, a, b, &mut full);
    [1, 3, 7, 16, 32, 33, s.m.div_ceil(2), s.m - 1]
        .into_iter()
        .filter(|&rows| rows >= 1 && rows < s.m)
        .all(|rows| {
            let mut split = c0.to_vec();
            for r0 in (0..s.m).step_by(rows) {
                call(lib, s, r0, (r0 + rows).min(s.m), a, b, &mut split);
            }
            split.iter().zip(&full).all(|(x, y)| x.to_bits() == y.to_bits())
        })
}

/// The row-block sizes in 1..=64 whose calls do not reproduce the full call's bits.
fn mismatching_blocks(lib: Lib, s: &Shape, a: &[f32], b: &[f32], c0: &[f32]) -> Vec<usize> {
    let mut full = c0.to_vec();
    call(lib, s, 0, s.m, a, b, &mut full);
    (1..=64.min(s.m - 1))
        .filter(|&rows| {
            let mut split = c0.to_vec();
            for r0 in (0..s.m).step_by(rows) {
                call(lib, s, r0, (r0 + rows).min(s.m), a, b, &mut split);
            }
            split.iter().zip(&full).any(|(x, y)| x.to_bits() != y.to_bits())
        })
        .collect()
}

/// GFLOP/s of one timing of `reps` full calls.
fn gflops(lib: Lib, s: &Shape, a: &[f32], b: &[f32], c: &mut [f32], reps: usize) -> f64 {
    let start = Instant::now();
    for _ in 0..reps {
        call(lib, s, 0, s.m, a, b, c);
    }
    (2 * s.m * s.k * s.n * reps) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(|a, b| a.total_cmp(b));
    x[x.len() / 2]
}

fn main() {
    let arg = std::env::args().nth(1);
    // `bits`: only list, per shape, the row-block sizes that change the bits.
    let bits_only = arg.as_deref() == Some("bits");
    let rounds: usize = arg.and_then(|x| x.parse().ok()).unwrap_or(7);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    // (preset, t, c, nh): rows = batch 8 x t, vocab 256.
    for (preset, t, c, nh) in [("tiny", 64, 64, 4), ("small", 128, 128, 4)] {
        println!("== {preset}: rows {} (8 x {t}), c {c}, nh {nh}, vocab 256", 8 * t);
        if !bits_only {
            println!(
                "{:<16} {:>5} {:>5} {:>5} {:>9} {:>9} {:>6}  bits(mm, gemm)",
                "shape", "m", "k", "n", "mm", "gemm", "ratio"
            );
        }
        for s in step_shapes(8 * t, t, c, nh, 256) {
            let a: Vec<f32> = (0..extent(s.m, s.k, s.a))
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let b: Vec<f32> = (0..extent(s.k, s.n, s.b))
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let c0: Vec<f32> = (0..s.m * s.n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let bits = [Lib::MatrixMultiply, Lib::Gemm].map(|lib| row_blocks_match(lib, &s, &a, &b, &c0));
            if bits_only {
                let bad = [Lib::MatrixMultiply, Lib::Gemm].map(|lib| mismatching_blocks(lib, &s, &a, &b, &c0));
                println!(
                    "{:<16} {:>5} {:>5} {:>5}  mismatching row blocks: mm {:?} gemm {:?}",
                    s.name, s.m, s.k, s.n, bad[0], bad[1]
                );
                continue;
            }
            // About 20 ms per timing.
            let reps = (1e7 / (2 * s.m * s.k * s.n) as f64).ceil() as usize;
            let mut c = c0.clone();
            let (mut mm, mut gm) = (Vec::new(), Vec::new());
            for round in 0..rounds {
                // Alternate which library goes first.
                if round % 2 == 0 {
                    mm.push(gflops(Lib::MatrixMultiply, &s, &a, &b, &mut c, reps));
                    gm.push(gflops(Lib::Gemm, &s, &a, &b, &mut c, reps));
                } else {
                    gm.push(gflops(Lib::Gemm, &s, &a, &b, &mut c, reps));
                    mm.push(gflops(Lib::MatrixMultiply, &s, &a, &b, &mut c, reps));
                }
            }
            let (mm, gm) = (median(mm), median(gm));
            println!(
                "{:<16} {:>5} {:>5} {:>5} {:>9.1} {:>9.1} {:>6.2}  {:?}",
                s.name,
                s.m,
                s.k,
                s.n,
                mm,
                gm,
                gm / mm,
                bits
            );
        }
    }
}
