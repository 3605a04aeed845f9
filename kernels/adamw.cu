// torch.optim.AdamW (single-tensor path), element by element; mirrors shaders/adamw.wgsl operation for
// operation. The scalars come resolved from the host (`AdamWStep`). One thread per element; one launch may
// cover many tensors, the weight decay applying inside the runs only.

// Whether element i lies inside a decay run of `runs` [s0, e0, s1, e1, ...] (n_bounds ascending offsets):
// an odd number of boundaries at or below it. Without runs (runs_given 0) everywhere.
__device__ __forceinline__ bool decays(const u32* runs, u32 n_bounds, u32 runs_given, u32 i) {
    if (runs_given == 0u) { return true; }
    u32 lo = 0u;
    u32 hi = n_bounds;
    while (lo < hi) {
        const u32 mid = (lo + hi) / 2u;
        if (runs[mid] <= i) { lo = mid + 1u; } else { hi = mid; }
    }
    return lo % 2u == 1u;
}

// params, grads, m, v: [n] each, equally long views; runs [n_bounds] (a token buffer; any address when
// runs_given is 0).
extern "C" __global__ void __launch_bounds__(WG) adamw(
    float* params, const float* grads, float* m, float* v, u32 n, float lr, float beta1, float beta2,
    float eps, float weight_decay, float step_size, float bc2_sqrt, float grad_scale, const u32* runs,
    u32 n_bounds, u32 runs_given) {
    const u32 i = flat_index();
    if (i >= n) { return; }
    const float g = grads[i] * grad_scale;
    const float wd = decays(runs, n_bounds, runs_given, i) ? weight_decay : 0.0f;
    float p = params[i] * (1.0f - lr * wd);
    const float mi = m[i];
    const float mn = mi + (g - mi) * (1.0f - beta1);
    const float vn = v[i] * beta2 + g * g * (1.0f - beta2);
    const float denom = sqrtf(vn) / bc2_sqrt + eps;
    p = p - step_size * (mn / denom);
    m[i] = mn;
    v[i] = vn;
    params[i] = p;
}
