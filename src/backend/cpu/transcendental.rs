//! Slice-wide transcendental functions for the hot element-wise ops.
//!
//! f64 keeps the exact libm functions, so the finite-difference gradient checks stay an oracle. f32 uses a
//! branch-free `tanh` built on a polynomial `exp`: libm's `tanhf` calls `expm1f` one element at a time and
//! took about a fifth of a `small` training step; this one vectorises. Its error is absolute, not
//! relative: at most [`TANH_F32_MAX_ABS_ERROR`] over the whole line (1.14e-7 measured, one ulp of 1.0), which is what
//! GELU needs (it adds the result to 1), but it is not an accurate `tanh` of tiny arguments.

/// Bound on `|tanh_f32(x) - tanh(x)|` for every f32 `x`, checked on a dense grid by the tests below.
pub const TANH_F32_MAX_ABS_ERROR: f64 = 1.5e-7;

/// `tanh` of every element, in place.
pub trait SliceTanh: Sized {
    fn tanh_in_place(xs: &mut [Self]);
}

impl SliceTanh for f64 {
    fn tanh_in_place(xs: &mut [f64]) {
        for x in xs {
            *x = x.tanh();
        }
    }
}

impl SliceTanh for f32 {
    fn tanh_in_place(xs: &mut [f32]) {
        for x in xs {
            *x = tanh_f32(*x);
        }
    }
}

/// Past this |x|, tanh(x) rounds to ±1 in f32 (tanh(10) = 1 - 4.1e-9), and so does the formula below.
const TANH_SATURATION: f32 = 10.0;

/// `tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1))`, with `exp` from [`exp_small_positive`]. NaN stays NaN.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    // A comparison, not `min`, so that NaN passes through (`min` would turn it into a number).
    let a = if a > TANH_SATURATION { TANH_SATURATION } else { a };
    let e = exp_small_positive(2.0 * a);
    let t = 1.0 - 2.0 / (e + 1.0);
    t.copysign(x)
}

/// `exp(y)` for `y` in [0, 2 · TANH_SATURATION], relative error about 2e-7. Cody–Waite range reduction
/// `y = n ln2 + r` with `|r| <= ln2 / 2`, then a degree-7 Taylor polynomial of `exp(r)` (truncation error
/// below 6e-9) scaled by `2^n` built from its exponent bits.
#[inline(always)]
fn exp_small_positive(y: f32) -> f32 {
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer without a rounding instruction
    // (which plain x86-64 lacks and would leave the loop scalar).
    const ROUND: f32 = 12_582_912.0;
    // ln 2 split so that n * LN2_HI is exact for the small n used here (LN2_HI has 9 significant bits).
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let n = (y * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (y - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // n is in [0, 29]: a normal power of two.
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * two_n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f32 in [-12, 12] with a step of about 2^-14, plus the ends of the range and special values.
    #[test]
    fn tanh_f32_absolute_error_is_bounded() {
        let mut worst = (0.0f64, 0.0f32);
        let mut x = -12.0f32;
        while x <= 12.0 {
            let err = (tanh_f32(x) as f64 - (x as f64).tanh()).abs();
            if err > worst.0 {
                worst = (err, x);
            }
            x += 1.0 / 16384.0;
        }
        println!("largest |tanh_f32 - tanh|: {:e} at x = {}", worst.0, worst.1);
        assert!(
            worst.0 <= TANH_F32_MAX_ABS_ERROR,
            "error {:e} at x = {}",
            worst.0,
            worst.1
        );
        for tiny in [0.0f32, -0.0, 1e-30, -1e-30, f32::MIN_POSITIVE, 1e-8] {
            assert!((tanh_f32(tiny) as f64 - (tiny as f64).tanh()).abs() <= TANH_F32_MAX_ABS_ERROR);
        }
    }

    #[test]
    fn tanh_f32_saturates_keeps_sign_and_nan() {
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(tanh_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh_f32(1e30), 1.0);
        assert_eq!(tanh_f32(-20.0), -1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
        assert!(tanh_f32(-0.0).is_sign_negative());
    }

    #[test]
    fn slice_tanh_matches_the_scalar_function() {
        let mut xs: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) / 37.0).collect();
        let want: Vec<f32> = xs.iter().map(|&x| tanh_f32(x)).collect();
        f32::tanh_in_place(&mut xs);
        assert_eq!(xs, want);
        let mut ys = [0.5f64, -2.0];
        f64::tanh_in_place(&mut ys);
        assert_eq!(ys, [0.5f64.tanh(), (-2.0f64).tanh()]);
    }
}
