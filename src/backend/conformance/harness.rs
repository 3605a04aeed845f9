//! Running one case: its operands laid out in one buffer with gaps, the op run on the backend under test and
//! on the reference, and the whole buffers compared into a [`CaseResult`].

use super::tolerance::{Tolerance, SUM_SQUARES};
use super::{CaseResult, Finding, Reference, Settings, Worst};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, TokenView, View};
use anyhow::Result;
use rand::RngExt;
use rand_chacha::ChaCha8Rng;

/// Elements before each operand (and after the last): odd, so that views never start on a binding
/// alignment, and checked to stay untouched.
pub const GAP: usize = 37;

/// Token elements before each token operand (and after the last).
const TOKEN_GAP: usize = 3;

/// The operands of one op call, in the order the op takes them: f32 tensors and token tensors.
#[derive(Clone, Default)]
pub struct Operands {
    pub floats: Vec<Vec<f32>>,
    pub tokens: Vec<Vec<u32>>,
    /// Indices into `floats` of operands the op may use as it likes (a backend's own saved state or
    /// scratch): not compared. The gaps around them still are.
    pub unchecked: Vec<usize>,
}

impl Operands {
    /// Appends `n` values uniform in `[-scale, scale)`.
    pub fn rand(mut self, rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Self {
        self.floats
            .push((0..n).map(|_| rng.random_range(-1.0..1.0f32) * scale).collect());
        self
    }

    /// Appends `n` zeros.
    pub fn zeros(mut self, n: usize) -> Self {
        self.floats.push(vec![0.0; n]);
        self
    }

    /// Appends `n` values uniform in `[lo, hi)`.
    pub fn positive(mut self, rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Self {
        self.floats.push((0..n).map(|_| rng.random_range(lo..hi)).collect());
        self
    }

    /// Appends `n` zeros the op may use as it likes: not compared.
    pub fn unchecked(mut self, n: usize) -> Self {
        self.unchecked.push(self.floats.len());
        self.zeros(n)
    }

    /// Appends given values.
    pub fn values(mut self, values: Vec<f32>) -> Self {
        self.floats.push(values);
        self
    }

    /// Appends given token values.
    pub fn token_values(mut self, values: Vec<u32>) -> Self {
        self.tokens.push(values);
        self
    }

    /// Appends `n` token ids below `v`.
    pub fn tokens(mut self, rng: &mut ChaCha8Rng, n: usize, v: usize) -> Self {
        // Few distinct ids, so that the embedding backward accumulates repeated tokens.
        let pool: Vec<u32> = (0..(n / 2).max(1)).map(|_| rng.random_range(0..v as u32)).collect();
        self.tokens
            .push((0..n).map(|_| pool[rng.random_range(0..pool.len())]).collect());
        self
    }
}

/// One op call on views of the operands, in the order of [`Operands`].
pub type Op<'a> = &'a dyn Fn(&mut dyn Backend, &[View], &[TokenView]);

/// Where each operand of `lens` starts, and the length of the whole buffer: each after a gap of [`GAP`], or,
/// with `straddle`, across the next multiple of it (so that the view spans two of a segmented backend's
/// buffers).
pub fn placement(lens: &[usize], straddle: Option<usize>) -> (Vec<usize>, usize) {
    let mut starts = Vec::new();
    let mut at = 0;
    for &len in lens {
        let mut start = at + GAP;
        if let Some(segment) = straddle {
            let boundary = (start / segment + 1) * segment;
            start = start.max(boundary.saturating_sub(len / 2));
        }
        starts.push(start);
        at = start + len;
    }
    (starts, at + GAP)
}

/// Runs the cases of one group on a backend and hands each result to a sink as it is known.
pub struct Runner<'a> {
    be: &'a mut dyn Backend,
    settings: Settings,
    sink: &'a mut dyn FnMut(CaseResult),
}

impl<'a> Runner<'a> {
    pub fn new(be: &'a mut dyn Backend, settings: Settings, sink: &'a mut dyn FnMut(CaseResult)) -> Self {
        Runner { be, settings, sink }
    }

    /// Whether every operand straddles segments (a segmented backend's run).
    pub fn straddles(&self) -> bool {
        self.settings.straddle.is_some()
    }

    /// Runs `op` on the backend and on the reference, and compares the whole buffers.
    pub fn check(&mut self, op: &str, shape: &str, operands: &Operands, tol: Tolerance, call: Op) {
        let straddle = self.settings.straddle;
        let want = match self.settings.reference {
            Reference::F32 => run(&mut CpuBackend::<f32>::new(), operands, call, straddle),
            Reference::F64 => run(&mut CpuBackend::<f64>::new(), operands, call, straddle),
        };
        let finding = match (run(self.be, operands, call, straddle), want) {
            (Ok(mut got), Ok(mut want)) => {
                let lens: Vec<usize> = operands.floats.iter().map(Vec::len).collect();
                let (starts, _) = placement(&lens, straddle);
                for &i in &operands.unchecked {
                    got[starts[i]..starts[i] + lens[i]].fill(0.0);
                    want[starts[i]..starts[i] + lens[i]].fill(0.0);
                }
                compare(&got, &want, tol)
            }
            (Err(e), _) => Finding::Error(format!("{e:#}")),
            (_, Err(e)) => Finding::Error(format!("reference: {e:#}")),
        };
        self.report(op, shape, finding);
    }

    /// `sum_squares` of `x` (placed as an operand is) against the reference's.
    pub fn check_sum_squares(&mut self, shape: &str, x: &[f32]) {
        let want = match self.settings.reference {
            Reference::F32 => sum_squares(&mut CpuBackend::<f32>::new(), x, None),
            Reference::F64 => sum_squares(&mut CpuBackend::<f64>::new(), x, None),
        };
        let finding = match (sum_squares(self.be, x, self.settings.straddle), want) {
            (Ok(got), Ok(want)) => {
                let err = (got - want).abs();
                let bound = f64::from(SUM_SQUARES.abs) + f64::from(SUM_SQUARES.rel) * want.abs();
                let worst = Worst {
                    index: 0,
                    got,
                    want,
                    err,
                    bound,
                    tolerance: SUM_SQUARES,
                };
                let within = err <= bound;
                Finding::Elements {
                    mismatches: usize::from(!within),
                    worst,
                }
            }
            (Err(e), _) => Finding::Error(format!("{e:#}")),
            (_, Err(e)) => Finding::Error(format!("reference: {e:#}")),
        };
        self.report("sum_squares", shape, finding);
    }

    /// `sum_squares` of a view holding a NaN must not be finite (the optimizer skips such steps).
    pub fn check_sum_squares_propagates_nan(&mut self) {
        let x = [1.0, f32::NAN, 0.0, 2.0, 3.0];
        let finding = match sum_squares(self.be, &x, None) {
            Ok(got) => Finding::Property {
                holds: !got.is_finite(),
                what: format!("non-finite result wanted, got {got}"),
            },
            Err(e) => Finding::Error(format!("{e:#}")),
        };
        self.report("sum_squares", "n5 with a NaN", finding);
    }

    fn report(&mut self, op: &str, shape: &str, finding: Finding) {
        (self.sink)(CaseResult {
            op: op.to_string(),
            shape: shape.to_string(),
            finding,
        });
    }
}

/// Lays the operands out in one f32 buffer (and one token buffer), runs `call`, and returns the whole f32
/// buffer. Both buffers are freed before returning.
fn run(be: &mut dyn Backend, operands: &Operands, call: Op, straddle: Option<usize>) -> Result<Vec<f32>> {
    let lens: Vec<usize> = operands.floats.iter().map(Vec::len).collect();
    let (starts, total) = placement(&lens, straddle);
    let token_total = operands.tokens.iter().map(|x| x.len() + TOKEN_GAP).sum::<usize>() + TOKEN_GAP;
    let whole = be.alloc(total)?; // [total]
    let token_whole = match be.alloc_tokens(token_total) {
        Ok(t) => t, // [token_total]
        Err(e) => {
            be.free(whole);
            return Err(e);
        }
    };
    let result = upload_run_download(be, operands, call, (whole, &starts), token_whole);
    be.free(whole);
    be.free_tokens(token_whole);
    result
}

/// The middle of [`run`]: uploads the operands to their places in `whole` and `token_whole`, runs `call`,
/// and reads `whole` back.
fn upload_run_download(
    be: &mut dyn Backend,
    operands: &Operands,
    call: Op,
    (whole, starts): (View, &[usize]),
    token_whole: TokenView,
) -> Result<Vec<f32>> {
    let mut views = Vec::new();
    for (x, &at) in operands.floats.iter().zip(starts) {
        let v = whole.sub(at, x.len());
        be.upload(v, x)?;
        views.push(v);
    }
    let mut token_views = Vec::new();
    let mut at = TOKEN_GAP;
    for x in &operands.tokens {
        let v = token_whole.sub(at, x.len());
        be.upload_tokens(v, x)?;
        token_views.push(v);
        at += x.len() + TOKEN_GAP;
    }
    call(be, &views, &token_views);
    let mut out = vec![0f32; whole.len]; // [whole.len]
    be.download(whole, &mut out)?;
    Ok(out)
}

/// `sum_squares` of `x`, uploaded into a buffer at the place an operand of its length gets.
fn sum_squares(be: &mut dyn Backend, x: &[f32], straddle: Option<usize>) -> Result<f64> {
    let (starts, total) = placement(&[x.len()], straddle);
    let whole = be.alloc(total)?; // [total]
    let v = whole.sub(starts[0], x.len());
    let result = be.upload(v, x).and_then(|()| be.sum_squares(v));
    be.free(whole);
    result
}

/// Every element of `got` against `want`: the count out of tolerance, and the element with the largest error
/// relative to its bound (NaN where the reference has NaN counts as equal).
fn compare(got: &[f32], want: &[f32], tol: Tolerance) -> Finding {
    let mut mismatches = 0;
    let mut worst: Option<(f32, Worst)> = None;
    for (index, (&g, &w)) in got.iter().zip(want).enumerate() {
        let both_nan = g.is_nan() && w.is_nan();
        let err = if both_nan { 0.0 } else { (g - w).abs() };
        let bound = tol.bound(w);
        let within = both_nan || err <= bound;
        mismatches += usize::from(!within);
        // How far along its bound this element is; NaN (a NaN against a number) is the worst possible.
        let ratio = match err / bound {
            r if r.is_nan() && !within => f32::INFINITY,
            r if r.is_nan() => 0.0,
            r => r,
        };
        if worst.as_ref().is_none_or(|(r, _)| ratio > *r) {
            let element = Worst {
                index,
                got: f64::from(g),
                want: f64::from(w),
                err: f64::from(err),
                bound: f64::from(bound),
                tolerance: tol,
            };
            worst = Some((ratio, element));
        }
    }
    match worst {
        Some((_, worst)) => Finding::Elements { worst, mismatches },
        None => Finding::Property {
            holds: false,
            what: "empty buffer, nothing compared".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::conformance::tolerance::EXACTISH;

    fn mismatches(finding: &Finding) -> (usize, usize) {
        match finding {
            Finding::Elements { worst, mismatches } => (*mismatches, worst.index),
            other => panic!("elements were compared: {other:?}"),
        }
    }

    #[test]
    fn compare_finds_the_element_furthest_past_its_bound() {
        let want = [0.0, 1.0, -2.0, 3.0, f32::NAN];
        let mut got = want;
        assert_eq!(
            mismatches(&compare(&got, &want, EXACTISH)),
            (0, 0),
            "NaN against NaN is equal"
        );
        got[1] += 1e-3;
        got[3] -= 1e-2;
        assert_eq!(mismatches(&compare(&got, &want, EXACTISH)), (2, 3));
        got = want;
        got[0] = f32::NAN;
        assert_eq!(
            mismatches(&compare(&got, &want, EXACTISH)),
            (1, 0),
            "NaN against a number"
        );
        got = want;
        got[4] = 0.0;
        assert_eq!(
            mismatches(&compare(&got, &want, EXACTISH)),
            (1, 4),
            "a number against NaN"
        );
    }

    #[test]
    fn compare_passes_elements_within_their_bound_and_reports_the_nearest() {
        let want = [100.0, 1.0];
        // Bounds: 1e-6 + 1e-6 * 100 ~ 1.01e-4, and 2e-6.
        let got = [100.0 + 6e-5, 1.0 + 1.5e-6];
        match compare(&got, &want, EXACTISH) {
            Finding::Elements { worst, mismatches: 0 } => assert_eq!(worst.index, 1),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn placement_leaves_gaps_or_straddles_segments() {
        let (starts, total) = placement(&[10, 20], None);
        assert_eq!(starts, [GAP, 2 * GAP + 10]);
        assert_eq!(total, 3 * GAP + 30);
        let (starts, _) = placement(&[10, 100, 100], Some(64));
        for (&start, len) in starts.iter().zip([10, 100, 100]) {
            let boundary = (start / 64 + 1) * 64;
            assert!(
                start < boundary && start + len > boundary,
                "{start}+{len} does not straddle"
            );
        }
    }
}
