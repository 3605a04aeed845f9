//! The float type of the CPU backend. The reference ops are generic so that the same readable code runs in
//! f32 (training) and in f64 (finite-difference gradient checks).

use num_traits::Float;
use std::fmt::Debug;

pub trait Real: Float + Send + Sync + Debug + Default + std::iter::Sum + 'static {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// `c = a @ b + beta * c` with explicit row/column strides (so transposes are free).
    /// `m x k` times `k x n`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(m: usize, k: usize, n: usize, a: Strided<Self>, b: Strided<Self>, beta: Self, c: StridedMut<Self>);
}

/// A read-only matrix view: `data[i * rs + j * cs]`.
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

impl Real for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn gemm(m: usize, k: usize, n: usize, a: Strided<f32>, b: Strided<f32>, beta: f32, c: StridedMut<f32>) {
        check_gemm(m, k, n, &a, &b, &c);
        if m == 0 || n == 0 {
            return;
        }
        // SAFETY: check_gemm proved every index touched through these pointers and strides lies inside the
        // borrowed slices; `c` is a unique borrow, so it does not alias `a` or `b`.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.data.as_ptr(),
                isize_of(a.rs),
                isize_of(a.cs),
                b.data.as_ptr(),
                isize_of(b.rs),
                isize_of(b.cs),
                beta,
                c.data.as_mut_ptr(),
                isize_of(c.rs),
                isize_of(c.cs),
            )
        }
    }
}

impl Real for f64 {
    fn from_f32(x: f32) -> Self {
        x as f64
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn gemm(m: usize, k: usize, n: usize, a: Strided<f64>, b: Strided<f64>, beta: f64, c: StridedMut<f64>) {
        check_gemm(m, k, n, &a, &b, &c);
        if m == 0 || n == 0 {
            return;
        }
        // SAFETY: as for f32: every touched index is in bounds and `c` is a unique borrow.
        unsafe {
            matrixmultiply::dgemm(
                m,
                k,
                n,
                1.0,
                a.data.as_ptr(),
                isize_of(a.rs),
                isize_of(a.cs),
                b.data.as_ptr(),
                isize_of(b.rs),
                isize_of(b.cs),
                beta,
                c.data.as_mut_ptr(),
                isize_of(c.rs),
                isize_of(c.cs),
            )
        }
    }
}
