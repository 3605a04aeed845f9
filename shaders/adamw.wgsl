// torch.optim.AdamW (single-tensor path), element by element; the scalars come resolved from the host.

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
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> params: array<f32>;
@group(0) @binding(2) var<storage, read_write> grads: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<f32>;
@group(0) @binding(4) var<storage, read_write> v: array<f32>;

@compute @workgroup_size(256)
fn adamw(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32) {
    let i = flat_index(wg, nwg, li);
    if (i >= P.n) { return; }
    let g = grads[P.g_off + i] * P.grad_scale;
    var p = params[P.p_off + i] * (1.0 - P.lr * P.weight_decay);
    let mi = m[P.m_off + i];
    let mn = mi + (g - mi) * (1.0 - P.beta1);
    let vn = v[P.v_off + i] * P.beta2 + g * g * (1.0 - P.beta2);
    let denom = sqrt(vn) / P.bc2_sqrt + P.eps;
    p = p - P.step_size * (mn / denom);
    m[P.m_off + i] = mn;
    v[P.v_off + i] = vn;
    params[P.p_off + i] = p;
}
