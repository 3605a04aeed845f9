// Element-wise ops: residual add, in-place add, scale; mirrors shaders/residual.wgsl (the scalar kernels:
// the vec4 ones of residual4.wgsl compute the same values). `fill` and `copy` need no kernel: they map to
// the driver's cuMemsetD32Async (any f32 bit pattern) and cuMemcpyDtoDAsync. One thread per element.

// out [n] = a [n] + b [n].
extern "C" __global__ void __launch_bounds__(WG) residual_forward(
    float* out, const float* a, const float* b, u32 n) {
    const u32 g = flat_index();
    if (g >= n) { return; }
    out[g] = a[g] + b[g];
}

// dst [n] += src [n].
extern "C" __global__ void __launch_bounds__(WG) add_inplace(float* dst, const float* src, u32 n) {
    const u32 g = flat_index();
    if (g >= n) { return; }
    dst[g] = dst[g] + src[g];
}

// x [n] *= s.
extern "C" __global__ void __launch_bounds__(WG) scale(float* x, float s, u32 n) {
    const u32 g = flat_index();
    if (g >= n) { return; }
    x[g] = x[g] * s;
}
