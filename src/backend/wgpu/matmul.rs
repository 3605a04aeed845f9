//! Matmul planning: every matmul of the model (forward, input gradient, weight gradient) as one strided
//! GEMM, and the choice of kernel for it. Hardware adapters (and the hardware-kernels mode) run the tiled
//! kernel (`matmul_tiled.wgsl`, workgroup-memory tiles, split along k when its grid is small) for every
//! case. Software adapters run kernels shaped for llvmpipe, which read A and B straight from storage (no
//! workgroup memory, no barriers): the `vec4` kernel (`matmul4.wgsl`) for row-major operands with
//! 4-aligned offsets, strides, `n` and `k`, the texture-fed kernels where they apply (`software`), the
//! strided one (`matmul.wgsl`) for everything else. A GEMM whose windows exceed a storage binding, or whose
//! grid exceeds the dispatch limit, is halved along M, N or K until it fits.

use super::kernels::WG;
use super::loop_budget::{column_sum_iterations, matmul_iterations, tiled_iterations};
use super::params::{word, MatmulParams, TiledMatmulParams};
use super::windows::Win;
use super::{ceil_div, MatmulShape, View, WeightLayout, WgpuBackend};

/// C tile of one matmul workgroup (`TM` x `TN` of matmul.wgsl).
const MATMUL_TILE_M: usize = 128;
const MATMUL_TILE_N: usize = 128;
/// C tile of one workgroup of the vec4 matmul (matmul4.wgsl).
const MATMUL4_TILE_M: usize = 128;
const MATMUL4_TILE_N: usize = 128;
/// C tile of one workgroup of the tiled matmul (`BM` x `BN` of matmul_tiled.wgsl), and its k step (`BK`).
const TILED_M: usize = 128;
const TILED_N: usize = 128;
const TILED_K: usize = 8;

/// Workgroups a tiled matmul should offer the device: past this it is not split along k.
const SPLIT_K_TARGET_GROUPS: usize = 512;
/// The fewest k terms one split-K slice sums.
const SPLIT_K_MIN_TERMS: usize = 512;
/// The most slices.
const SPLIT_K_MAX_SPLITS: usize = 16;
/// The most elements the partial products may take (32 MiB).
pub(super) const SPLIT_K_PARTIALS_MAX: usize = 8 << 20;

/// Split-K plan of an `m x n x k` matmul: (k terms per slice, slices), or `None` for one pass. A function of
/// the shape alone, so the same matmul always sums in the same order.
/// `room` bounds the partial products' elements (the adapter's binding limit, at most
/// [`SPLIT_K_PARTIALS_MAX`]).
pub(super) fn split_k_plan(m: usize, n: usize, k: usize, room: usize) -> Option<(usize, usize)> {
    let groups = ceil_div(m, TILED_M) * ceil_div(n, TILED_N);
    let wanted = ceil_div(SPLIT_K_TARGET_GROUPS, groups)
        .min(k / SPLIT_K_MIN_TERMS)
        .min(SPLIT_K_MAX_SPLITS)
        .min(room / (m * n).max(1));
    if wanted < 2 {
        return None;
    }
    let k_split = ceil_div(ceil_div(k, wanted), TILED_K) * TILED_K;
    Some((k_split, ceil_div(k, k_split)))
}

/// One strided matrix operand: element `(r, c)` is at `off + r * rs + c * cs` of buffer `buf`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mat {
    pub(super) buf: usize,
    pub(super) off: usize,
    pub(super) rs: usize,
    pub(super) cs: usize,
}

impl Mat {
    /// The `rows x cols` matrix at `v`, rows `rs` and columns `cs` apart.
    fn of(v: View, rs: usize, cs: usize) -> Mat {
        Mat {
            buf: v.buf,
            off: v.offset,
            rs,
            cs,
        }
    }

    /// `[first, end)` element range touched by a `rows x cols` block.
    fn extent(&self, rows: usize, cols: usize) -> (usize, usize) {
        if rows == 0 || cols == 0 {
            return (self.off, self.off);
        }
        (self.off, self.off + (rows - 1) * self.rs + (cols - 1) * self.cs + 1)
    }

    fn at(&self, r: usize, c: usize) -> Mat {
        Mat {
            off: self.off + r * self.rs + c * self.cs,
            ..*self
        }
    }
}

/// For the vec4 kernels: how far apart `m`'s rows lie (row-major, `cs == 1`) or, with `transposed`, its
/// transpose's rows (`rs == 1`), when that is a multiple of 4 elements.
pub(super) fn vec4_rows(m: &Mat, transposed: bool) -> Option<usize> {
    let (unit, rows) = if transposed { (m.rs, m.cs) } else { (m.cs, m.rs) };
    (unit == 1 && rows % 4 == 0).then_some(rows)
}

/// `C[m, n] (=|+=) A[m, k] @ B[k, n] (+ bias[n])`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Gemm {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) a: Mat,
    pub(super) b: Mat,
    pub(super) c: Mat,
    pub(super) bias: Option<View>,
    pub(super) accumulate: bool,
}

impl Gemm {
    /// The elements any of A, B and C spans: what a window must hold.
    fn span(&self) -> usize {
        let e = |(a, b): (usize, usize)| b - a;
        e(self.a.extent(self.m, self.k))
            .max(e(self.b.extent(self.k, self.n)))
            .max(e(self.c.extent(self.m, self.n)))
    }

    fn split_m(&self) -> (Gemm, Gemm) {
        let h = self.m / 2;
        let lo = Gemm { m: h, ..*self };
        let hi = Gemm {
            m: self.m - h,
            a: self.a.at(h, 0),
            c: self.c.at(h, 0),
            ..*self
        };
        (lo, hi)
    }

    fn split_n(&self) -> (Gemm, Gemm) {
        let h = self.n / 2;
        let lo = Gemm {
            n: h,
            bias: self.bias.map(|b| b.sub(0, h)),
            ..*self
        };
        let hi = Gemm {
            n: self.n - h,
            b: self.b.at(0, h),
            c: self.c.at(0, h),
            bias: self.bias.map(|b| b.sub(h, self.n - h)),
            ..*self
        };
        (lo, hi)
    }

    /// The second half accumulates onto the first and adds no bias.
    fn split_k(&self) -> (Gemm, Gemm) {
        let h = self.k / 2;
        let lo = Gemm { k: h, ..*self };
        let hi = Gemm {
            k: self.k - h,
            a: self.a.at(0, h),
            b: self.b.at(h, 0),
            bias: None,
            accumulate: true,
            ..*self
        };
        (lo, hi)
    }
}

impl WgpuBackend {
    /// `out [n, oc] = inp [n, c] @ W (+ bias [oc])`.
    pub(super) fn matmul_forward_gemm(
        &mut self,
        out: View,
        inp: View,
        weight: View,
        bias: Option<View>,
        s: MatmulShape,
    ) {
        // W as a c x oc matrix.
        let w = match s.layout {
            WeightLayout::InOut => Mat::of(weight, s.oc, 1),
            WeightLayout::OutIn => Mat::of(weight, 1, s.c),
        };
        self.gemm(Gemm {
            m: s.n,
            n: s.oc,
            k: s.c,
            a: Mat::of(inp, s.c, 1),
            b: w,
            c: Mat::of(out, s.oc, 1),
            bias,
            accumulate: false,
        });
    }

    /// `dinp = dout @ W^T`; `dW += inp^T @ dout` (in W's layout).
    pub(super) fn matmul_backward_gemms(
        &mut self,
        dinp: View,
        dweight: View,
        dout: View,
        inp: View,
        weight: View,
        s: MatmulShape,
    ) {
        // dinp [n, c] = dout [n, oc] @ W^T, W^T as an oc x c matrix.
        let wt = match s.layout {
            WeightLayout::InOut => Mat::of(weight, 1, s.oc),
            WeightLayout::OutIn => Mat::of(weight, s.c, 1),
        };
        self.gemm(Gemm {
            m: s.n,
            n: s.c,
            k: s.oc,
            a: Mat::of(dout, s.oc, 1),
            b: wt,
            c: Mat::of(dinp, s.c, 1),
            bias: None,
            accumulate: false,
        });
        match s.layout {
            // dW [c, oc] += inp^T @ dout
            WeightLayout::InOut => self.gemm(Gemm {
                m: s.c,
                n: s.oc,
                k: s.n,
                a: Mat::of(inp, 1, s.c),
                b: Mat::of(dout, s.oc, 1),
                c: Mat::of(dweight, s.oc, 1),
                bias: None,
                accumulate: true,
            }),
            // dW [oc, c] += dout^T @ inp
            WeightLayout::OutIn => self.gemm(Gemm {
                m: s.oc,
                n: s.c,
                k: s.n,
                a: Mat::of(dout, 1, s.oc),
                b: Mat::of(inp, s.c, 1),
                c: Mat::of(dweight, s.c, 1),
                bias: None,
                accumulate: true,
            }),
        }
    }

    /// `dbias [oc] += column sums of dout [n, oc]`: one invocation per column, split by rows of `dout` when
    /// it exceeds a window.
    pub(super) fn matmul_bias_gradient(&mut self, dbias: View, dout: View, n: usize, oc: usize) {
        for (r0, r1) in self.row_windows(n, oc) {
            let (wdb, wd) = (self.win(dbias), self.win(dout.sub(r0 * oc, (r1 - r0) * oc)));
            // C is dbias (one row), A is the rows of dout; the kernel reads m, n, the offsets and strides.
            let p = MatmulParams {
                m: word(r1 - r0),
                n: word(oc),
                c_off: wdb.off,
                c_rs: word(oc),
                a_off: wd.off,
                a_rs: word(oc),
                ..Default::default()
            };
            let groups = self.grid(ceil_div(oc, 16));
            if !self.require_loop_budget("matmul bias gradient", column_sum_iterations(r1 - r0)) {
                return;
            }
            self.dispatch("matmul_backward_bias", &[wdb, wd], &p, groups);
        }
    }

    /// Records `g`: in one dispatch when its windows and grid fit, else as two halves.
    fn gemm(&mut self, g: Gemm) {
        if g.m == 0 || g.n == 0 {
            return;
        }
        let (a0, a1) = g.a.extent(g.m, g.k);
        let (b0, b1) = g.b.extent(g.k, g.n);
        let (c0, c1) = g.c.extent(g.m, g.n);
        let bias_fits = g.bias.is_none_or(|b| self.fits(b.offset, b.end()));
        let max_groups = self.max_groups as usize;
        let (rows_ok, cols_ok) = (
            ceil_div(g.m, MATMUL_TILE_M) <= max_groups,
            ceil_div(g.n, MATMUL_TILE_N) <= max_groups,
        );
        if self.fits(a0, a1) && self.fits(b0, b1) && self.fits(c0, c1) && bias_fits && rows_ok && cols_ok {
            let (wa, wb, wc) = (
                self.win_range(g.a.buf, a0, a1.max(a0)),
                self.win_range(g.b.buf, b0, b1.max(b0)),
                self.win_range(g.c.buf, c0, c1),
            );
            let wbias = match g.bias {
                Some(b) => self.win(b),
                None => self.dummy_win(),
            };
            self.dispatch_gemm(&g, [wc, wa, wb, wbias]);
            return;
        }
        // Too large for one window (or one dispatch): past the dispatch limit halve M or N, else halve the
        // dimension that shrinks the largest window most.
        if !rows_ok || !cols_ok {
            let (lo, hi) = if !rows_ok { g.split_m() } else { g.split_n() };
            self.gemm(lo);
            self.gemm(hi);
            return;
        }
        let mut best: Option<(usize, (Gemm, Gemm))> = None;
        for (ok, halves) in [(g.m > 1, g.split_m()), (g.n > 1, g.split_n()), (g.k > 1, g.split_k())] {
            if ok {
                let s = halves.0.span().max(halves.1.span());
                if best.as_ref().is_none_or(|(b, _)| s < *b) {
                    best = Some((s, halves));
                }
            }
        }
        let (_, (lo, hi)) = best.expect("a 1x1x1 matmul always fits a window");
        self.gemm(lo);
        self.gemm(hi);
    }

    /// One tiled matmul of `g` over its windows `[C, A, B, bias]` (what hardware adapters run), split along
    /// k ([`split_k_plan`]) when its tiles alone would leave the device idle.
    fn dispatch_tiled(&mut self, g: &Gemm, wins: [Win; 4]) {
        let [wc, wa, wb, wbias] = &wins;
        let flags = g.accumulate as u32
            | (g.bias.is_some() as u32) << 1
            | ((g.a.cs == 1) as u32) << 2
            | ((g.b.cs == 1) as u32) << 3;
        let mut p = TiledMatmulParams::unsplit(strided_params(g, &wins), flags);
        if !self.require_loop_budget("matmul", tiled_iterations(g.k)) {
            return;
        }
        let (tile_cols, tile_rows) = (ceil_div(g.n, TILED_N), ceil_div(g.m, TILED_M));
        let room = SPLIT_K_PARTIALS_MAX.min(self.max_window_elems());
        let plan = split_k_plan(g.m, g.n, g.k, room).filter(|&(_, s)| tile_rows * s <= self.max_groups as usize);
        let Some((k_split, splits)) = plan else {
            self.dispatch("matmul_tiled", &wins, &p, (tile_cols as u32, tile_rows as u32));
            return;
        };
        let len = splits * g.m * g.n;
        let partials = match self.split_k_partials(len) {
            Ok(partials) => partials,
            Err(e) => {
                self.errors.record(e);
                return;
            }
        };
        let wp = self.win_of(&partials.buffer, Some(partials.id), len, 0, len);
        (p.k_split, p.splits) = (word(k_split), word(splits));
        let partial_p = TiledMatmulParams { c_off: wp.off, ..p };
        let groups = (tile_cols as u32, (tile_rows * splits) as u32);
        self.dispatch(
            "matmul_tiled_partial",
            &[wp.clone(), wa.clone(), wb.clone(), wbias.clone()],
            &partial_p,
            groups,
        );
        let reduce_p = TiledMatmulParams { a_off: wp.off, ..p };
        let dummy = self.dummy_win();
        let groups = self.grid(ceil_div(g.m * g.n, WG as usize));
        self.dispatch(
            "matmul_tiled_reduce",
            &[wc.clone(), wp, dummy, wbias.clone()],
            &reduce_p,
            groups,
        );
    }

    /// One dispatch of `g` over its windows `[C, A, B, bias]`.
    fn dispatch_gemm(&mut self, g: &Gemm, wins: [Win; 4]) {
        if self.hardware_kernels_only() {
            self.dispatch_tiled(g, wins);
            return;
        }
        let [wc, wa, wb, wbias] = &wins;
        let flags = g.accumulate as u32 | (g.bias.is_some() as u32) << 1;
        // Windows starting 16-byte aligned, with n and k multiples of 4, and each operand row-major or
        // (texture-fed kernels only) its row-major transpose, with rows a multiple of 4 apart: the vec4
        // kernels. Their parameters: A's and B's (texture) rows apart, in vec4s.
        let aligned = |w: &Win| w.off % 4 == 0 && w.start % 16 == 0;
        let vec4_params = |a_rows: usize, b_rows: usize| MatmulParams {
            m: word(g.m),
            n: word(g.n),
            k: word(g.k),
            c_off: wc.off,
            c_rs: word(g.c.rs),
            a_off: wa.off / 4,
            a_rs: word(a_rows / 4),
            a_cs: 1,
            b_off: wb.off / 4,
            b_rs: word(b_rows / 4),
            b_cs: 1,
            bias_off: wbias.off,
            flags,
        };
        if g.n % 4 == 0 && g.k % 4 == 0 && g.k > 0 && aligned(wa) && aligned(wb) {
            let iterations = matmul_iterations(g.k, true);
            if let (Some(a_rows), Some(b_rows)) = (vec4_rows(&g.a, false), vec4_rows(&g.b, false)) {
                let p = vec4_params(a_rows, b_rows);
                if !self.require_loop_budget("matmul", iterations) {
                    return;
                }
                if self.try_plain_tex_matmul(g, [wc, wa, wb, wbias], &p) {
                    return;
                }
                let groups = (
                    ceil_div(g.n, MATMUL4_TILE_N) as u32,
                    ceil_div(g.m, MATMUL4_TILE_M) as u32,
                );
                self.dispatch("matmul4", &wins, &p, groups);
                return;
            }
            if self.try_transposed_tex_matmul(g, [wc, wa, wb, wbias], iterations, vec4_params) {
                return;
            }
        }
        let p = strided_params(g, &wins);
        let groups = (ceil_div(g.n, MATMUL_TILE_N) as u32, ceil_div(g.m, MATMUL_TILE_M) as u32);
        if self.require_loop_budget("matmul", matmul_iterations(g.k, false)) {
            self.dispatch("matmul", &wins, &p, groups);
        }
    }
}

/// The strided kernels' parameters of `g` over its windows `[C, A, B, bias]`, offsets and strides in floats.
fn strided_params(g: &Gemm, wins: &[Win; 4]) -> MatmulParams {
    let [wc, wa, wb, wbias] = wins;
    MatmulParams {
        m: word(g.m),
        n: word(g.n),
        k: word(g.k),
        c_off: wc.off,
        c_rs: word(g.c.rs),
        a_off: wa.off,
        a_rs: word(g.a.rs),
        a_cs: word(g.a.cs),
        b_off: wb.off,
        b_rs: word(g.b.rs),
        b_cs: word(g.b.cs),
        bias_off: wbias.off,
        flags: g.accumulate as u32 | (g.bias.is_some() as u32) << 1,
    }
}
