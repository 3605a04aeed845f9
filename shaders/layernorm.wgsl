// Layer norm over the last axis (eps 1e-5): one workgroup per row with a fixed reduction tree, or (the
// `_rows` kernels, for software adapters) one invocation per row.

struct Params {
    n: u32,
    c: u32,
    out_off: u32,   // out (forward) or dinp (backward)
    mean_off: u32,
    rstd_off: u32,
    inp_off: u32,
    w_off: u32,
    b_off: u32,     // bias (forward) or dbias (backward)
    dout_off: u32,
    dw_off: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;    // out / dinp
@group(0) @binding(2) var<storage, read_write> mean: array<f32>;
@group(0) @binding(3) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(4) var<storage, read_write> inp: array<f32>;
@group(0) @binding(5) var<storage, read_write> weight: array<f32>;
@group(0) @binding(6) var<storage, read_write> bias: array<f32>;   // bias / dbias
@group(0) @binding(7) var<storage, read_write> dout: array<f32>;
@group(0) @binding(8) var<storage, read_write> dweight: array<f32>;

var<workgroup> red: array<f32, 256>;

fn reduce_sum(li: u32, x: f32) -> f32 {
    red[li] = x;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (li < s) { red[li] = red[li] + red[li + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// The row loops, shared by both kernel families: elements first, first + step, ... of one row, each
// sum in that order. The tree kernels pass (li, WG) and add the lanes' partial sums by `reduce_sum`; the
// row kernels pass (0, 1).
fn row_sum(x0: u32, first: u32, step: u32) -> f32 {
    var s = 0.0;
    for (var i = first; i < P.c; i += step) { s += inp[x0 + i]; }
    return s;
}

fn row_squared_deviation(x0: u32, first: u32, step: u32, mu: f32) -> f32 {
    var s2 = 0.0;
    for (var i = first; i < P.c; i += step) { let d = inp[x0 + i] - mu; s2 += d * d; }
    return s2;
}

fn row_normalize(row: u32, first: u32, step: u32, mu: f32, r: f32) {
    let x0 = P.inp_off + row * P.c;
    for (var i = first; i < P.c; i += step) {
        out[P.out_off + row * P.c + i] = (inp[x0 + i] - mu) * r * weight[P.w_off + i] + bias[P.b_off + i];
    }
}

// (sum of dnorm, sum of dnorm * norm), dnorm = weight * dout.
fn row_grad_sums(row: u32, first: u32, step: u32, mu: f32, r: f32) -> vec2<f32> {
    let x0 = P.inp_off + row * P.c;
    let d0 = P.dout_off + row * P.c;
    var sa = 0.0;
    var sb = 0.0;
    for (var i = first; i < P.c; i += step) {
        let norm = (inp[x0 + i] - mu) * r;
        let dnorm = weight[P.w_off + i] * dout[d0 + i];
        sa += dnorm;
        sb += dnorm * norm;
    }
    return vec2<f32>(sa, sb);
}

// dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd.
fn row_grad_apply(row: u32, first: u32, step: u32, mu: f32, r: f32, dnorm_mean: f32, dnorm_norm_mean: f32) {
    let x0 = P.inp_off + row * P.c;
    let d0 = P.dout_off + row * P.c;
    for (var i = first; i < P.c; i += step) {
        let norm = (inp[x0 + i] - mu) * r;
        let dnorm = weight[P.w_off + i] * dout[d0 + i];
        let o = P.out_off + row * P.c + i;
        out[o] = out[o] + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
    }
}

@compute @workgroup_size(256)
fn layernorm_forward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) li: u32) {
    let row = group_index(wg, nwg);
    if (row >= P.n) { return; }
    let x0 = P.inp_off + row * P.c;
    let cf = f32(P.c);
    let mu = reduce_sum(li, row_sum(x0, li, WG)) / cf;
    let variance = reduce_sum(li, row_squared_deviation(x0, li, WG, mu)) / cf;
    let r = 1.0 / sqrt(variance + 1e-5);
    row_normalize(row, li, WG, mu, r);
    if (li == 0u) {
        mean[P.mean_off + row] = mu;
        rstd[P.rstd_off + row] = r;
    }
}

// dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, one workgroup per row.
@compute @workgroup_size(256)
fn layernorm_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) li: u32) {
    let row = group_index(wg, nwg);
    if (row >= P.n) { return; }
    let mu = mean[P.mean_off + row];
    let r = rstd[P.rstd_off + row];
    let sums = row_grad_sums(row, li, WG, mu, r);
    let cf = f32(P.c);
    let dnorm_mean = reduce_sum(li, sums.x) / cf;
    let dnorm_norm_mean = reduce_sum(li, sums.y) / cf;
    row_grad_apply(row, li, WG, mu, r, dnorm_mean, dnorm_norm_mean);
}

// dweight[i] += sum over rows of norm * dout, dbias[i] += sum over rows of dout. A workgroup owns 16 columns
// and splits the rows among 16 lanes (lane j sums rows j, j + 16, ... in order); the lanes are then added
// by a fixed tree.
var<workgroup> red2: array<f32, 256>;

@compute @workgroup_size(256)
fn layernorm_backward_params(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                             @builtin(local_invocation_index) li: u32) {
    let i = group_index(wg, nwg) * 16u + li % 16u;
    let lane = li / 16u;
    var sw = 0.0;
    var sb = 0.0;
    if (i < P.c) {
        for (var row = lane; row < P.n; row += 16u) {
            let norm = (inp[P.inp_off + row * P.c + i] - mean[P.mean_off + row]) * rstd[P.rstd_off + row];
            let d = dout[P.dout_off + row * P.c + i];
            sw += norm * d;
            sb += d;
        }
    }
    red[li] = sw;
    red2[li] = sb;
    workgroupBarrier();
    for (var s = 8u; s > 0u; s = s >> 1u) {
        if (lane < s) {
            red[li] = red[li] + red[li + s * 16u];
            red2[li] = red2[li] + red2[li + s * 16u];
        }
        workgroupBarrier();
    }
    if (lane == 0u && i < P.c) {
        dweight[P.dw_off + i] = dweight[P.dw_off + i] + red[li];
        bias[P.b_off + i] = bias[P.b_off + i] + red2[li];
    }
}

// ---- One invocation per row (per column for the parameter gradients), sums in index order. ----
// For software adapters: on llvmpipe a workgroup barrier switches between all of the workgroup's
// subgroups, and the tree kernels above pass 9 barriers per reduction, which made a tiny model's layer
// norm cost more than its matmuls (bench/wgpu/RESULTS.md). These kernels need no workgroup memory and no
// barrier; a lane owns a whole row, which is what a CPU's SIMD lanes do well.

@compute @workgroup_size(256)
fn layernorm_forward_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_index) li: u32) {
    let row = flat_index(wg, nwg, li);
    if (row >= P.n) { return; }
    let x0 = P.inp_off + row * P.c;
    let cf = f32(P.c);
    let mu = row_sum(x0, 0u, 1u) / cf;
    let r = 1.0 / sqrt(row_squared_deviation(x0, 0u, 1u, mu) / cf + 1e-5);
    row_normalize(row, 0u, 1u, mu, r);
    mean[P.mean_off + row] = mu;
    rstd[P.rstd_off + row] = r;
}

@compute @workgroup_size(256)
fn layernorm_backward_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) li: u32) {
    let row = flat_index(wg, nwg, li);
    if (row >= P.n) { return; }
    let mu = mean[P.mean_off + row];
    let r = rstd[P.rstd_off + row];
    let sums = row_grad_sums(row, 0u, 1u, mu, r);
    let cf = f32(P.c);
    row_grad_apply(row, 0u, 1u, mu, r, sums.x / cf, sums.y / cf);
}

// dweight[i] += sum over rows of norm * dout, dbias[i] += sum over rows of dout: one invocation per column,
// rows in order.
@compute @workgroup_size(256)
fn layernorm_backward_params_cols(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                                  @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i >= P.c) { return; }
    var sw = 0.0;
    var sb = 0.0;
    for (var row = 0u; row < P.n; row++) {
        let norm = (inp[P.inp_off + row * P.c + i] - mean[P.mean_off + row]) * rstd[P.rstd_off + row];
        let d = dout[P.dout_off + row * P.c + i];
        sw += norm * d;
        sb += d;
    }
    dweight[P.dw_off + i] = dweight[P.dw_off + i] + sw;
    bias[P.b_off + i] = bias[P.b_off + i] + sb;
}
