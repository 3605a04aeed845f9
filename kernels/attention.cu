// Causal multi-head self-attention; mirrors shaders/attention.wgsl kernel for kernel: every output is owned
// by one thread and sums its terms in a fixed order (no atomics). qkv [b, t, 3c] laid out as q | k | v,
// att [b, nh, t, t] softmax probabilities (0 above the diagonal), heads hs = c / nh wide.
// Launch: the row kernels one thread per (b, h, tq) row, i.e. ceil(b * nh * t / WG) blocks; the others one
// thread per element of a [b, t, c] activation, ceil(b * t * c / WG) blocks.
// The WGSL dot products add four terms per loop iteration (llvmpipe's loop limit); the plain loops here add
// the same terms in the same increasing order.

// Element i of head h of part (0 q, 1 k, 2 v) at position tp of sequence b.
__device__ __forceinline__ float qkv_at(const float* qkv, u32 t, u32 c, u32 hs, u32 b, u32 tp, u32 part, u32 h,
                                        u32 i) {
    return qkv[(b * t + tp) * 3u * c + part * c + h * hs + i];
}

// att row (b, h, tq) = softmax over t2 <= tq of q[b, tq, h] . k[b, t2, h] / sqrt(hs); out [b, t, c] is
// written by `attention_forward_out`.
extern "C" __global__ void __launch_bounds__(WG) attention_forward(
    float* att, const float* qkv, u32 b, u32 t, u32 c, u32 nh) {
    const u32 row = flat_index();
    if (row >= b * nh * t) { return; }
    const u32 tq = row % t;
    const u32 h = (row / t) % nh;
    const u32 bb = row / (t * nh);
    const u32 hs = c / nh;
    const float sc = sqrtf((float)hs);
    float* a = att + row * t;
    float mx = NEG_F32_MAX;
    for (u32 t2 = 0u; t2 <= tq; t2++) {
        float dot = 0.0f;
        for (u32 i = 0u; i < hs; i++) {
            dot += qkv_at(qkv, t, c, hs, bb, tq, 0u, h, i) * qkv_at(qkv, t, c, hs, bb, t2, 1u, h, i);
        }
        dot = dot / sc;
        a[t2] = dot;
        mx = fmaxf(mx, dot);
    }
    float sum = 0.0f;
    for (u32 t2 = 0u; t2 <= tq; t2++) {
        const float e = expf(a[t2] - mx);
        a[t2] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
    for (u32 t2 = 0u; t2 < t; t2++) { a[t2] = t2 <= tq ? a[t2] * inv : 0.0f; }
}

// out[b, tq, h*hs + i] = sum over t2 <= tq (in order) of att[b, h, tq, t2] * v[b, t2, h, i].
// out [b, t, c].
extern "C" __global__ void __launch_bounds__(WG) attention_forward_out(
    float* out, const float* att, const float* qkv, u32 b, u32 t, u32 c, u32 nh) {
    const u32 g = flat_index();
    if (g >= b * t * c) { return; }
    const u32 hs = c / nh;
    const u32 col = g % c;
    const u32 tq = (g / c) % t;
    const u32 bb = g / (c * t);
    const u32 h = col / hs;
    const u32 i = col % hs;
    const float* a = att + ((bb * nh + h) * t + tq) * t;
    float s = 0.0f;
    for (u32 t2 = 0u; t2 <= tq; t2++) { s += a[t2] * qkv_at(qkv, t, c, hs, bb, t2, 2u, h, i); }
    out[g] = s;
}

// datt row (b, h, tq) = gradient of the pre-softmax scores: p * (dp - sum(p * dp)), dp = dout . v.
// datt [b, nh, t, t] (scratch), dout [b, t, c].
extern "C" __global__ void __launch_bounds__(WG) attention_backward(
    float* datt, const float* att, const float* qkv, const float* dout, u32 b, u32 t, u32 c, u32 nh) {
    const u32 row = flat_index();
    if (row >= b * nh * t) { return; }
    const u32 tq = row % t;
    const u32 h = (row / t) % nh;
    const u32 bb = row / (t * nh);
    const u32 hs = c / nh;
    const float* a = att + row * t;
    float* d = datt + row * t;
    const float* o = dout + (bb * t + tq) * c + h * hs;
    for (u32 t2 = 0u; t2 <= tq; t2++) {
        float dot = 0.0f;
        for (u32 i = 0u; i < hs; i++) { dot += o[i] * qkv_at(qkv, t, c, hs, bb, t2, 2u, h, i); }
        d[t2] = dot;
    }
    float s = 0.0f;
    for (u32 t2 = 0u; t2 <= tq; t2++) { s += a[t2] * d[t2]; }
    for (u32 t2 = 0u; t2 < t; t2++) { d[t2] = t2 <= tq ? a[t2] * (d[t2] - s) : 0.0f; }
}

// dq[b, tq, h, i] = sum over t2 <= tq (in order) of datt[b, h, tq, t2] / sqrt(hs) * k[b, t2, h, i].
// dqkv [b, t, 3c] (the q part written here).
extern "C" __global__ void __launch_bounds__(WG) attention_backward_dq(
    float* dqkv, const float* datt, const float* qkv, u32 b, u32 t, u32 c, u32 nh) {
    const u32 g = flat_index();
    if (g >= b * t * c) { return; }
    const u32 hs = c / nh;
    const u32 col = g % c;
    const u32 tq = (g / c) % t;
    const u32 bb = g / (c * t);
    const u32 h = col / hs;
    const u32 i = col % hs;
    const float sc = sqrtf((float)hs);
    const float* d = datt + ((bb * nh + h) * t + tq) * t;
    float s = 0.0f;
    for (u32 t2 = 0u; t2 <= tq; t2++) { s += (d[t2] / sc) * qkv_at(qkv, t, c, hs, bb, t2, 1u, h, i); }
    dqkv[(bb * t + tq) * 3u * c + col] = s;
}

// dk[b, t2, h, i] = sum over tq >= t2 of datt[b, h, tq, t2] / sqrt(hs) * q[b, tq, h, i];
// dv[b, t2, h, i] = sum over tq >= t2 of att[b, h, tq, t2] * dout[b, tq, h, i]; tq in increasing order.
// dqkv [b, t, 3c] (the k and v parts written here), dout [b, t, c].
extern "C" __global__ void __launch_bounds__(WG) attention_backward_dkv(
    float* dqkv, const float* datt, const float* att, const float* qkv, const float* dout, u32 b, u32 t, u32 c,
    u32 nh) {
    const u32 g = flat_index();
    if (g >= b * t * c) { return; }
    const u32 hs = c / nh;
    const u32 col = g % c;
    const u32 t2 = (g / c) % t;
    const u32 bb = g / (c * t);
    const u32 h = col / hs;
    const u32 i = col % hs;
    const float sc = sqrtf((float)hs);
    float sk = 0.0f;
    float sv = 0.0f;
    for (u32 tq = t2; tq < t; tq++) {
        const u32 a = ((bb * nh + h) * t + tq) * t + t2;
        sk += (datt[a] / sc) * qkv_at(qkv, t, c, hs, bb, tq, 0u, h, i);
        sv += att[a] * dout[(bb * t + tq) * c + col];
    }
    const u32 o = (bb * t + t2) * 3u * c;
    dqkv[o + c + col] = sk;
    dqkv[o + 2u * c + col] = sv;
}
