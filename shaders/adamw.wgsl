// torch.optim.AdamW (single-tensor path), element by element; the scalars come resolved from the host. One
// dispatch may cover many tensors: the weight decay applies where `decays` says (a tensor that does not
// decay gets p * (1 - lr * 0) = p, the bits of a separate call without decay).

struct Params {
    n: u32,
    p_off: u32,
    g_off: u32,
    m_off: u32,
    v_off: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step_size: f32,
    bc2_sqrt: f32,
    grad_scale: f32,
    base: u32,       // offset of element 0 of this dispatch within the op's views (the runs' origin)
    runs_off: u32,
    n_bounds: u32,   // boundaries in runs: [s0, e0, s1, e1, ...], ascending
    runs_given: u32, // 0: the decay applies everywhere
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> grads: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;
@group(0) @binding(5) var<storage, read_write> runs: array<u32>;

// Whether element i of this dispatch lies inside a decay run: an odd number of boundaries at or below it.
fn decays(i: u32) -> bool {
    if (P.runs_given == 0u) { return true; }
    let x = P.base + i;
    var lo = 0u;
    var hi = P.n_bounds;
    while (lo < hi) {
        let mid = (lo + hi) / 2u;
        if (runs[P.runs_off + mid] <= x) { lo = mid + 1u; } else { hi = mid; }
    }
    return lo % 2u == 1u;
}

@compute @workgroup_size(256)
fn adamw(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i >= P.n) { return; }
    let g = grads[P.g_off + i] * P.grad_scale;
    let wd = select(0.0, P.weight_decay, decays(i));
    var p = params[P.p_off + i] * (1.0 - P.lr * wd);
    let mi = m[P.m_off + i];
    let mn = mi + (g - mi) * (1.0 - P.beta1);
    let vn = v[P.v_off + i] * P.beta2 + g * g * (1.0 - P.beta2);
    let denom = sqrt(vn) / P.bc2_sqrt + P.eps;
    p = p - P.step_size * (mn / denom);
    m[P.m_off + i] = mn;
    v[P.v_off + i] = vn;
    params[P.p_off + i] = p;
}
