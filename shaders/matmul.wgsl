// C[m, n] (= or +=) A[m, k] @ B[k, n] (+ bias[n]) with arbitrary element strides for A and B, so one kernel
// serves both weight layouts and every transpose of the backward pass.
// Tiling: a 64x64 tile of C per workgroup of 16x16 invocations, each computing a 4x4 register block
// (rows ty + 16 r, columns tx + 16 q, kept as four vec4 accumulators); K is walked in slices of 16 staged
// in workgroup memory. Every output sums its k terms in increasing order, so results are run-to-run
// deterministic.

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
    flags: u32,     // bit 0: accumulate into C; bit 1: add bias
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> C: array<f32>;
@group(0) @binding(2) var<storage, read_write> A: array<f32>;
@group(0) @binding(3) var<storage, read_write> B: array<f32>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;

var<workgroup> As: array<f32, 1024>; // [TK][TM]
var<workgroup> Bs: array<f32, 1024>; // [TK][TN]

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tile_m = wg.y * TM;
    let tile_n = wg.x * TN;
    let tx = li % 16u;
    let ty = li / 16u;
    // acc_r holds row ty + 16 r, columns tx + 16 q in component q.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < P.k; k0 += TK) {
        for (var e = 0u; e < 4u; e++) {
            let idx = li + e * WG;
            // A tile: 64 rows x 16 k, k fastest.
            let am = idx / TK;
            let ak = idx % TK;
            let gm = tile_m + am;
            let gk = k0 + ak;
            var av = 0.0;
            if (gm < P.m && gk < P.k) { av = A[P.a_off + gm * P.a_rs + gk * P.a_cs]; }
            As[ak * TM + am] = av;
            // B tile: 16 k x 64 columns, columns fastest.
            let bk = idx / TN;
            let bn = idx % TN;
            let gk2 = k0 + bk;
            let gn = tile_n + bn;
            var bv = 0.0;
            if (gk2 < P.k && gn < P.n) { bv = B[P.b_off + gk2 * P.b_rs + gn * P.b_cs]; }
            Bs[bk * TN + bn] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let ab = kk * TM + ty;
            let bb = kk * TN + tx;
            let b = vec4<f32>(Bs[bb], Bs[bb + 16u], Bs[bb + 32u], Bs[bb + 48u]);
            acc0 = acc0 + As[ab] * b;
            acc1 = acc1 + As[ab + 16u] * b;
            acc2 = acc2 + As[ab + 32u] * b;
            acc3 = acc3 + As[ab + 48u] * b;
        }
        workgroupBarrier();
    }
    store_row(tile_m + ty, tile_n + tx, acc0);
    store_row(tile_m + ty + 16u, tile_n + tx, acc1);
    store_row(tile_m + ty + 32u, tile_n + tx, acc2);
    store_row(tile_m + ty + 48u, tile_n + tx, acc3);
}

// Writes row gm, columns gn + 16 q (q = 0..3) of C from acc[q], adding bias and/or C as the flags say.
fn store_row(gm: u32, gn0: u32, acc: vec4<f32>) {
    if (gm >= P.m) { return; }
    for (var q = 0u; q < 4u; q++) {
        let gn = gn0 + 16u * q;
        if (gn >= P.n) { continue; }
        var v = acc[q];
        if ((P.flags & 2u) != 0u) { v = v + bias[P.bias_off + gn]; }
        let o = P.c_off + gm * P.c_rs + gn;
        if ((P.flags & 1u) != 0u) { v = C[o] + v; }
        C[o] = v;
    }
}

// dbias[j] += sum over rows of dout[row, j]; C is dbias, A is dout [m, n] with row stride a_rs. A workgroup
// owns 16 columns and splits the rows among 16 lanes (lane l sums rows l, l + 16, ... in order), then adds
// the lanes by a fixed tree.
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn matmul_backward_bias(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) li: u32) {
    let j = group_index(wg, nwg) * 16u + li % 16u;
    let lane = li / 16u;
    var s = 0.0;
    if (j < P.n) {
        for (var row = lane; row < P.m; row += 16u) { s += A[P.a_off + row * P.a_rs + j]; }
    }
    red[li] = s;
    workgroupBarrier();
    for (var st = 8u; st > 0u; st = st >> 1u) {
        if (lane < st) { red[li] = red[li] + red[li + st * 16u]; }
        workgroupBarrier();
    }
    if (lane == 0u && j < P.n) { C[P.c_off + j] = C[P.c_off + j] + red[li]; }
}
