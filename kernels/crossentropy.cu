// Softmax cross-entropy; mirrors the tree kernels of shaders/crossentropy.wgsl, the ones a hardware adapter
// runs (not the `_rows` kernels for software adapters): one block per row, thread li taking entries li,
// li + 256, ... in order, the threads combined by the fixed trees of `block_max` and `block_sum`.

// logsumexp of the row `x [v]`; every thread of the block must call it.
__device__ float row_lse(float* red, const float* x, u32 v) {
    float m = NEG_F32_MAX;
    for (u32 j = threadIdx.x; j < v; j += WG) { m = fmaxf(m, x[j]); }
    const float mx = block_max(red, m);
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < v; j += WG) { s += expf(x[j] - mx); }
    return mx + logf(block_sum(red, s));
}

// losses[row] = logsumexp(logits[row, :]) - logits[row, min(targets[row], v - 1)].
// losses [n], logits [n, v], targets [n]. Launch: n blocks.
extern "C" __global__ void __launch_bounds__(WG) crossentropy_forward(
    float* losses, const float* logits, const u32* targets, u32 n, u32 v) {
    __shared__ float red[WG];
    const u32 row = blockIdx.x;
    if (row >= n) { return; }
    const float* x = logits + row * v;
    const float lse = row_lse(red, x, v);
    if (threadIdx.x == 0u) {
        const u32 tgt = min(targets[row], v - 1u);
        losses[row] = lse - x[tgt];
    }
}

// In place: logits[row, j] = dloss * (softmax_j - [j == targets[row]]).
// logits [n, v], targets [n]. Launch: n blocks.
extern "C" __global__ void __launch_bounds__(WG) crossentropy_backward(
    float* logits, const u32* targets, u32 n, u32 v, float dloss) {
    __shared__ float red[WG];
    const u32 row = blockIdx.x;
    if (row >= n) { return; }
    float* x = logits + row * v;
    // Every thread reads the whole row for the logsumexp before any writes its own entries.
    const float lse = row_lse(red, x, v);
    const u32 tgt = targets[row];
    for (u32 j = threadIdx.x; j < v; j += WG) {
        const float p = expf(x[j] - lse);
        const float ind = j == tgt ? 1.0f : 0.0f;
        x[j] = dloss * (p - ind);
    }
}
