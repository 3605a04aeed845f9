// GELU, tanh approximation (gelu_new); mirrors shaders/gelu.wgsl, including the clamp of the tanh argument
// to +-15 (where tanh is +-1 in f32) and its order of operations. One thread per element.

// sqrt(2 / pi), rounded from the double literal once, as WGSL rounds its abstract-float constant.
#define GELU_K ((float)0.7978845608028654)

// out [n] = gelu(inp [n]).
extern "C" __global__ void __launch_bounds__(WG) gelu_forward(float* out, const float* inp, u32 n) {
    const u32 g = flat_index();
    if (g >= n) { return; }
    const float x = inp[g];
    const float cube = 0.044715f * x * x * x;
    const float arg = fminf(fmaxf(GELU_K * (x + cube), -15.0f), 15.0f);
    out[g] = 0.5f * x * (1.0f + tanhf(arg));
}

// dinp [n] = gelu'(inp [n]) * dout [n] (overwrites dinp).
extern "C" __global__ void __launch_bounds__(WG) gelu_backward(
    float* dinp, const float* inp, const float* dout, u32 n) {
    const u32 g = flat_index();
    if (g >= n) { return; }
    const float x = inp[g];
    const float cube = 0.044715f * x * x * x;
    const float arg = fminf(fmaxf(GELU_K * (x + cube), -15.0f), 15.0f);
    const float th = tanhf(arg);
    const float ch = coshf(arg);
    const float sech2 = 1.0f / (ch * ch);
    // (float)(3.0 * 0.044715): WGSL folds `3.0 * 0.044715` as an abstract float before rounding to f32.
    const float local =
        0.5f * (1.0f + th) + x * 0.5f * sech2 * GELU_K * (1.0f + (float)(3.0 * 0.044715) * x * x);
    dinp[g] = local * dout[g];
}
