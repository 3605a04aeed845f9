// Shared helpers, prepended to every op family's source before NVRTC compiles it (as shaders/common.wgsl is
// for the WGSL families), followed by a `#line 1 "<family>.cu"` so that messages name the family's own lines.
// Only builtins: NVRTC compiles these without the CUDA toolkit's headers.
//
// Every kernel runs WG = 256 threads per block on a 1-D grid (CUDA allows 2^31 - 1 blocks along x, so no
// 2-D grid is needed as it is for WebGPU's 65535 limit). Indices are 32-bit, as in the WGSL kernels: the
// host checks that every buffer the kernels index holds fewer than 2^32 elements.

#define WG 256u

typedef unsigned int u32;

// Largest finite f32: the starting value of every running maximum (the WGSL kernels' -3.4028235e38).
#define NEG_F32_MAX (-3.40282347e38f)

// Flat thread index for 1-D kernels.
__device__ __forceinline__ u32 flat_index() { return blockIdx.x * WG + threadIdx.x; }

// The sum of every thread's `x` by a fixed tree (strides 128, 64, ..., 1), the tree of `reduce_sum` in
// shaders/layernorm.wgsl; every thread gets the result, and `red` may be reused as soon as this returns.
// Every thread of the block must call it.
__device__ float block_sum(float* red, float x) {
    const u32 li = threadIdx.x;
    red[li] = x;
    __syncthreads();
    for (u32 s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) { red[li] = red[li] + red[li + s]; }
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

// `block_sum` with max for the sum.
__device__ float block_max(float* red, float x) {
    const u32 li = threadIdx.x;
    red[li] = x;
    __syncthreads();
    for (u32 s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) { red[li] = fmaxf(red[li], red[li + s]); }
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}

// Adds the 16 lanes of each of a block's 16 columns by a fixed tree (lane strides 8, 4, 2, 1), thread `li`
// holding lane li / 16 of column li % 16: the column trees of shaders/matmul.wgsl's `matmul_backward_bias`
// and shaders/layernorm.wgsl's `layernorm_backward_params`. Afterwards lane 0's slot holds the column sum.
__device__ void column_lanes_sum(float* red) {
    const u32 li = threadIdx.x;
    const u32 lane = li / 16u;
    __syncthreads();
    for (u32 s = 8u; s > 0u; s >>= 1u) {
        if (lane < s) { red[li] = red[li] + red[li + s * 16u]; }
        __syncthreads();
    }
}
