// C[m, n] (= or +=) A[m, k] @ B[k, n] (+ bias[n]) with A and B read from rgba32f textures (texel (x, y) =
// row y, elements 4x .. 4x + 3). Only for software adapters: llvmpipe turns a storage-buffer load whose
// address differs between invocations into a branchy loop over the SIMD lanes, one scalar access each,
// while a texel fetch becomes a vector gather (bench/wgpu/RESULTS.md: about 1.5x on 512^3 and 1024^3). The backend copies A and B into the textures before the dispatch. Same register-block scheme
// as matmul4.wgsl (8x8 invocations, no workgroup memory) with 16 rows x 4 vec4 columns per invocation,
// a 128x128 tile per workgroup; each output sums its k terms in increasing order, as matmul4 does.
struct Params {
    m: u32,
    n: u32,
    k: u32,
    c_off: u32,
    c_rs: u32,
    a_off: u32,     // unused (A is a texture)
    a_rs: u32,      // unused
    a_cs: u32,      // unused
    b_off: u32,     // unused (B is a texture)
    b_rs: u32,      // unused
    b_cs: u32,      // unused
    bias_off: u32,
    flags: u32,     // bit 0: accumulate into C; bit 1: add bias
}
@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> C: array<f32>;
@group(0) @binding(2) var At: texture_2d<f32>;
@group(0) @binding(3) var Bt: texture_2d<f32>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;

// Must match MATMUL4T_TILE_M / MATMUL4T_TILE_N of the backend.
const TM: u32 = 128u;
const TN: u32 = 128u;
@compute @workgroup_size(64)
fn matmul4t(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let tx = li % 8u;
    let ty = li / 8u;
    let r0 = wg.y * TM + ty;
    let v0 = wg.x * (TN / 4u) + tx;
    let mlast = P.m - 1u;
    let vlast = P.n / 4u - 1u;
    let a0 = i32(min(r0 + 0u, mlast));
    let a1 = i32(min(r0 + 8u, mlast));
    let a2 = i32(min(r0 + 16u, mlast));
    let a3 = i32(min(r0 + 24u, mlast));
    let a4 = i32(min(r0 + 32u, mlast));
    let a5 = i32(min(r0 + 40u, mlast));
    let a6 = i32(min(r0 + 48u, mlast));
    let a7 = i32(min(r0 + 56u, mlast));
    let a8 = i32(min(r0 + 64u, mlast));
    let a9 = i32(min(r0 + 72u, mlast));
    let a10 = i32(min(r0 + 80u, mlast));
    let a11 = i32(min(r0 + 88u, mlast));
    let a12 = i32(min(r0 + 96u, mlast));
    let a13 = i32(min(r0 + 104u, mlast));
    let a14 = i32(min(r0 + 112u, mlast));
    let a15 = i32(min(r0 + 120u, mlast));
    let b0 = i32(min(v0 + 0u, vlast));
    let b1 = i32(min(v0 + 8u, vlast));
    let b2 = i32(min(v0 + 16u, vlast));
    let b3 = i32(min(v0 + 24u, vlast));
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
        let bk = i32(4u * kv);
        let b0_0 = textureLoad(Bt, vec2<i32>(b0, bk + 0), 0);
        let b0_1 = textureLoad(Bt, vec2<i32>(b1, bk + 0), 0);
        let b0_2 = textureLoad(Bt, vec2<i32>(b2, bk + 0), 0);
        let b0_3 = textureLoad(Bt, vec2<i32>(b3, bk + 0), 0);
        let b1_0 = textureLoad(Bt, vec2<i32>(b0, bk + 1), 0);
        let b1_1 = textureLoad(Bt, vec2<i32>(b1, bk + 1), 0);
        let b1_2 = textureLoad(Bt, vec2<i32>(b2, bk + 1), 0);
        let b1_3 = textureLoad(Bt, vec2<i32>(b3, bk + 1), 0);
        let b2_0 = textureLoad(Bt, vec2<i32>(b0, bk + 2), 0);
        let b2_1 = textureLoad(Bt, vec2<i32>(b1, bk + 2), 0);
        let b2_2 = textureLoad(Bt, vec2<i32>(b2, bk + 2), 0);
        let b2_3 = textureLoad(Bt, vec2<i32>(b3, bk + 2), 0);
        let b3_0 = textureLoad(Bt, vec2<i32>(b0, bk + 3), 0);
        let b3_1 = textureLoad(Bt, vec2<i32>(b1, bk + 3), 0);
        let b3_2 = textureLoad(Bt, vec2<i32>(b2, bk + 3), 0);
        let b3_3 = textureLoad(Bt, vec2<i32>(b3, bk + 3), 0);
        let av0 = textureLoad(At, vec2<i32>(i32(kv), a0), 0);
        acc0_0 = acc0_0 + av0.x * b0_0 + av0.y * b1_0 + av0.z * b2_0 + av0.w * b3_0;
        acc0_1 = acc0_1 + av0.x * b0_1 + av0.y * b1_1 + av0.z * b2_1 + av0.w * b3_1;
        acc0_2 = acc0_2 + av0.x * b0_2 + av0.y * b1_2 + av0.z * b2_2 + av0.w * b3_2;
        acc0_3 = acc0_3 + av0.x * b0_3 + av0.y * b1_3 + av0.z * b2_3 + av0.w * b3_3;
        let av1 = textureLoad(At, vec2<i32>(i32(kv), a1), 0);
        acc1_0 = acc1_0 + av1.x * b0_0 + av1.y * b1_0 + av1.z * b2_0 + av1.w * b3_0;
        acc1_1 = acc1_1 + av1.x * b0_1 + av1.y * b1_1 + av1.z * b2_1 + av1.w * b3_1;
        acc1_2 = acc1_2 + av1.x * b0_2 + av1.y * b1_2 + av1.z * b2_2 + av1.w * b3_2;
        acc1_3 = acc1_3 + av1.x * b0_3 + av1.y * b1_3 + av1.z * b2_3 + av1.w * b3_3;
        let av2 = textureLoad(At, vec2<i32>(i32(kv), a2), 0);
        acc2_0 = acc2_0 + av2.x * b0_0 + av2.y * b1_0 + av2.z * b2_0 + av2.w * b3_0;
        acc2_1 = acc2_1 + av2.x * b0_1 + av2.y * b1_1 + av2.z * b2_1 + av2.w * b3_1;
        acc2_2 = acc2_2 + av2.x * b0_2 + av2.y * b1_2 + av2.z * b2_2 + av2.w * b3_2;
        acc2_3 = acc2_3 + av2.x * b0_3 + av2.y * b1_3 + av2.z * b2_3 + av2.w * b3_3;
        let av3 = textureLoad(At, vec2<i32>(i32(kv), a3), 0);
        acc3_0 = acc3_0 + av3.x * b0_0 + av3.y * b1_0 + av3.z * b2_0 + av3.w * b3_0;
        acc3_1 = acc3_1 + av3.x * b0_1 + av3.y * b1_1 + av3.z * b2_1 + av3.w * b3_1;
        acc3_2 = acc3_2 + av3.x * b0_2 + av3.y * b1_2 + av3.z * b2_2 + av3.w * b3_2;
        acc3_3 = acc3_3 + av3.x * b0_3 + av3.y * b1_3 + av3.z * b2_3 + av3.w * b3_3;
        let av4 = textureLoad(At, vec2<i32>(i32(kv), a4), 0);
        acc4_0 = acc4_0 + av4.x * b0_0 + av4.y * b1_0 + av4.z * b2_0 + av4.w * b3_0;
        acc4_1 = acc4_1 + av4.x * b0_1 + av4.y * b1_1 + av4.z * b2_1 + av4.w * b3_1;
        acc4_2 = acc4_2 + av4.x * b0_2 + av4.y * b1_2 + av4.z * b2_2 + av4.w * b3_2;
        acc4_3 = acc4_3 + av4.x * b0_3 + av4.y * b1_3 + av4.z * b2_3 + av4.w * b3_3;
        let av5 = textureLoad(At, vec2<i32>(i32(kv), a5), 0);
        acc5_0 = acc5_0 + av5.x * b0_0 + av5.y * b1_0 + av5.z * b2_0 + av5.w * b3_0;
        acc5_1 = acc5_1 + av5.x * b0_1 + av5.y * b1_1 + av5.z * b2_1 + av5.w * b3_1;
        acc5_2 = acc5_2 + av5.x * b0_2 + av5.y * b1_2 + av5.z * b2_2 + av5.w * b3_2;
        acc5_3 = acc5_3 + av5.x * b0_3 + av5.y * b1_3 + av5.z * b2_3 + av5.w * b3_3;
        let av6 = textureLoad(At, vec2<i32>(i32(kv), a6), 0);
        acc6_0 = acc6_0 + av6.x * b0_0 + av6.y * b1_0 + av6.z * b2_0 + av6.w * b3_0;
        acc6_1 = acc6_1 + av6.x * b0_1 + av6.y * b1_1 + av6.z * b2_1 + av6.w * b3_1;
        acc6_2 = acc6_2 + av6.x * b0_2 + av6.y * b1_2 + av6.z * b2_2 + av6.w * b3_2;
        acc6_3 = acc6_3 + av6.x * b0_3 + av6.y * b1_3 + av6.z * b2_3 + av6.w * b3_3;
        let av7 = textureLoad(At, vec2<i32>(i32(kv), a7), 0);
        acc7_0 = acc7_0 + av7.x * b0_0 + av7.y * b1_0 + av7.z * b2_0 + av7.w * b3_0;
        acc7_1 = acc7_1 + av7.x * b0_1 + av7.y * b1_1 + av7.z * b2_1 + av7.w * b3_1;
        acc7_2 = acc7_2 + av7.x * b0_2 + av7.y * b1_2 + av7.z * b2_2 + av7.w * b3_2;
        acc7_3 = acc7_3 + av7.x * b0_3 + av7.y * b1_3 + av7.z * b2_3 + av7.w * b3_3;
        let av8 = textureLoad(At, vec2<i32>(i32(kv), a8), 0);
        acc8_0 = acc8_0 + av8.x * b0_0 + av8.y * b1_0 + av8.z * b2_0 + av8.w * b3_0;
        acc8_1 = acc8_1 + av8.x * b0_1 + av8.y * b1_1 + av8.z * b2_1 + av8.w * b3_1;
        acc8_2 = acc8_2 + av8.x * b0_2 + av8.y * b1_2 + av8.z * b2_2 + av8.w * b3_2;
        acc8_3 = acc8_3 + av8.x * b0_3 + av8.y * b1_3 + av8.z * b2_3 + av8.w * b3_3;
        let av9 = textureLoad(At, vec2<i32>(i32(kv), a9), 0);
        acc9_0 = acc9_0 + av9.x * b0_0 + av9.y * b1_0 + av9.z * b2_0 + av9.w * b3_0;
        acc9_1 = acc9_1 + av9.x * b0_1 + av9.y * b1_1 + av9.z * b2_1 + av9.w * b3_1;
        acc9_2 = acc9_2 + av9.x * b0_2 + av9.y * b1_2 + av9.z * b2_2 + av9.w * b3_2;
        acc9_3 = acc9_3 + av9.x * b0_3 + av9.y * b1_3 + av9.z * b2_3 + av9.w * b3_3;
        let av10 = textureLoad(At, vec2<i32>(i32(kv), a10), 0);
        acc10_0 = acc10_0 + av10.x * b0_0 + av10.y * b1_0 + av10.z * b2_0 + av10.w * b3_0;
        acc10_1 = acc10_1 + av10.x * b0_1 + av10.y * b1_1 + av10.z * b2_1 + av10.w * b3_1;
        acc10_2 = acc10_2 + av10.x * b0_2 + av10.y * b1_2 + av10.z * b2_2 + av10.w * b3_2;
        acc10_3 = acc10_3 + av10.x * b0_3 + av10.y * b1_3 + av10.z * b2_3 + av10.w * b3_3;
        let av11 = textureLoad(At, vec2<i32>(i32(kv), a11), 0);
        acc11_0 = acc11_0 + av11.x * b0_0 + av11.y * b1_0 + av11.z * b2_0 + av11.w * b3_0;
        acc11_1 = acc11_1 + av11.x * b0_1 + av11.y * b1_1 + av11.z * b2_1 + av11.w * b3_1;
        acc11_2 = acc11_2 + av11.x * b0_2 + av11.y * b1_2 + av11.z * b2_2 + av11.w * b3_2;
        acc11_3 = acc11_3 + av11.x * b0_3 + av11.y * b1_3 + av11.z * b2_3 + av11.w * b3_3;
        let av12 = textureLoad(At, vec2<i32>(i32(kv), a12), 0);
        acc12_0 = acc12_0 + av12.x * b0_0 + av12.y * b1_0 + av12.z * b2_0 + av12.w * b3_0;
        acc12_1 = acc12_1 + av12.x * b0_1 + av12.y * b1_1 + av12.z * b2_1 + av12.w * b3_1;
        acc12_2 = acc12_2 + av12.x * b0_2 + av12.y * b1_2 + av12.z * b2_2 + av12.w * b3_2;
        acc12_3 = acc12_3 + av12.x * b0_3 + av12.y * b1_3 + av12.z * b2_3 + av12.w * b3_3;
        let av13 = textureLoad(At, vec2<i32>(i32(kv), a13), 0);
        acc13_0 = acc13_0 + av13.x * b0_0 + av13.y * b1_0 + av13.z * b2_0 + av13.w * b3_0;
        acc13_1 = acc13_1 + av13.x * b0_1 + av13.y * b1_1 + av13.z * b2_1 + av13.w * b3_1;
        acc13_2 = acc13_2 + av13.x * b0_2 + av13.y * b1_2 + av13.z * b2_2 + av13.w * b3_2;
        acc13_3 = acc13_3 + av13.x * b0_3 + av13.y * b1_3 + av13.z * b2_3 + av13.w * b3_3;
        let av14 = textureLoad(At, vec2<i32>(i32(kv), a14), 0);
        acc14_0 = acc14_0 + av14.x * b0_0 + av14.y * b1_0 + av14.z * b2_0 + av14.w * b3_0;
        acc14_1 = acc14_1 + av14.x * b0_1 + av14.y * b1_1 + av14.z * b2_1 + av14.w * b3_1;
        acc14_2 = acc14_2 + av14.x * b0_2 + av14.y * b1_2 + av14.z * b2_2 + av14.w * b3_2;
        acc14_3 = acc14_3 + av14.x * b0_3 + av14.y * b1_3 + av14.z * b2_3 + av14.w * b3_3;
        let av15 = textureLoad(At, vec2<i32>(i32(kv), a15), 0);
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
