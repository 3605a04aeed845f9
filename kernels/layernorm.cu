// Layer norm over the last axis (eps 1e-5); mirrors the tree kernels of shaders/layernorm.wgsl, the ones a
// hardware adapter runs (not the `_rows` / `_cols` kernels for software adapters): one block per row, thread
// li taking elements li, li + 256, ... in order, the threads added by the fixed tree of `block_sum`.

// Sum of the row's elements first, first + WG, ... in order.
__device__ float row_sum(const float* x, u32 c) {
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += WG) { s += x[i]; }
    return s;
}

__device__ float row_squared_deviation(const float* x, u32 c, float mu) {
    float s2 = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += WG) {
        const float d = x[i] - mu;
        s2 += d * d;
    }
    return s2;
}

// out [n, c], mean [n], rstd [n], inp [n, c], weight [c], bias [c]. Launch: n blocks.
extern "C" __global__ void __launch_bounds__(WG) layernorm_forward(
    float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias, u32 n,
    u32 c) {
    __shared__ float red[WG];
    const u32 row = blockIdx.x;
    if (row >= n) { return; }
    const float* x = inp + row * c;
    const float cf = (float)c;
    const float mu = block_sum(red, row_sum(x, c)) / cf;
    const float variance = block_sum(red, row_squared_deviation(x, c, mu)) / cf;
    const float r = 1.0f / sqrtf(variance + 1e-5f);
    for (u32 i = threadIdx.x; i < c; i += WG) {
        out[row * c + i] = (x[i] - mu) * r * weight[i] + bias[i];
    }
    if (threadIdx.x == 0u) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = weight * dout.
// dinp [n, c], mean [n], rstd [n], inp [n, c], weight [c], dout [n, c]. Launch: n blocks.
extern "C" __global__ void __launch_bounds__(WG) layernorm_backward(
    float* dinp, const float* mean, const float* rstd, const float* inp, const float* weight,
    const float* dout, u32 n, u32 c) {
    __shared__ float red[WG];
    const u32 row = blockIdx.x;
    if (row >= n) { return; }
    const float mu = mean[row];
    const float r = rstd[row];
    const float* x = inp + row * c;
    const float* d = dout + row * c;
    float sa = 0.0f;
    float sb = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += WG) {
        const float norm = (x[i] - mu) * r;
        const float dnorm = weight[i] * d[i];
        sa += dnorm;
        sb += dnorm * norm;
    }
    const float cf = (float)c;
    const float dnorm_mean = block_sum(red, sa) / cf;
    const float dnorm_norm_mean = block_sum(red, sb) / cf;
    for (u32 i = threadIdx.x; i < c; i += WG) {
        const float norm = (x[i] - mu) * r;
        const float dnorm = weight[i] * d[i];
        const u32 o = row * c + i;
        dinp[o] = dinp[o] + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
    }
}

// dweight[i] += sum over rows of norm * dout, dbias[i] += sum over rows of dout. A block owns 16 columns
// and splits the rows among 16 lanes (lane j sums rows j, j + 16, ... in order); the lanes are then added
// by the fixed tree of `column_lanes_sum`.
// dweight [c], dbias [c], mean [n], rstd [n], inp [n, c], dout [n, c]. Launch: ceil(c / 16) blocks.
extern "C" __global__ void __launch_bounds__(WG) layernorm_backward_params(
    float* dweight, float* dbias, const float* mean, const float* rstd, const float* inp, const float* dout,
    u32 n, u32 c) {
    __shared__ float red[WG];
    __shared__ float red2[WG];
    const u32 li = threadIdx.x;
    const u32 i = blockIdx.x * 16u + li % 16u;
    const u32 lane = li / 16u;
    float sw = 0.0f;
    float sb = 0.0f;
    if (i < c) {
        for (u32 row = lane; row < n; row += 16u) {
            const float norm = (inp[row * c + i] - mean[row]) * rstd[row];
            const float d = dout[row * c + i];
            sw += norm * d;
            sb += d;
        }
    }
    red[li] = sw;
    red2[li] = sb;
    column_lanes_sum(red);
    column_lanes_sum(red2);
    if (lane == 0u && i < c) {
        dweight[i] = dweight[i] + red[li];
        dbias[i] = dbias[i] + red2[li];
    }
}
