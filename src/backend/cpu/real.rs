//! The float type of the CPU backend. The reference ops are generic so that the same readable code runs in
//! f32 (training) and in f64 (finite-difference gradient checks).

use super::transcendental::SliceTanh;
use num_traits::Float;
use rayon::prelude::*;
use std::fmt::Debug;

pub trait Real: Float + SliceTanh + Send + Sync + Debug + Default + std::iter::Sum + 'static {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// `c = a @ b + beta * c` with explicit row/column strides (so transposes are free), single-threaded.
    /// `m x k` times `k x n`.
    fn gemm_serial(m: usize, k: usize, n: usize, a: Strided<Self>, b: Strided<Self>, beta: Self, c: StridedMut<Self>);

    /// [`Real::gemm_serial`] split into row blocks of `c` across the rayon pool. Each output element is
    /// still computed by one serial call with a fixed k order, so the bits do not depend on the split.
    fn gemm(m: usize, k: usize, n: usize, a: Strided<Self>, b: Strided<Self>, beta: Self, c: StridedMut<Self>) {
        check_gemm(m, k, n, &a, &b, &c);
        // One block per thread: matrixmultiply packs B once per call, so fewer, larger blocks pack less.
        let per_thread = m.div_ceil(rayon::current_num_threads().max(1));
        let rows_per_task = per_thread.max(ROWS_PER_TASK).max(GEMM_MIN_WORK / (k * n).max(1));
        if m <= rows_per_task || c.cs != 1 || c.rs < n {
            return Self::gemm_serial(m, k, n, a, b, beta, c);
        }
        let (a_data, b_data, rsa, csa, rsc) = (a.data, b.data, a.rs, a.cs, c.rs);
        let b_view = || Strided {
            data: b_data,
            rs: b.rs,
            cs: b.cs,
        };
        c.data
            .par_chunks_mut(rows_per_task * rsc)
            .enumerate()
            .for_each(|(block, c_rows)| {
                let i0 = block * rows_per_task;
                let rows = rows_per_task.min(m - i0);
                let a_rows = Strided {
                    data: &a_data[i0 * rsa..],
                    rs: rsa,
                    cs: csa,
                };
                Self::gemm_serial(
                    rows,
                    k,
                    n,
                    a_rows,
                    b_view(),
                    beta,
                    StridedMut {
                        data: c_rows,
                        rs: rsc,
                        cs: 1,
                    },
                );
            });
    }
}

/// Smallest row block of a parallel gemm.
const ROWS_PER_TASK: usize = 16;
/// Multiply-adds per task below which splitting costs more than it saves.
const GEMM_MIN_WORK: usize = 1 << 16;

/// A read-only matrix view: `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub struct Strided<'a, F> {
    pub data: &'a [F],
    pub rs: usize,
    pub cs: usize,
}

/// A writable matrix view: `data[i * rs + j * cs]`.
pub struct StridedMut<'a, F> {
    pub data: &'a mut [F],
    pub rs: usize,
    pub cs: usize,
}

/// The largest flat index a `rows x cols` matrix with these strides touches, plus one.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// Checks every index a gemm will touch is inside its slice, so the raw-pointer call below is in bounds.
fn check_gemm<F>(m: usize, k: usize, n: usize, a: &Strided<F>, b: &Strided<F>, c: &StridedMut<F>) {
    assert!(extent(m, k, a.rs, a.cs) <= a.data.len(), "gemm: A out of bounds");
    assert!(extent(k, n, b.rs, b.cs) <= b.data.len(), "gemm: B out of bounds");
    assert!(extent(m, n, c.rs, c.cs) <= c.data.len(), "gemm: C out of bounds");
}

fn isize_of(x: usize) -> isize {
    isize::try_from(x).expect("stride fits in isize")
}

/// `Real` for a float type whose matrixmultiply kernel is `$gemm`.
macro_rules! impl_real {
    ($t:ty, $gemm:path) => {
        impl Real for $t {
            fn from_f32(x: f32) -> Self {
                x as $t
            }
            fn to_f32(self) -> f32 {
                self as f32
            }
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn gemm_serial(m: usize, k: usize, n: usize, a: Strided<$t>, b: Strided<$t>, beta: $t, c: StridedMut<$t>) {
                check_gemm(m, k, n, &a, &b, &c);
                if m == 0 || n == 0 {
                    return;
                }
                let (rsa, csa, rsb, csb) = (isize_of(a.rs), isize_of(a.cs), isize_of(b.rs), isize_of(b.cs));
                let (rsc, csc) = (isize_of(c.rs), isize_of(c.cs));
                // SAFETY: check_gemm proved every index touched through these pointers and strides lies
                // inside the borrowed slices; `c` is a unique borrow, so it does not alias `a` or `b`.
                unsafe {
                    $gemm(
                        m,
                        k,
                        n,
                        1.0,
                        a.data.as_ptr(),
                        rsa,
                        csa,
                        b.data.as_ptr(),
                        rsb,
                        csb,
                        beta,
                        c.data.as_mut_ptr(),
                        rsc,
                        csc,
                    )
                }
            }
        }
    };
}

impl_real!(f32, matrixmultiply::sgemm);
impl_real!(f64, matrixmultiply::dgemm);
