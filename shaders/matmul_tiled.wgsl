// C[m, n] (= or +=) A[m, k] @ B[k, n] (+ bias[n]) with arbitrary element strides for A and B: the matmul
// every hardware adapter runs, for every case (NN, NT, TN: the transposes are strides, read along whichever
// of an operand's strides is 1 so that neighbouring invocations load neighbouring words).
// Tiling: a workgroup of 16 x 16 invocations owns a 128 x 128 tile of C; each step stages a 128 x 8 slice of
// A and an 8 x 128 slice of B in workgroup memory (zeros past the edges), and every invocation adds the
// products into an 8 x 8 register block (rows ty + 16 i, columns tx + 16 j): 16 workgroup loads per 64
// multiply-adds. Every output sums its k terms in increasing order, so results repeat bit for bit.
// Split-K (`matmul_tiled_partial` then `matmul_tiled_reduce`): workgroup z sums the k range
// [z * k_split, (z + 1) * k_split) into its own [m, n] slice of the partials buffer, and the reduce adds the
// slices in increasing z, then the bias and C as the flags say: a fixed order, the same bits every run.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    c_off: u32,
    c_rs: u32,
    a_off: u32,
    a_rs: u32,
    a_cs: u32,
    b_off: u32,
    b_rs: u32,
    b_cs: u32,
    bias_off: u32,
    // bit 0: accumulate into C; bit 1: add bias; bit 2: A's k stride is 1 (stage along k); bit 3: B's n
    // stride is 1 (stage along n)
    flags: u32,
    k_split: u32,   // k terms per partial (split-K), else k
    splits: u32,    // partial slices (split-K), else 1
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> C: array<f32>;      // C, or the partials [splits, m, n]
@group(0) @binding(2) var<storage, read_write> A: array<f32>;
@group(0) @binding(3) var<storage, read_write> B: array<f32>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;

// Must match the backend's TILED_M / TILED_N.
const BM: u32 = 128u;
const BN: u32 = 128u;
const BK: u32 = 8u;

var<workgroup> a_tile: array<f32, 1024>;  // [BK, BM]
var<workgroup> b_tile: array<f32, 1024>;  // [BK, BN]

// The 8 x 8 block of (m0, n0)'s tile that invocation li owns, summed over k in [k0, k1).
fn block_sum(m0: u32, n0: u32, k0: u32, k1: u32, li: u32) -> array<f32, 64> {
    let tx = li % 16u;
    let ty = li / 16u;
    let a_along_k = (P.flags & 4u) != 0u;
    let b_along_n = (P.flags & 8u) != 0u;
    var acc: array<f32, 64>;
    for (var ks = k0; ks < k1; ks += BK) {
        workgroupBarrier();
        for (var j = 0u; j < 4u; j++) {
            let e = li + j * 256u;
            // A's element (r, kk): consecutive invocations take consecutive k (row-major A) or rows.
            let ra = select(e % BM, e / BK, a_along_k);
            let ka = select(e / BM, e % BK, a_along_k);
            var a = 0.0;
            if (m0 + ra < P.m && ks + ka < k1) {
                a = A[P.a_off + (m0 + ra) * P.a_rs + (ks + ka) * P.a_cs];
            }
            a_tile[ka * BM + ra] = a;
            // B's element (kk, c): consecutive invocations take consecutive columns (row-major B) or k.
            let cb = select(e / BK, e % BN, b_along_n);
            let kb = select(e % BK, e / BN, b_along_n);
            var b = 0.0;
            if (n0 + cb < P.n && ks + kb < k1) {
                b = B[P.b_off + (ks + kb) * P.b_rs + (n0 + cb) * P.b_cs];
            }
            b_tile[kb * BN + cb] = b;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            var af: array<f32, 8>;
            var bf: array<f32, 8>;
            for (var i = 0u; i < 8u; i++) { af[i] = a_tile[kk * BM + ty + 16u * i]; }
            for (var j = 0u; j < 8u; j++) { bf[j] = b_tile[kk * BN + tx + 16u * j]; }
            for (var i = 0u; i < 8u; i++) {
                for (var j = 0u; j < 8u; j++) { acc[i * 8u + j] += af[i] * bf[j]; }
            }
        }
    }
    return acc;
}

// The flags' epilogue for one output: + bias, then C + the sum.
fn finish(gm: u32, gn: u32, sum: f32) {
    var v = sum;
    if ((P.flags & 2u) != 0u) { v = v + bias[P.bias_off + gn]; }
    let o = P.c_off + gm * P.c_rs + gn;
    if ((P.flags & 1u) != 0u) { v = C[o] + v; }
    C[o] = v;
}

@compute @workgroup_size(256)
fn matmul_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let m0 = wg.y * BM;
    let n0 = wg.x * BN;
    let acc = block_sum(m0, n0, 0u, P.k, li);
    for (var i = 0u; i < 8u; i++) {
        let gm = m0 + li / 16u + 16u * i;
        for (var j = 0u; j < 8u; j++) {
            let gn = n0 + li % 16u + 16u * j;
            if (gm < P.m && gn < P.n) { finish(gm, gn, acc[i * 8u + j]); }
        }
    }
}

// Split-K: the grid's rows are (slice z, tile row) pairs, z major; slice z of the partials [splits, m, n]
// (C's binding, from c_off) gets the k range [z * k_split, min(k, (z + 1) * k_split)).
@compute @workgroup_size(256)
fn matmul_tiled_partial(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tile_rows = (P.m + BM - 1u) / BM;
    let z = wg.y / tile_rows;
    let m0 = (wg.y % tile_rows) * BM;
    let n0 = wg.x * BN;
    let k0 = z * P.k_split;
    let acc = block_sum(m0, n0, k0, min(P.k, k0 + P.k_split), li);
    let slice = P.c_off + z * P.m * P.n;
    for (var i = 0u; i < 8u; i++) {
        let gm = m0 + li / 16u + 16u * i;
        for (var j = 0u; j < 8u; j++) {
            let gn = n0 + li % 16u + 16u * j;
            if (gm < P.m && gn < P.n) { C[slice + gm * P.n + gn] = acc[i * 8u + j]; }
        }
    }
}

// Split-K's second pass, one output per invocation: the partials (A's binding, from a_off) added in
// increasing slice, then `finish` into C.
@compute @workgroup_size(256)
fn matmul_tiled_reduce(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) li: u32) {
    let g = (wg.y * nwg.x + wg.x) * 256u + li;
    if (g >= P.m * P.n) { return; }
    var s = 0.0;
    for (var z = 0u; z < P.splits; z++) { s += A[P.a_off + z * P.m * P.n + g]; }
    finish(g / P.n, g % P.n, s);
}
