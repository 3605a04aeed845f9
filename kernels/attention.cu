// Causal multi-head self-attention without the [t, t] matrices (flash-style); mirrors shaders/attention.wgsl
// kernel for kernel, loop for loop: qkv [b, t, 3c] laid out as q | k | v, heads hs = c / nh wide, hs <= HS
// (the host refuses wider heads). The forward keeps each row's log-sum-exp lse [b, nh, t]; backward
// recomputes the probabilities tile by tile from it, with delta [b, nh, t] = each row's dout . out. Every
// output is owned by one thread and adds its terms in increasing key or query order: no atomics.
// Launch: `attention_forward`, `attention_backward_dq`, `_dk`, `_dv` on b * nh * ceil(t / ROWS) blocks of
// ROWS threads (a query or key row each); `attention_backward_delta` one thread per (b, h, t) row,
// ceil(b * nh * t / WG) blocks of WG.
// Each thread keeps its row's head vectors in float4 arrays of HV, zero past hs, so every loop has a fixed
// trip count (unrolled into registers) and the zeros add nothing.

#define ROWS 64u  // threads per block: query rows (forward, dq) or key rows (dk, dv)
#define TILE 32u  // rows of k and v (or q and dout) staged per tile in shared memory
#define HS 64u    // widest head
#define HV 16u    // HS / 4

// Offset of head h of part (0 q, 1 k, 2 v) at position tp of sequence b.
__device__ __forceinline__ u32 qkv_index(u32 t, u32 c, u32 hs, u32 b, u32 tp, u32 part, u32 h) {
    return (b * t + tp) * 3u * c + part * c + h * hs;
}

// Elements i0 .. i0 + 3 of the head row at `base` of `src`, 0 at and past `n` (hs, or 0 for rows past t).
__device__ __forceinline__ float4 head4(const float* src, u32 base, u32 i0, u32 n) {
    float4 r = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i0 < n) { r.x = src[base + i0]; }
    if (i0 + 1u < n) { r.y = src[base + i0 + 1u]; }
    if (i0 + 2u < n) { r.z = src[base + i0 + 2u]; }
    if (i0 + 3u < n) { r.w = src[base + i0 + 3u]; }
    return r;
}

__device__ __forceinline__ void load_row(float4* x, const float* src, u32 base, u32 n) {
#pragma unroll
    for (u32 j = 0u; j < HV; j++) { x[j] = head4(src, base, j * 4u, n); }
}

// One head's columns of a [b, t, *] tensor, as a tile is staged from it.
struct TileSource {
    const float* src;
    u32 row_stride;  // elements between positions
    u32 col;         // offset of the head within a position
};

// Stages rows r0 .. r0 + TILE of sequence seq: tile_a from `a`, tile_b from `b`; rows past t are zeros.
// Every thread of the block must call it.

__device__ void stage(float4* tile_a, float4* tile_b, TileSource a, TileSource b, u32 t, u32 hs, u32 seq, u32 r0,
                      u32 li) {
    __syncthreads();
    for (u32 e = li; e < TILE * HV; e += ROWS) {
        const u32 row = r0 + e / HV;
        const u32 rr = min(row, t - 1u);
        const u32 n = row < t ? hs : 0u;
        tile_a[e] = head4(a.src, (seq * t + rr) * a.row_stride + a.col, (e % HV) * 4u, n);
        tile_b[e] = head4(b.src, (seq * t + rr) * b.row_stride + b.col, (e % HV) * 4u, n);
    }
    __syncthreads();
}

// x . (row of a tile) over HS, terms in increasing index, each product rounded.
__device__ __forceinline__ float dot_row(const float4* x, const float4* tile, u32 row) {
    float s = 0.0f;
#pragma unroll
    for (u32 j = 0u; j < HV; j++) {
        const float4 y = tile[row * HV + j];
        s += x[j].x * y.x;
        s += x[j].y * y.y;
        s += x[j].z * y.z;
        s += x[j].w * y.w;
    }
    return s;
}

// acc += w * (row of a tile).
__device__ __forceinline__ void axpy_row(float4* acc, float w, const float4* tile, u32 row) {
#pragma unroll
    for (u32 j = 0u; j < HV; j++) {
        const float4 y = tile[row * HV + j];
        acc[j].x += w * y.x;
        acc[j].y += w * y.y;
        acc[j].z += w * y.z;
        acc[j].w += w * y.w;
    }
}

// Writes x's first hs elements at dst.
__device__ __forceinline__ void store_row(float* dst, const float4* x, u32 hs) {
    for (u32 i = 0u; i < hs; i++) {
        const float4 v = x[i / 4u];
        const u32 k = i % 4u;
        dst[i] = k == 0u ? v.x : (k == 1u ? v.y : (k == 2u ? v.z : v.w));
    }
}

// The (b, h, first row) of a block of ROWS rows; false for blocks past the grid's work.
__device__ __forceinline__ bool block_of(u32 b, u32 t, u32 nh, u32* seq, u32* h, u32* r0) {
    const u32 blocks = (t + ROWS - 1u) / ROWS;
    const u32 g = blockIdx.x;
    if (g >= b * nh * blocks) { return false; }
    *seq = g / (blocks * nh);
    *h = (g / blocks) % nh;
    *r0 = (g % blocks) * ROWS;
    return true;
}

// out [b, t, c] = softmax(q k^T / sqrt(hs)) v per head with an online softmax; lse [b, nh, t].
extern "C" __global__ void __launch_bounds__(ROWS) attention_forward(
    float* out, float* lse, const float* qkv, u32 b, u32 t, u32 c, u32 nh) {
    __shared__ float4 tile_a[TILE * HV];
    __shared__ float4 tile_b[TILE * HV];
    u32 seq, h, r0;
    if (!block_of(b, t, nh, &seq, &h, &r0)) { return; }
    const u32 li = threadIdx.x;
    const u32 tq = r0 + li;
    const bool live = tq < t;
    const u32 hs = c / nh;
    const float scale = sqrtf((float)hs);
    float4 q[HV];
    float4 acc[HV];
    float s[TILE];
    load_row(q, qkv, qkv_index(t, c, hs, seq, min(tq, t - 1u), 0u, h), live ? hs : 0u);
#pragma unroll
    for (u32 j = 0u; j < HV; j++) { acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
    float m = NEG_F32_MAX;
    float l = 0.0f;
    const TileSource ks = {qkv, 3u * c, c + h * hs};
    const TileSource vs = {qkv, 3u * c, 2u * c + h * hs};
    const u32 end = min(r0 + ROWS, t);
    for (u32 k0 = 0u; k0 < end; k0 += TILE) {
        stage(tile_a, tile_b, ks, vs, t, hs, seq, k0, li);
        float mt = m;
#pragma unroll
        for (u32 j = 0u; j < TILE; j++) {
            s[j] = dot_row(q, tile_a, j) / scale;
            if (k0 + j <= tq) { mt = fmaxf(mt, s[j]); }
        }
        const float corr = expf(m - mt);
        l = l * corr;
#pragma unroll
        for (u32 j = 0u; j < HV; j++) {
            acc[j].x = acc[j].x * corr;
            acc[j].y = acc[j].y * corr;
            acc[j].z = acc[j].z * corr;
            acc[j].w = acc[j].w * corr;
        }
#pragma unroll
        for (u32 j = 0u; j < TILE; j++) {
            if (k0 + j <= tq) {
                const float p = expf(s[j] - mt);
                l += p;
                axpy_row(acc, p, tile_b, j);
            }
        }
        m = mt;
    }
    if (!live) { return; }
    const float inv = 1.0f / l;
#pragma unroll
    for (u32 j = 0u; j < HV; j++) {
        acc[j].x = acc[j].x * inv;
        acc[j].y = acc[j].y * inv;
        acc[j].z = acc[j].z * inv;
        acc[j].w = acc[j].w * inv;
    }
    store_row(out + (seq * t + tq) * c + h * hs, acc, hs);
    lse[(seq * nh + h) * t + tq] = m + logf(l);
}

// delta[b, h, tq] = sum over i < hs (in order) of dout[b, tq, h, i] * out[b, tq, h, i].
// delta [b, nh, t], dout and out [b, t, c].
extern "C" __global__ void __launch_bounds__(WG) attention_backward_delta(
    float* delta, const float* dout, const float* out, u32 b, u32 t, u32 c, u32 nh) {
    const u32 row = flat_index();
    if (row >= b * nh * t) { return; }
    const u32 tq = row % t;
    const u32 h = (row / t) % nh;
    const u32 seq = row / (t * nh);
    const u32 hs = c / nh;
    const u32 o = (seq * t + tq) * c + h * hs;
    float s = 0.0f;
    for (u32 i = 0u; i < hs; i++) { s += dout[o + i] * out[o + i]; }
    delta[row] = s;
}

// dq[b, tq, h] = sum over t2 <= tq of ds / sqrt(hs) * k[b, t2, h], ds = p * (dout . v - delta),
// p = exp(q . k / sqrt(hs) - lse). dqkv [b, t, 3c] (the q part written here), lse and delta [b, nh, t],
// qkv [b, t, 3c], dout [b, t, c].
extern "C" __global__ void __launch_bounds__(ROWS) attention_backward_dq(
    float* dqkv, const float* lse, const float* qkv, const float* delta, const float* dout, u32 b, u32 t, u32 c,
    u32 nh) {
    __shared__ float4 tile_a[TILE * HV];
    __shared__ float4 tile_b[TILE * HV];
    u32 seq, h, r0;
    if (!block_of(b, t, nh, &seq, &h, &r0)) { return; }
    const u32 li = threadIdx.x;
    const u32 tq = r0 + li;
    const bool live = tq < t;
    const u32 rq = min(tq, t - 1u);
    const u32 hs = c / nh;
    const float scale = sqrtf((float)hs);
    float4 q[HV];
    float4 d[HV];
    float4 dq[HV];
    load_row(q, qkv, qkv_index(t, c, hs, seq, rq, 0u, h), live ? hs : 0u);
    load_row(d, dout, (seq * t + rq) * c + h * hs, live ? hs : 0u);
#pragma unroll
    for (u32 j = 0u; j < HV; j++) { dq[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
    const u32 row = (seq * nh + h) * t + rq;
    const float row_lse = lse[row];
    const float row_delta = delta[row];
    const TileSource ks = {qkv, 3u * c, c + h * hs};
    const TileSource vs = {qkv, 3u * c, 2u * c + h * hs};
    const u32 end = min(r0 + ROWS, t);
    for (u32 k0 = 0u; k0 < end; k0 += TILE) {
        stage(tile_a, tile_b, ks, vs, t, hs, seq, k0, li);
        for (u32 j = 0u; j < TILE; j++) {
            if (k0 + j <= tq) {
                const float p = expf(dot_row(q, tile_a, j) / scale - row_lse);
                const float ds = p * (dot_row(d, tile_b, j) - row_delta);
                axpy_row(dq, ds / scale, tile_a, j);
            }
        }
    }
    if (!live) { return; }
    store_row(dqkv + qkv_index(t, c, hs, seq, tq, 0u, h), dq, hs);
}

// dk[b, t2, h] = sum over tq >= t2 (in order) of ds / sqrt(hs) * q[b, tq, h], with p and ds as in dq.
// A key row per thread, query tiles from the block's first key to t. Arguments as for dq (the k part of
// dqkv written here).
extern "C" __global__ void __launch_bounds__(ROWS) attention_backward_dk(
    float* dqkv, const float* lse, const float* qkv, const float* delta, const float* dout, u32 b, u32 t, u32 c,
    u32 nh) {
    __shared__ float4 tile_a[TILE * HV];
    __shared__ float4 tile_b[TILE * HV];
    u32 seq, h, r0;
    if (!block_of(b, t, nh, &seq, &h, &r0)) { return; }
    const u32 li = threadIdx.x;
    const u32 t2 = r0 + li;
    const bool live = t2 < t;
    const u32 rk = min(t2, t - 1u);
    const u32 hs = c / nh;
    const float scale = sqrtf((float)hs);
    float4 k[HV];
    float4 v[HV];
    float4 dk[HV];
    load_row(k, qkv, qkv_index(t, c, hs, seq, rk, 1u, h), live ? hs : 0u);
    load_row(v, qkv, qkv_index(t, c, hs, seq, rk, 2u, h), live ? hs : 0u);
#pragma unroll
    for (u32 j = 0u; j < HV; j++) { dk[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
    const u32 rows = (seq * nh + h) * t;
    const TileSource qs = {qkv, 3u * c, h * hs};
    const TileSource ds_src = {dout, c, h * hs};
    for (u32 q0 = r0; q0 < t; q0 += TILE) {
        stage(tile_a, tile_b, qs, ds_src, t, hs, seq, q0, li);
        for (u32 i = 0u; i < TILE; i++) {
            const u32 tq = q0 + i;
            if (tq >= t2 && tq < t) {
                const float p = expf(dot_row(k, tile_a, i) / scale - lse[rows + tq]);
                const float ds = p * (dot_row(v, tile_b, i) - delta[rows + tq]);
                axpy_row(dk, ds / scale, tile_a, i);
            }
        }
    }
    if (!live) { return; }
    store_row(dqkv + qkv_index(t, c, hs, seq, t2, 1u, h), dk, hs);
}

// dv[b, t2, h] = sum over tq >= t2 (in order) of p * dout[b, tq, h]. Arguments as for dq (the v part of
// dqkv written here).
extern "C" __global__ void __launch_bounds__(ROWS) attention_backward_dv(
    float* dqkv, const float* lse, const float* qkv, const float* delta, const float* dout, u32 b, u32 t, u32 c,
    u32 nh) {
    __shared__ float4 tile_a[TILE * HV];
    __shared__ float4 tile_b[TILE * HV];
    u32 seq, h, r0;
    if (!block_of(b, t, nh, &seq, &h, &r0)) { return; }
    const u32 li = threadIdx.x;
    const u32 t2 = r0 + li;
    const bool live = t2 < t;
    const u32 rk = min(t2, t - 1u);
    const u32 hs = c / nh;
    const float scale = sqrtf((float)hs);
    float4 k[HV];
    float4 dv[HV];
    load_row(k, qkv, qkv_index(t, c, hs, seq, rk, 1u, h), live ? hs : 0u);
#pragma unroll
    for (u32 j = 0u; j < HV; j++) { dv[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
    const u32 rows = (seq * nh + h) * t;
    const TileSource qs = {qkv, 3u * c, h * hs};
    const TileSource ds_src = {dout, c, h * hs};
    for (u32 q0 = r0; q0 < t; q0 += TILE) {
        stage(tile_a, tile_b, qs, ds_src, t, hs, seq, q0, li);
        for (u32 i = 0u; i < TILE; i++) {
            const u32 tq = q0 + i;
            if (tq >= t2 && tq < t) {
                const float p = expf(dot_row(k, tile_a, i) / scale - lse[rows + tq]);
                axpy_row(dv, p, tile_b, i);
            }
        }
    }
    if (!live) { return; }
    store_row(dqkv + qkv_index(t, c, hs, seq, t2, 2u, h), dv, hs);
}
