// C[m, n] (= or +=) A[m, k] @ B[k, n] (+ bias[n]) for row-major A and B (unit column strides), both bound
// as vec4<f32> arrays: the backend picks this kernel when A's and B's offsets and row strides, n and k are
// multiples of 4, and the strided kernel of matmul.wgsl otherwise. A, B offsets and row strides count vec4s.
// Same scheme as matmul.wgsl (8x8 invocations, a register block each, no workgroup memory), but every load
// brings 4 values: invocation (tx, ty) computes rows ty + 8 i (i < 16) and the 4 columns of vec4 columns
// tx + 8 q (q < 4), a 128x128 tile per workgroup; k advances 4 at a time (32 vec4 loads per 1024 multiply-adds).
// Each output still sums its k terms in increasing order.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    c_off: u32,
    c_rs: u32,
    a_off: u32,     // vec4s
    a_rs: u32,      // vec4s
    a_cs: u32,      // unused (1)
    b_off: u32,     // vec4s
    b_rs: u32,      // vec4s
    b_cs: u32,      // unused (1)
    bias_off: u32,
    flags: u32,     // bit 0: accumulate into C; bit 1: add bias
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> C: array<f32>;
@group(0) @binding(2) var<storage, read_write> A: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> B: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;

// Must match MATMUL4_TILE_M / MATMUL4_TILE_N of the backend.
const TM: u32 = 128u;
const TN: u32 = 128u;

@compute @workgroup_size(64)
fn matmul4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tx = li % 8u;
    let ty = li / 8u;
    let r0 = wg.y * TM + ty;
    let v0 = wg.x * (TN / 4u) + tx;   // first vec4 column
    let mlast = P.m - 1u;
    let vlast = P.n / 4u - 1u;
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
    let b0 = P.b_off + min(v0 + 0u, vlast);
    let b1 = P.b_off + min(v0 + 8u, vlast);
    let b2 = P.b_off + min(v0 + 16u, vlast);
    let b3 = P.b_off + min(v0 + 24u, vlast);
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
    let k4 = P.k / 4u;
    for (var kv = 0u; kv < k4; kv++) {
        let bk = 4u * kv * P.b_rs;
        let b0_0 = B[b0 + bk];
        let b0_1 = B[b1 + bk];
        let b0_2 = B[b2 + bk];
        let b0_3 = B[b3 + bk];
        let b1_0 = B[b0 + bk + P.b_rs];
        let b1_1 = B[b1 + bk + P.b_rs];
        let b1_2 = B[b2 + bk + P.b_rs];
        let b1_3 = B[b3 + bk + P.b_rs];
        let b2_0 = B[b0 + bk + 2u * P.b_rs];
        let b2_1 = B[b1 + bk + 2u * P.b_rs];
        let b2_2 = B[b2 + bk + 2u * P.b_rs];
        let b2_3 = B[b3 + bk + 2u * P.b_rs];
        let b3_0 = B[b0 + bk + 3u * P.b_rs];
        let b3_1 = B[b1 + bk + 3u * P.b_rs];
        let b3_2 = B[b2 + bk + 3u * P.b_rs];
        let b3_3 = B[b3 + bk + 3u * P.b_rs];
        let av0 = A[a0 + kv];
        acc0_0 = acc0_0 + av0.x * b0_0 + av0.y * b1_0 + av0.z * b2_0 + av0.w * b3_0;
        acc0_1 = acc0_1 + av0.x * b0_1 + av0.y * b1_1 + av0.z * b2_1 + av0.w * b3_1;
        acc0_2 = acc0_2 + av0.x * b0_2 + av0.y * b1_2 + av0.z * b2_2 + av0.w * b3_2;
        acc0_3 = acc0_3 + av0.x * b0_3 + av0.y * b1_3 + av0.z * b2_3 + av0.w * b3_3;
        let av1 = A[a1 + kv];
        acc1_0 = acc1_0 + av1.x * b0_0 + av1.y * b1_0 + av1.z * b2_0 + av1.w * b3_0;
        acc1_1 = acc1_1 + av1.x * b0_1 + av1.y * b1_1 + av1.z * b2_1 + av1.w * b3_1;
        acc1_2 = acc1_2 + av1.x * b0_2 + av1.y * b1_2 + av1.z * b2_2 + av1.w * b3_2;
        acc1_3 = acc1_3 + av1.x * b0_3 + av1.y * b1_3 + av1.z * b2_3 + av1.w * b3_3;
        let av2 = A[a2 + kv];
        acc2_0 = acc2_0 + av2.x * b0_0 + av2.y * b1_0 + av2.z * b2_0 + av2.w * b3_0;
        acc2_1 = acc2_1 + av2.x * b0_1 + av2.y * b1_1 + av2.z * b2_1 + av2.w * b3_1;
        acc2_2 = acc2_2 + av2.x * b0_2 + av2.y * b1_2 + av2.z * b2_2 + av2.w * b3_2;
        acc2_3 = acc2_3 + av2.x * b0_3 + av2.y * b1_3 + av2.z * b2_3 + av2.w * b3_3;
        let av3 = A[a3 + kv];
        acc3_0 = acc3_0 + av3.x * b0_0 + av3.y * b1_0 + av3.z * b2_0 + av3.w * b3_0;
        acc3_1 = acc3_1 + av3.x * b0_1 + av3.y * b1_1 + av3.z * b2_1 + av3.w * b3_1;
        acc3_2 = acc3_2 + av3.x * b0_2 + av3.y * b1_2 + av3.z * b2_2 + av3.w * b3_2;
        acc3_3 = acc3_3 + av3.x * b0_3 + av3.y * b1_3 + av3.z * b2_3 + av3.w * b3_3;
        let av4 = A[a4 + kv];
        acc4_0 = acc4_0 + av4.x * b0_0 + av4.y * b1_0 + av4.z * b2_0 + av4.w * b3_0;
        acc4_1 = acc4_1 + av4.x * b0_1 + av4.y * b1_1 + av4.z * b2_1 + av4.w * b3_1;
        acc4_2 = acc4_2 + av4.x * b0_2 + av4.y * b1_2 + av4.z * b2_2 + av4.w * b3_2;
        acc4_3 = acc4_3 + av4.x * b0_3 + av4.y * b1_3 + av4.z * b2_3 + av4.w * b3_3;
        let av5 = A[a5 + kv];
        acc5_0 = acc5_0 + av5.x * b0_0 + av5.y * b1_0 + av5.z * b2_0 + av5.w * b3_0;
        acc5_1 = acc5_1 + av5.x * b0_1 + av5.y * b1_1 + av5.z * b2_1 + av5.w * b3_1;
        acc5_2 = acc5_2 + av5.x * b0_2 + av5.y * b1_2 + av5.z * b2_2 + av5.w * b3_2;
        acc5_3 = acc5_3 + av5.x * b0_3 + av5.y * b1_3 + av5.z * b2_3 + av5.w * b3_3;
        let av6 = A[a6 + kv];
        acc6_0 = acc6_0 + av6.x * b0_0 + av6.y * b1_0 + av6.z * b2_0 + av6.w * b3_0;
        acc6_1 = acc6_1 + av6.x * b0_1 + av6.y * b1_1 + av6.z * b2_1 + av6.w * b3_1;
        acc6_2 = acc6_2 + av6.x * b0_2 + av6.y * b1_2 + av6.z * b2_2 + av6.w * b3_2;
        acc6_3 = acc6_3 + av6.x * b0_3 + av6.y * b1_3 + av6.z * b2_3 + av6.w * b3_3;
        let av7 = A[a7 + kv];
        acc7_0 = acc7_0 + av7.x * b0_0 + av7.y * b1_0 + av7.z * b2_0 + av7.w * b3_0;
        acc7_1 = acc7_1 + av7.x * b0_1 + av7.y * b1_1 + av7.z * b2_1 + av7.w * b3_1;
        acc7_2 = acc7_2 + av7.x * b0_2 + av7.y * b1_2 + av7.z * b2_2 + av7.w * b3_2;
        acc7_3 = acc7_3 + av7.x * b0_3 + av7.y * b1_3 + av7.z * b2_3 + av7.w * b3_3;
        let av8 = A[a8 + kv];
        acc8_0 = acc8_0 + av8.x * b0_0 + av8.y * b1_0 + av8.z * b2_0 + av8.w * b3_0;
        acc8_1 = acc8_1 + av8.x * b0_1 + av8.y * b1_1 + av8.z * b2_1 + av8.w * b3_1;
        acc8_2 = acc8_2 + av8.x * b0_2 + av8.y * b1_2 + av8.z * b2_2 + av8.w * b3_2;
        acc8_3 = acc8_3 + av8.x * b0_3 + av8.y * b1_3 + av8.z * b2_3 + av8.w * b3_3;
        let av9 = A[a9 + kv];
        acc9_0 = acc9_0 + av9.x * b0_0 + av9.y * b1_0 + av9.z * b2_0 + av9.w * b3_0;
        acc9_1 = acc9_1 + av9.x * b0_1 + av9.y * b1_1 + av9.z * b2_1 + av9.w * b3_1;
        acc9_2 = acc9_2 + av9.x * b0_2 + av9.y * b1_2 + av9.z * b2_2 + av9.w * b3_2;
        acc9_3 = acc9_3 + av9.x * b0_3 + av9.y * b1_3 + av9.z * b2_3 + av9.w * b3_3;
        let av10 = A[a10 + kv];
        acc10_0 = acc10_0 + av10.x * b0_0 + av10.y * b1_0 + av10.z * b2_0 + av10.w * b3_0;
        acc10_1 = acc10_1 + av10.x * b0_1 + av10.y * b1_1 + av10.z * b2_1 + av10.w * b3_1;
        acc10_2 = acc10_2 + av10.x * b0_2 + av10.y * b1_2 + av10.z * b2_2 + av10.w * b3_2;
        acc10_3 = acc10_3 + av10.x * b0_3 + av10.y * b1_3 + av10.z * b2_3 + av10.w * b3_3;
        let av11 = A[a11 + kv];
        acc11_0 = acc11_0 + av11.x * b0_0 + av11.y * b1_0 + av11.z * b2_0 + av11.w * b3_0;
        acc11_1 = acc11_1 + av11.x * b0_1 + av11.y * b1_1 + av11.z * b2_1 + av11.w * b3_1;
        acc11_2 = acc11_2 + av11.x * b0_2 + av11.y * b1_2 + av11.z * b2_2 + av11.w * b3_2;
        acc11_3 = acc11_3 + av11.x * b0_3 + av11.y * b1_3 + av11.z * b2_3 + av11.w * b3_3;
        let av12 = A[a12 + kv];
        acc12_0 = acc12_0 + av12.x * b0_0 + av12.y * b1_0 + av12.z * b2_0 + av12.w * b3_0;
        acc12_1 = acc12_1 + av12.x * b0_1 + av12.y * b1_1 + av12.z * b2_1 + av12.w * b3_1;
        acc12_2 = acc12_2 + av12.x * b0_2 + av12.y * b1_2 + av12.z * b2_2 + av12.w * b3_2;
        acc12_3 = acc12_3 + av12.x * b0_3 + av12.y * b1_3 + av12.z * b2_3 + av12.w * b3_3;
        let av13 = A[a13 + kv];
        acc13_0 = acc13_0 + av13.x * b0_0 + av13.y * b1_0 + av13.z * b2_0 + av13.w * b3_0;
        acc13_1 = acc13_1 + av13.x * b0_1 + av13.y * b1_1 + av13.z * b2_1 + av13.w * b3_1;
        acc13_2 = acc13_2 + av13.x * b0_2 + av13.y * b1_2 + av13.z * b2_2 + av13.w * b3_2;
        acc13_3 = acc13_3 + av13.x * b0_3 + av13.y * b1_3 + av13.z * b2_3 + av13.w * b3_3;
        let av14 = A[a14 + kv];
        acc14_0 = acc14_0 + av14.x * b0_0 + av14.y * b1_0 + av14.z * b2_0 + av14.w * b3_0;
        acc14_1 = acc14_1 + av14.x * b0_1 + av14.y * b1_1 + av14.z * b2_1 + av14.w * b3_1;
        acc14_2 = acc14_2 + av14.x * b0_2 + av14.y * b1_2 + av14.z * b2_2 + av14.w * b3_2;
        acc14_3 = acc14_3 + av14.x * b0_3 + av14.y * b1_3 + av14.z * b2_3 + av14.w * b3_3;
        let av15 = A[a15 + kv];
        acc15_0 = acc15_0 + av15.x * b0_0 + av15.y * b1_0 + av15.z * b2_0 + av15.w * b3_0;
        acc15_1 = acc15_1 + av15.x * b0_1 + av15.y * b1_1 + av15.z * b2_1 + av15.w * b3_1;
        acc15_2 = acc15_2 + av15.x * b0_2 + av15.y * b1_2 + av15.z * b2_2 + av15.w * b3_2;
        acc15_3 = acc15_3 + av15.x * b0_3 + av15.y * b1_3 + av15.z * b2_3 + av15.w * b3_3;
    }
    store4(r0 + 0u, 4u * (v0 + 0u), acc0_0);
    store4(r0 + 0u, 4u * (v0 + 8u), acc0_1);
    store4(r0 + 0u, 4u * (v0 + 16u), acc0_2);
    store4(r0 + 0u, 4u * (v0 + 24u), acc0_3);
    store4(r0 + 8u, 4u * (v0 + 0u), acc1_0);
    store4(r0 + 8u, 4u * (v0 + 8u), acc1_1);
    store4(r0 + 8u, 4u * (v0 + 16u), acc1_2);
    store4(r0 + 8u, 4u * (v0 + 24u), acc1_3);
    store4(r0 + 16u, 4u * (v0 + 0u), acc2_0);
    store4(r0 + 16u, 4u * (v0 + 8u), acc2_1);
    store4(r0 + 16u, 4u * (v0 + 16u), acc2_2);
    store4(r0 + 16u, 4u * (v0 + 24u), acc2_3);
    store4(r0 + 24u, 4u * (v0 + 0u), acc3_0);
    store4(r0 + 24u, 4u * (v0 + 8u), acc3_1);
    store4(r0 + 24u, 4u * (v0 + 16u), acc3_2);
    store4(r0 + 24u, 4u * (v0 + 24u), acc3_3);
    store4(r0 + 32u, 4u * (v0 + 0u), acc4_0);
    store4(r0 + 32u, 4u * (v0 + 8u), acc4_1);
    store4(r0 + 32u, 4u * (v0 + 16u), acc4_2);
    store4(r0 + 32u, 4u * (v0 + 24u), acc4_3);
    store4(r0 + 40u, 4u * (v0 + 0u), acc5_0);
    store4(r0 + 40u, 4u * (v0 + 8u), acc5_1);
    store4(r0 + 40u, 4u * (v0 + 16u), acc5_2);
    store4(r0 + 40u, 4u * (v0 + 24u), acc5_3);
    store4(r0 + 48u, 4u * (v0 + 0u), acc6_0);
    store4(r0 + 48u, 4u * (v0 + 8u), acc6_1);
    store4(r0 + 48u, 4u * (v0 + 16u), acc6_2);
    store4(r0 + 48u, 4u * (v0 + 24u), acc6_3);
    store4(r0 + 56u, 4u * (v0 + 0u), acc7_0);
    store4(r0 + 56u, 4u * (v0 + 8u), acc7_1);
    store4(r0 + 56u, 4u * (v0 + 16u), acc7_2);
    store4(r0 + 56u, 4u * (v0 + 24u), acc7_3);
    store4(r0 + 64u, 4u * (v0 + 0u), acc8_0);
    store4(r0 + 64u, 4u * (v0 + 8u), acc8_1);
    store4(r0 + 64u, 4u * (v0 + 16u), acc8_2);
    store4(r0 + 64u, 4u * (v0 + 24u), acc8_3);
    store4(r0 + 72u, 4u * (v0 + 0u), acc9_0);
    store4(r0 + 72u, 4u * (v0 + 8u), acc9_1);
    store4(r0 + 72u, 4u * (v0 + 16u), acc9_2);
    store4(r0 + 72u, 4u * (v0 + 24u), acc9_3);
    store4(r0 + 80u, 4u * (v0 + 0u), acc10_0);
    store4(r0 + 80u, 4u * (v0 + 8u), acc10_1);
    store4(r0 + 80u, 4u * (v0 + 16u), acc10_2);
    store4(r0 + 80u, 4u * (v0 + 24u), acc10_3);
    store4(r0 + 88u, 4u * (v0 + 0u), acc11_0);
    store4(r0 + 88u, 4u * (v0 + 8u), acc11_1);
    store4(r0 + 88u, 4u * (v0 + 16u), acc11_2);
    store4(r0 + 88u, 4u * (v0 + 24u), acc11_3);
    store4(r0 + 96u, 4u * (v0 + 0u), acc12_0);
    store4(r0 + 96u, 4u * (v0 + 8u), acc12_1);
    store4(r0 + 96u, 4u * (v0 + 16u), acc12_2);
    store4(r0 + 96u, 4u * (v0 + 24u), acc12_3);
    store4(r0 + 104u, 4u * (v0 + 0u), acc13_0);
    store4(r0 + 104u, 4u * (v0 + 8u), acc13_1);
    store4(r0 + 104u, 4u * (v0 + 16u), acc13_2);
    store4(r0 + 104u, 4u * (v0 + 24u), acc13_3);
    store4(r0 + 112u, 4u * (v0 + 0u), acc14_0);
    store4(r0 + 112u, 4u * (v0 + 8u), acc14_1);
    store4(r0 + 112u, 4u * (v0 + 16u), acc14_2);
    store4(r0 + 112u, 4u * (v0 + 24u), acc14_3);
    store4(r0 + 120u, 4u * (v0 + 0u), acc15_0);
    store4(r0 + 120u, 4u * (v0 + 8u), acc15_1);
    store4(r0 + 120u, 4u * (v0 + 16u), acc15_2);
    store4(r0 + 120u, 4u * (v0 + 24u), acc15_3);
}

// Writes row gm, columns gn0 .. gn0 + 3 of C from acc, adding bias and/or C as the flags say.
fn store4(gm: u32, gn0: u32, acc: vec4<f32>) {
    if (gm >= P.m || gn0 >= P.n) { return; }
    for (var q = 0u; q < 4u; q++) {
        let gn = gn0 + q;
        var v = acc[q];
        if ((P.flags & 2u) != 0u) { v = v + bias[P.bias_off + gn]; }
        let o = P.c_off + gm * P.c_rs + gn;
        if ((P.flags & 1u) != 0u) { v = C[o] + v; }
        C[o] = v;
    }
}
