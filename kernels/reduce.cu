// sum(x^2), first level of a fixed two-level tree; mirrors shaders/reduce.wgsl. One block per block of
// SUM_BLOCK = 4096 elements (the CPU backend's block) writes that block's sum: thread li sums elements li,
// li + 256, ... of the block in order, then the threads are added by the fixed tree of `block_sum`. The
// host adds the block sums in order, in f64.

#define SUM_BLOCK 4096u

// partial [ceil(n / SUM_BLOCK)], x [n]. Launch: ceil(n / SUM_BLOCK) blocks.
extern "C" __global__ void __launch_bounds__(WG) sum_squares(float* partial, const float* x, u32 n) {
    __shared__ float red[WG];
    const u32 blk = blockIdx.x;
    if (blk * SUM_BLOCK >= n) { return; }
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < SUM_BLOCK; j += WG) {
        const u32 i = blk * SUM_BLOCK + j;
        if (i < n) {
            const float v = x[i];
            s += v * v;
        }
    }
    const float total = block_sum(red, s);
    if (threadIdx.x == 0u) { partial[blk] = total; }
}
