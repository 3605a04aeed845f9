// Token + position embedding, forward and backward; mirrors shaders/encoder.wgsl (no atomics, every output
// sums its terms in a fixed order). Launch: 1-D grids of WG-thread blocks, one thread per output element.

// out[bt, i] = wte[tokens[bt], i] + wpe[bt % t, i].
// out [n, c] with n = b * t, tokens [n], wte [v, c], wpe [>= t, c]. A token >= v leaves its row untouched
// (the host checks tokens against the vocabulary before upload).
extern "C" __global__ void __launch_bounds__(WG) encoder_forward(
    float* out, const u32* tokens, const float* wte, const float* wpe, u32 n, u32 t, u32 c, u32 v) {
    const u32 g = flat_index();
    if (g >= n * c) { return; }
    const u32 bt = g / c;
    const u32 i = g % c;
    const u32 tok = tokens[bt];
    if (tok >= v) { return; }
    const u32 pos = bt % t;
    out[g] = wte[tok * c + i] + wpe[pos * c + i];
}

// dwpe[pos, i] += sum over sequences s = 0, 1, ..., b - 1 (in order) of dout[s * t + pos, i]; one thread per
// (pos, i). dwpe [>= t, c], dout [b * t, c].
extern "C" __global__ void __launch_bounds__(WG) encoder_backward_wpe(
    float* dwpe, const float* dout, u32 b, u32 t, u32 c) {
    const u32 g = flat_index();
    if (g >= t * c) { return; }
    const u32 pos = g / c;
    const u32 i = g % c;
    float acc = dwpe[g];
    for (u32 s = 0u; s < b; s++) { acc += dout[(s * t + pos) * c + i]; }
    dwpe[g] = acc;
}

// dwte[rows[u], i] += dout[p, i] for every position p holding token rows[u], positions in (b, t) order; one
// thread per (distinct token, channel), so no two threads write one element. The index comes from the
// host's copy of the tokens, as for the WGSL kernel: rows [u] the distinct tokens, starts [u + 1] where each
// one's positions begin in positions [b * t] (positions grouped by token, increasing within a group).
// dwte [v, c], dout [b * t, c]. A row >= v is skipped (the host checks tokens before upload).
extern "C" __global__ void __launch_bounds__(WG) encoder_backward_wte(
    float* dwte, const float* dout, const u32* rows, const u32* starts, const u32* positions, u32 u, u32 c,
    u32 v) {
    const u32 g = flat_index();
    if (g >= u * c) { return; }
    const u32 k = g / c;
    const u32 i = g % c;
    const u32 row = rows[k];
    if (row >= v) { return; }
    const u32 end = starts[k + 1u];
    float acc = dwte[row * c + i];
    for (u32 j = starts[k]; j < end; j++) { acc += dout[positions[j] * c + i]; }
    dwte[row * c + i] = acc;
}
