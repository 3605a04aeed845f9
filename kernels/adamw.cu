// torch.optim.AdamW (single-tensor path), element by element; mirrors shaders/adamw.wgsl operation for
// operation. The scalars come resolved from the host (`AdamWStep`). One thread per element.

// params, grads, m, v: [n] each, equally long views of one tensor.
extern "C" __global__ void __launch_bounds__(WG) adamw(
    float* params, const float* grads, float* m, float* v, u32 n, float lr, float beta1, float beta2,
    float eps, float weight_decay, float step_size, float bc2_sqrt, float grad_scale) {
    const u32 i = flat_index();
    if (i >= n) { return; }
    const float g = grads[i] * grad_scale;
    float p = params[i] * (1.0f - lr * weight_decay);
    const float mi = m[i];
    const float mn = mi + (g - mi) * (1.0f - beta1);
    const float vn = v[i] * beta2 + g * g * (1.0f - beta2);
    const float denom = sqrtf(vn) / bc2_sqrt + eps;
    p = p - step_size * (mn / denom);
    m[i] = mn;
    v[i] = vn;
    params[i] = p;
}
