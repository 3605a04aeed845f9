// Softmax cross-entropy, one workgroup per row with fixed reduction trees (max, then sum of exp), or (the
// `_rows` kernels, for software adapters) one invocation per row.

struct Params {
    n: u32,
    v: u32,
    out_off: u32,     // losses (forward) or dlogits == logits (backward, in place)
    logits_off: u32,
    tgt_off: u32,
    dloss: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> targets: array<u32>;

var<workgroup> red: array<f32, 256>;

fn reduce(li: u32, x: f32, is_max: bool) -> f32 {
    red[li] = x;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (li < s) {
            if (is_max) { red[li] = max(red[li], red[li + s]); } else { red[li] = red[li] + red[li + s]; }
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// The row loops, shared by both kernel families: entries first, first + step, ... of the row from `x0`, in
// that order; the tree kernels pass (li, WG), the row kernels (0, 1).
fn row_max(x0: u32, first: u32, step: u32) -> f32 {
    var m = -3.4028235e38;
    for (var j = first; j < P.v; j += step) { m = max(m, logits[x0 + j]); }
    return m;
}

fn row_sum_exp(x0: u32, first: u32, step: u32, mx: f32) -> f32 {
    var s = 0.0;
    for (var j = first; j < P.v; j += step) { s += exp(logits[x0 + j] - mx); }
    return s;
}

// In place: logits[x0 + j] = dloss * (softmax_j - [j == tgt]).
fn row_write_grad(x0: u32, first: u32, step: u32, lse: f32, tgt: u32) {
    for (var j = first; j < P.v; j += step) {
        let p = exp(logits[x0 + j] - lse);
        var ind = 0.0;
        if (j == tgt) { ind = 1.0; }
        logits[x0 + j] = P.dloss * (p - ind);
    }
}

// logsumexp of row `x0 .. x0 + v` of `logits`.
fn row_lse(li: u32, x0: u32) -> f32 {
    let mx = reduce(li, row_max(x0, li, WG), true);
    return mx + log(reduce(li, row_sum_exp(x0, li, WG, mx), false));
}

@compute @workgroup_size(256)
fn crossentropy_forward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) li: u32) {
    let row = group_index(wg, nwg);
    if (row >= P.n) { return; }
    let x0 = P.logits_off + row * P.v;
    let lse = row_lse(li, x0);
    if (li == 0u) {
        let tgt = min(targets[P.tgt_off + row], P.v - 1u);
        out[P.out_off + row] = lse - logits[x0 + tgt];
    }
}

// In place: logits[row, j] = dloss * (softmax_j - [j == target]). Binding 1 is unused.
@compute @workgroup_size(256)
fn crossentropy_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) li: u32) {
    let row = group_index(wg, nwg);
    if (row >= P.n) { return; }
    let x0 = P.logits_off + row * P.v;
    let lse = row_lse(li, x0);
    row_write_grad(x0, li, WG, lse, targets[P.tgt_off + row]);
}

// ---- One invocation per row, in index order: for software adapters, where the barriers of the tree
// reductions above cost more than the arithmetic (see the `_rows` kernels of layernorm.wgsl). ----

// logsumexp of row `x0 .. x0 + v` of `logits`, by one invocation.
fn row_lse_serial(x0: u32) -> f32 {
    let mx = row_max(x0, 0u, 1u);
    return mx + log(row_sum_exp(x0, 0u, 1u, mx));
}

@compute @workgroup_size(256)
fn crossentropy_forward_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                             @builtin(local_invocation_index) li: u32) {
    let row = flat_index(wg, nwg, li);
    if (row >= P.n) { return; }
    let x0 = P.logits_off + row * P.v;
    let tgt = min(targets[P.tgt_off + row], P.v - 1u);
    out[P.out_off + row] = row_lse_serial(x0) - logits[x0 + tgt];
}

@compute @workgroup_size(256)
fn crossentropy_backward_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_index) li: u32) {
    let row = flat_index(wg, nwg, li);
    if (row >= P.n) { return; }
    let x0 = P.logits_off + row * P.v;
    row_write_grad(x0, 0u, 1u, row_lse_serial(x0), targets[P.tgt_off + row]);
}
