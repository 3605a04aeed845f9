// C[m, n] (= or +=) A[m, k] @ B[k, n] (+ bias[n]) with arbitrary element strides for A and B, so one kernel
// serves both weight layouts and every transpose of the backward pass.
// Tiling, shaped for CPU implementations of WebGPU (lavapipe/llvmpipe), where each storage load costs a
// per-invocation scalar access whatever the layout: a workgroup of 8x8 invocations computes a 128x128 tile
// of C, each invocation a 16x16 register block (rows ty + 8 i, columns tx + 8 j), reading A and B straight
// from the storage buffers (no workgroup memory, no barriers): 32 loads per 256 multiply-adds. Rows and
// columns past the edge are clamped on load and skipped on store. Every output sums its k terms in
// increasing order, so results are run-to-run deterministic.

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

// Must match MATMUL_TILE_M / MATMUL_TILE_N of the backend.
const TM: u32 = 128u;
const TN: u32 = 128u;

@compute @workgroup_size(64)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tx = li % 8u;
    let ty = li / 8u;
    let r0 = wg.y * TM + ty;
    let c0 = wg.x * TN + tx;
    let mlast = P.m - 1u;
    let nlast = P.n - 1u;
    let a0 = P.a_off + min(r0 + 0u, mlast) * P.a_rs;
    let a1 = P.a_off + min(r0 + 8u, mlast) * P.a_rs;
    let a2 = P.a_off + min(r0 + 16u, mlast) * P.a_rs;
    let a3 = P.a_off + min(r0 + 24u, mlast) * P.a_rs;
    let a4 = P.a_off + min(r0 + 32u, mlast) * P.a_rs;
    let a5 = P.a_off + min(r0 + 40u, mlast) * P.a_rs;
    let a6 = P.a_off + min(r0 + 48u, mlast) * P.a_rs;
    let a7 = P.a_off + min(r0 + 56u, mlast) * P.a_rs;
    let a8 = P.a_off + min(r0 + 64u, mlast) * P.a_rs;
    let a9 = P.a_off + min(r0 + 72u, mlast) * P.a_rs;
    let a10 = P.a_off + min(r0 + 80u, mlast) * P.a_rs;
    let a11 = P.a_off + min(r0 + 88u, mlast) * P.a_rs;
    let a12 = P.a_off + min(r0 + 96u, mlast) * P.a_rs;
    let a13 = P.a_off + min(r0 + 104u, mlast) * P.a_rs;
    let a14 = P.a_off + min(r0 + 112u, mlast) * P.a_rs;
    let a15 = P.a_off + min(r0 + 120u, mlast) * P.a_rs;
    let b0 = P.b_off + min(c0 + 0u, nlast) * P.b_cs;
    let b1 = P.b_off + min(c0 + 8u, nlast) * P.b_cs;
    let b2 = P.b_off + min(c0 + 16u, nlast) * P.b_cs;
    let b3 = P.b_off + min(c0 + 24u, nlast) * P.b_cs;
    let b4 = P.b_off + min(c0 + 32u, nlast) * P.b_cs;
    let b5 = P.b_off + min(c0 + 40u, nlast) * P.b_cs;
    let b6 = P.b_off + min(c0 + 48u, nlast) * P.b_cs;
    let b7 = P.b_off + min(c0 + 56u, nlast) * P.b_cs;
    let b8 = P.b_off + min(c0 + 64u, nlast) * P.b_cs;
    let b9 = P.b_off + min(c0 + 72u, nlast) * P.b_cs;
    let b10 = P.b_off + min(c0 + 80u, nlast) * P.b_cs;
    let b11 = P.b_off + min(c0 + 88u, nlast) * P.b_cs;
    let b12 = P.b_off + min(c0 + 96u, nlast) * P.b_cs;
    let b13 = P.b_off + min(c0 + 104u, nlast) * P.b_cs;
    let b14 = P.b_off + min(c0 + 112u, nlast) * P.b_cs;
    let b15 = P.b_off + min(c0 + 120u, nlast) * P.b_cs;
    var acc0_0 = vec4<f32>(0.0);
    var acc0_1 = vec4<f32>(0.0);
    var acc0_2 = vec4<f32>(0.0);
    var acc0_3 = vec4<f32>(0.0);
    var acc1_0 = vec4<f32>(0.0);
    var acc1_1 = vec4<f32>(0.0);
    var acc1_2 = vec4<f32>(0.0);
    var acc1_3 = vec4<f32>(0.0);
    var acc2_0 = vec4<f32>(0.0);
    var acc2_1 = vec4<f32>(0.0);
    var acc2_2 = vec4<f32>(0.0);
    var acc2_3 = vec4<f32>(0.0);
    var acc3_0 = vec4<f32>(0.0);
    var acc3_1 = vec4<f32>(0.0);
    var acc3_2 = vec4<f32>(0.0);
    var acc3_3 = vec4<f32>(0.0);
    var acc4_0 = vec4<f32>(0.0);
    var acc4_1 = vec4<f32>(0.0);
    var acc4_2 = vec4<f32>(0.0);
    var acc4_3 = vec4<f32>(0.0);
    var acc5_0 = vec4<f32>(0.0);
    var acc5_1 = vec4<f32>(0.0);
    var acc5_2 = vec4<f32>(0.0);
    var acc5_3 = vec4<f32>(0.0);
    var acc6_0 = vec4<f32>(0.0);
    var acc6_1 = vec4<f32>(0.0);
    var acc6_2 = vec4<f32>(0.0);
    var acc6_3 = vec4<f32>(0.0);
    var acc7_0 = vec4<f32>(0.0);
    var acc7_1 = vec4<f32>(0.0);
    var acc7_2 = vec4<f32>(0.0);
    var acc7_3 = vec4<f32>(0.0);
    var acc8_0 = vec4<f32>(0.0);
    var acc8_1 = vec4<f32>(0.0);
    var acc8_2 = vec4<f32>(0.0);
    var acc8_3 = vec4<f32>(0.0);
    var acc9_0 = vec4<f32>(0.0);
    var acc9_1 = vec4<f32>(0.0);
    var acc9_2 = vec4<f32>(0.0);
    var acc9_3 = vec4<f32>(0.0);
    var acc10_0 = vec4<f32>(0.0);
    var acc10_1 = vec4<f32>(0.0);
    var acc10_2 = vec4<f32>(0.0);
    var acc10_3 = vec4<f32>(0.0);
    var acc11_0 = vec4<f32>(0.0);
    var acc11_1 = vec4<f32>(0.0);
    var acc11_2 = vec4<f32>(0.0);
    var acc11_3 = vec4<f32>(0.0);
    var acc12_0 = vec4<f32>(0.0);
    var acc12_1 = vec4<f32>(0.0);
    var acc12_2 = vec4<f32>(0.0);
    var acc12_3 = vec4<f32>(0.0);
    var acc13_0 = vec4<f32>(0.0);
    var acc13_1 = vec4<f32>(0.0);
    var acc13_2 = vec4<f32>(0.0);
    var acc13_3 = vec4<f32>(0.0);
    var acc14_0 = vec4<f32>(0.0);
    var acc14_1 = vec4<f32>(0.0);
    var acc14_2 = vec4<f32>(0.0);
    var acc14_3 = vec4<f32>(0.0);
    var acc15_0 = vec4<f32>(0.0);
    var acc15_1 = vec4<f32>(0.0);
    var acc15_2 = vec4<f32>(0.0);
    var acc15_3 = vec4<f32>(0.0);
    for (var k = 0u; k < P.k; k++) {
        let ak = k * P.a_cs;
        let bk = k * P.b_rs;
        let bv0 = vec4<f32>(B[b0 + bk], B[b1 + bk], B[b2 + bk], B[b3 + bk]);
        let bv1 = vec4<f32>(B[b4 + bk], B[b5 + bk], B[b6 + bk], B[b7 + bk]);
        let bv2 = vec4<f32>(B[b8 + bk], B[b9 + bk], B[b10 + bk], B[b11 + bk]);
        let bv3 = vec4<f32>(B[b12 + bk], B[b13 + bk], B[b14 + bk], B[b15 + bk]);
        let av0 = A[a0 + ak];
        acc0_0 = acc0_0 + av0 * bv0;
        acc0_1 = acc0_1 + av0 * bv1;
        acc0_2 = acc0_2 + av0 * bv2;
        acc0_3 = acc0_3 + av0 * bv3;
        let av1 = A[a1 + ak];
        acc1_0 = acc1_0 + av1 * bv0;
        acc1_1 = acc1_1 + av1 * bv1;
        acc1_2 = acc1_2 + av1 * bv2;
        acc1_3 = acc1_3 + av1 * bv3;
        let av2 = A[a2 + ak];
        acc2_0 = acc2_0 + av2 * bv0;
        acc2_1 = acc2_1 + av2 * bv1;
        acc2_2 = acc2_2 + av2 * bv2;
        acc2_3 = acc2_3 + av2 * bv3;
        let av3 = A[a3 + ak];
        acc3_0 = acc3_0 + av3 * bv0;
        acc3_1 = acc3_1 + av3 * bv1;
        acc3_2 = acc3_2 + av3 * bv2;
        acc3_3 = acc3_3 + av3 * bv3;
        let av4 = A[a4 + ak];
        acc4_0 = acc4_0 + av4 * bv0;
        acc4_1 = acc4_1 + av4 * bv1;
        acc4_2 = acc4_2 + av4 * bv2;
        acc4_3 = acc4_3 + av4 * bv3;
        let av5 = A[a5 + ak];
        acc5_0 = acc5_0 + av5 * bv0;
        acc5_1 = acc5_1 + av5 * bv1;
        acc5_2 = acc5_2 + av5 * bv2;
        acc5_3 = acc5_3 + av5 * bv3;
        let av6 = A[a6 + ak];
        acc6_0 = acc6_0 + av6 * bv0;
        acc6_1 = acc6_1 + av6 * bv1;
        acc6_2 = acc6_2 + av6 * bv2;
        acc6_3 = acc6_3 + av6 * bv3;
        let av7 = A[a7 + ak];
        acc7_0 = acc7_0 + av7 * bv0;
        acc7_1 = acc7_1 + av7 * bv1;
        acc7_2 = acc7_2 + av7 * bv2;
        acc7_3 = acc7_3 + av7 * bv3;
        let av8 = A[a8 + ak];
        acc8_0 = acc8_0 + av8 * bv0;
        acc8_1 = acc8_1 + av8 * bv1;
        acc8_2 = acc8_2 + av8 * bv2;
        acc8_3 = acc8_3 + av8 * bv3;
        let av9 = A[a9 + ak];
        acc9_0 = acc9_0 + av9 * bv0;
        acc9_1 = acc9_1 + av9 * bv1;
        acc9_2 = acc9_2 + av9 * bv2;
        acc9_3 = acc9_3 + av9 * bv3;
        let av10 = A[a10 + ak];
        acc10_0 = acc10_0 + av10 * bv0;
        acc10_1 = acc10_1 + av10 * bv1;
        acc10_2 = acc10_2 + av10 * bv2;
        acc10_3 = acc10_3 + av10 * bv3;
        let av11 = A[a11 + ak];
        acc11_0 = acc11_0 + av11 * bv0;
        acc11_1 = acc11_1 + av11 * bv1;
        acc11_2 = acc11_2 + av11 * bv2;
        acc11_3 = acc11_3 + av11 * bv3;
        let av12 = A[a12 + ak];
        acc12_0 = acc12_0 + av12 * bv0;
        acc12_1 = acc12_1 + av12 * bv1;
        acc12_2 = acc12_2 + av12 * bv2;
        acc12_3 = acc12_3 + av12 * bv3;
        let av13 = A[a13 + ak];
        acc13_0 = acc13_0 + av13 * bv0;
        acc13_1 = acc13_1 + av13 * bv1;
        acc13_2 = acc13_2 + av13 * bv2;
        acc13_3 = acc13_3 + av13 * bv3;
        let av14 = A[a14 + ak];
        acc14_0 = acc14_0 + av14 * bv0;
        acc14_1 = acc14_1 + av14 * bv1;
        acc14_2 = acc14_2 + av14 * bv2;
        acc14_3 = acc14_3 + av14 * bv3;
        let av15 = A[a15 + ak];
        acc15_0 = acc15_0 + av15 * bv0;
        acc15_1 = acc15_1 + av15 * bv1;
        acc15_2 = acc15_2 + av15 * bv2;
        acc15_3 = acc15_3 + av15 * bv3;
    }
    store4(r0 + 0u, c0 + 0u, acc0_0);
    store4(r0 + 0u, c0 + 32u, acc0_1);
    store4(r0 + 0u, c0 + 64u, acc0_2);
    store4(r0 + 0u, c0 + 96u, acc0_3);
    store4(r0 + 8u, c0 + 0u, acc1_0);
    store4(r0 + 8u, c0 + 32u, acc1_1);
    store4(r0 + 8u, c0 + 64u, acc1_2);
    store4(r0 + 8u, c0 + 96u, acc1_3);
    store4(r0 + 16u, c0 + 0u, acc2_0);
    store4(r0 + 16u, c0 + 32u, acc2_1);
    store4(r0 + 16u, c0 + 64u, acc2_2);
    store4(r0 + 16u, c0 + 96u, acc2_3);
    store4(r0 + 24u, c0 + 0u, acc3_0);
    store4(r0 + 24u, c0 + 32u, acc3_1);
    store4(r0 + 24u, c0 + 64u, acc3_2);
    store4(r0 + 24u, c0 + 96u, acc3_3);
    store4(r0 + 32u, c0 + 0u, acc4_0);
    store4(r0 + 32u, c0 + 32u, acc4_1);
    store4(r0 + 32u, c0 + 64u, acc4_2);
    store4(r0 + 32u, c0 + 96u, acc4_3);
    store4(r0 + 40u, c0 + 0u, acc5_0);
    store4(r0 + 40u, c0 + 32u, acc5_1);
    store4(r0 + 40u, c0 + 64u, acc5_2);
    store4(r0 + 40u, c0 + 96u, acc5_3);
    store4(r0 + 48u, c0 + 0u, acc6_0);
    store4(r0 + 48u, c0 + 32u, acc6_1);
    store4(r0 + 48u, c0 + 64u, acc6_2);
    store4(r0 + 48u, c0 + 96u, acc6_3);
    store4(r0 + 56u, c0 + 0u, acc7_0);
    store4(r0 + 56u, c0 + 32u, acc7_1);
    store4(r0 + 56u, c0 + 64u, acc7_2);
    store4(r0 + 56u, c0 + 96u, acc7_3);
    store4(r0 + 64u, c0 + 0u, acc8_0);
    store4(r0 + 64u, c0 + 32u, acc8_1);
    store4(r0 + 64u, c0 + 64u, acc8_2);
    store4(r0 + 64u, c0 + 96u, acc8_3);
    store4(r0 + 72u, c0 + 0u, acc9_0);
    store4(r0 + 72u, c0 + 32u, acc9_1);
    store4(r0 + 72u, c0 + 64u, acc9_2);
    store4(r0 + 72u, c0 + 96u, acc9_3);
    store4(r0 + 80u, c0 + 0u, acc10_0);
    store4(r0 + 80u, c0 + 32u, acc10_1);
    store4(r0 + 80u, c0 + 64u, acc10_2);
    store4(r0 + 80u, c0 + 96u, acc10_3);
    store4(r0 + 88u, c0 + 0u, acc11_0);
    store4(r0 + 88u, c0 + 32u, acc11_1);
    store4(r0 + 88u, c0 + 64u, acc11_2);
    store4(r0 + 88u, c0 + 96u, acc11_3);
    store4(r0 + 96u, c0 + 0u, acc12_0);
    store4(r0 + 96u, c0 + 32u, acc12_1);
    store4(r0 + 96u, c0 + 64u, acc12_2);
    store4(r0 + 96u, c0 + 96u, acc12_3);
    store4(r0 + 104u, c0 + 0u, acc13_0);
    store4(r0 + 104u, c0 + 32u, acc13_1);
    store4(r0 + 104u, c0 + 64u, acc13_2);
    store4(r0 + 104u, c0 + 96u, acc13_3);
    store4(r0 + 112u, c0 + 0u, acc14_0);
    store4(r0 + 112u, c0 + 32u, acc14_1);
    store4(r0 + 112u, c0 + 64u, acc14_2);
    store4(r0 + 112u, c0 + 96u, acc14_3);
    store4(r0 + 120u, c0 + 0u, acc15_0);
    store4(r0 + 120u, c0 + 32u, acc15_1);
    store4(r0 + 120u, c0 + 64u, acc15_2);
    store4(r0 + 120u, c0 + 96u, acc15_3);
}

// Writes row gm, columns gn0 + 8 q (q = 0..3) of C from acc[q], adding bias and/or C as the flags say.
fn store4(gm: u32, gn0: u32, acc: vec4<f32>) {
    if (gm >= P.m) { return; }
    for (var q = 0u; q < 4u; q++) {
        let gn = gn0 + 8u * q;
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
