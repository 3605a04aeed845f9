// The matmuls themselves go to cuBLAS (cublasSgemm with CUBLAS_DEFAULT_MATH / pedantic math, so no TF32);
// these kernels do what cuBLAS does not: the bias of the forward pass, added after the product exactly where
// shaders/matmul.wgsl's `store4` adds it, and the bias gradient, the fixed column tree of its
// `matmul_backward_bias`.

// out[r, j] += bias[j]: after cuBLAS wrote out = inp @ W (beta 0), this gives acc + bias, the value the WGSL
// kernel stores. out [n, oc], bias [oc]. Launch: ceil(n * oc / WG) blocks, one thread per element.
extern "C" __global__ void __launch_bounds__(WG) matmul_forward_bias(float* out, const float* bias, u32 n, u32 oc) {
    const u32 g = flat_index();
    if (g >= n * oc) { return; }
    out[g] = out[g] + bias[g % oc];
}

// dbias[j] += sum over rows of dout[row, j]. A block owns 16 columns and splits the rows among 16 lanes (lane
// l sums rows l, l + 16, ... in order), then adds the lanes by the fixed tree of `column_lanes_sum`.
// dbias [oc], dout [n, oc]. Launch: ceil(oc / 16) blocks.
extern "C" __global__ void __launch_bounds__(WG) matmul_backward_bias(
    float* dbias, const float* dout, u32 n, u32 oc) {
    __shared__ float red[WG];
    const u32 li = threadIdx.x;
    const u32 j = blockIdx.x * 16u + li % 16u;
    const u32 lane = li / 16u;
    float s = 0.0f;
    if (j < oc) {
        for (u32 row = lane; row < n; row += 16u) { s += dout[row * oc + j]; }
    }
    red[li] = s;
    column_lanes_sum(red);
    if (lane == 0u && j < oc) { dbias[j] = dbias[j] + red[li]; }
}
