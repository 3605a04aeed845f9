// Token + position embedding, forward and backward (deterministic: no atomics, fixed summation order).

struct Params {
    n: u32,        // forward: b*t rows; wpe backward: b; wte backward: number of distinct tokens
    t: u32,
    c: u32,
    dst_off: u32,
    src0_off: u32,
    src1_off: u32,
    idx_off: u32,
    v0: u32,       // first vocabulary row held by the bound wte window
    v1: u32,       // one past the last one
}

@group(0) @binding(0) var<uniform> P: Params;
// forward: out [b*t, c]; backward: dwte window or dwpe
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
// forward: wte window [v1-v0, c]; backward: dout [b*t, c]
@group(0) @binding(2) var<storage, read_write> src0: array<f32>;
// forward: wpe [>=t, c]
@group(0) @binding(3) var<storage, read_write> src1: array<f32>;
// forward: tokens [b*t]; wte backward: [rows(U) | starts(U+1) | positions] built from the host's token copy
@group(0) @binding(4) var<storage, read_write> idx: array<u32>;

@compute @workgroup_size(256)
fn encoder_forward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n * P.c) { return; }
    let bt = g / P.c;
    let i = g % P.c;
    let tok = idx[P.idx_off + bt];
    if (tok < P.v0 || tok >= P.v1) { return; }
    let pos = bt % P.t;
    dst[P.dst_off + g] = src0[P.src0_off + (tok - P.v0) * P.c + i] + src1[P.src1_off + pos * P.c + i];
}

// dwpe[t, i] += sum over b (in order) of dout[b, t, i]; one invocation per (t, i).
@compute @workgroup_size(256)
fn encoder_backward_wpe(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.t * P.c) { return; }
    let pos = g / P.c;
    let i = g % P.c;
    var acc = dst[P.dst_off + g];
    for (var b = 0u; b < P.n; b++) {
        acc += src0[P.src0_off + (b * P.t + pos) * P.c + i];
    }
    dst[P.dst_off + g] = acc;
}

// dwte[row, i] += dout[pos, i] for every position holding token `row`, positions in (b, t) order;
// one invocation per (distinct token, channel).
@compute @workgroup_size(256)
fn encoder_backward_wte(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n * P.c) { return; }
    let u = g / P.c;
    let i = g % P.c;
    let row = idx[P.idx_off + u];
    if (row < P.v0 || row >= P.v1) { return; }
    let start = idx[P.idx_off + P.n + u];
    let end = idx[P.idx_off + P.n + u + 1u];
    let pos_base = P.idx_off + 2u * P.n + 1u;
    let d = P.dst_off + (row - P.v0) * P.c + i;
    var acc = dst[d];
    for (var j = start; j < end; j++) {
        acc += src0[P.src0_off + idx[pos_base + j] * P.c + i];
    }
    dst[d] = acc;
}
