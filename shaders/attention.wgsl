// Causal multi-head self-attention, qkv [b, t, 3c] = q | k | v, att [b, nh, t, t] softmax probabilities.
// Every output is owned by one invocation and sums its terms in a fixed order (no atomics).

struct Params {
    b: u32,
    t: u32,
    c: u32,
    nh: u32,
    out_off: u32,   // out (forward) or dqkv (backward)
    att_off: u32,
    qkv_off: u32,
    datt_off: u32,
    dout_off: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;   // out / dqkv
@group(0) @binding(2) var<storage, read_write> att: array<f32>;
@group(0) @binding(3) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(4) var<storage, read_write> datt: array<f32>;
@group(0) @binding(5) var<storage, read_write> dout: array<f32>;

fn hs() -> u32 { return P.c / P.nh; }

// sum over i < hs of dout[x0 + i] * v[b, t2, h, i], added in increasing i. Four terms per loop
// iteration: llvmpipe stops an invocation's loops after 65535 iterations in all, and a row of the
// probabilities at T = 1024 with 64-wide heads would need 65 K of them one term at a time.
fn head_dot_v(x0: u32, b: u32, t2: u32, h: u32) -> f32 {
    let n = hs();
    let n4 = n - n % 4u;
    var dot = 0.0;
    for (var i = 0u; i < n4; i += 4u) {
        dot += dout[x0 + i] * qkv_at(b, t2, 2u, h, i);
        dot += dout[x0 + i + 1u] * qkv_at(b, t2, 2u, h, i + 1u);
        dot += dout[x0 + i + 2u] * qkv_at(b, t2, 2u, h, i + 2u);
        dot += dout[x0 + i + 3u] * qkv_at(b, t2, 2u, h, i + 3u);
    }
    for (var i = n4; i < n; i++) { dot += dout[x0 + i] * qkv_at(b, t2, 2u, h, i); }
    return dot;
}

// sum over i < hs of q[b, tq, h, i] * k[b, t2, h, i], the same way.
fn head_dot_q(b: u32, tq: u32, t2: u32, h: u32) -> f32 {
    let n = hs();
    let n4 = n - n % 4u;
    var dot = 0.0;
    for (var i = 0u; i < n4; i += 4u) {
        dot += qkv_at(b, tq, 0u, h, i) * qkv_at(b, t2, 1u, h, i);
        dot += qkv_at(b, tq, 0u, h, i + 1u) * qkv_at(b, t2, 1u, h, i + 1u);
        dot += qkv_at(b, tq, 0u, h, i + 2u) * qkv_at(b, t2, 1u, h, i + 2u);
        dot += qkv_at(b, tq, 0u, h, i + 3u) * qkv_at(b, t2, 1u, h, i + 3u);
    }
    for (var i = n4; i < n; i++) { dot += qkv_at(b, tq, 0u, h, i) * qkv_at(b, t2, 1u, h, i); }
    return dot;
}

// Element i of head h of part (0 q, 1 k, 2 v) at position t of sequence b.
fn qkv_at(b: u32, t: u32, part: u32, h: u32, i: u32) -> f32 {
    return qkv[P.qkv_off + (b * P.t + t) * 3u * P.c + part * P.c + h * hs() + i];
}

// One (b, h, tq) row of probabilities per invocation.
@compute @workgroup_size(256)
fn attention_forward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) li: u32) {
    let row = flat_index(wg, nwg, li);
    if (row >= P.b * P.nh * P.t) { return; }
    let tq = row % P.t;
    let h = (row / P.t) % P.nh;
    let b = row / (P.t * P.nh);
    let n = hs();
    let scale = sqrt(f32(n));
    let a0 = P.att_off + row * P.t;
    var mx = -3.4028235e38;
    for (var t2 = 0u; t2 <= tq; t2++) {
        let dot = head_dot_q(b, tq, t2, h) / scale;
        att[a0 + t2] = dot;
        mx = max(mx, dot);
    }
    var sum = 0.0;
    for (var t2 = 0u; t2 <= tq; t2++) {
        let e = exp(att[a0 + t2] - mx);
        att[a0 + t2] = e;
        sum += e;
    }
    let inv = 1.0 / sum;
    for (var t2 = 0u; t2 < P.t; t2++) {
        if (t2 <= tq) { att[a0 + t2] = att[a0 + t2] * inv; } else { att[a0 + t2] = 0.0; }
    }
}

// out[b, tq, h*hs + i] = sum over t2 <= tq (in order) of att[b, h, tq, t2] * v[b, t2, h, i].
@compute @workgroup_size(256)
fn attention_forward_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.b * P.t * P.c) { return; }
    let col = g % P.c;
    let tq = (g / P.c) % P.t;
    let b = g / (P.c * P.t);
    let h = col / hs();
    let i = col % hs();
    let a0 = P.att_off + ((b * P.nh + h) * P.t + tq) * P.t;
    var s = 0.0;
    for (var t2 = 0u; t2 <= tq; t2++) { s += att[a0 + t2] * qkv_at(b, t2, 2u, h, i); }
    out[P.out_off + g] = s;
}

// datt row (b, h, tq) = gradient of the pre-softmax scores: p * (dp - sum(p * dp)), dp = dout . v.
@compute @workgroup_size(256)
fn attention_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) li: u32) {
    let row = flat_index(wg, nwg, li);
    if (row >= P.b * P.nh * P.t) { return; }
    let tq = row % P.t;
    let h = (row / P.t) % P.nh;
    let b = row / (P.t * P.nh);
    let n = hs();
    let a0 = P.att_off + row * P.t;
    let d0 = P.datt_off + row * P.t;
    let o0 = P.dout_off + (b * P.t + tq) * P.c + h * n;
    for (var t2 = 0u; t2 <= tq; t2++) {
        datt[d0 + t2] = head_dot_v(o0, b, t2, h);
    }
    var s = 0.0;
    for (var t2 = 0u; t2 <= tq; t2++) { s += att[a0 + t2] * datt[d0 + t2]; }
    for (var t2 = 0u; t2 < P.t; t2++) {
        if (t2 <= tq) { datt[d0 + t2] = att[a0 + t2] * (datt[d0 + t2] - s); } else { datt[d0 + t2] = 0.0; }
    }
}

// dq[b, tq, h, i] = sum over t2 <= tq of datt[b, h, tq, t2] / sqrt(hs) * k[b, t2, h, i].
@compute @workgroup_size(256)
fn attention_backward_dq(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.b * P.t * P.c) { return; }
    let col = g % P.c;
    let tq = (g / P.c) % P.t;
    let b = g / (P.c * P.t);
    let h = col / hs();
    let i = col % hs();
    let scale = sqrt(f32(hs()));
    let d0 = P.datt_off + ((b * P.nh + h) * P.t + tq) * P.t;
    var s = 0.0;
    for (var t2 = 0u; t2 <= tq; t2++) { s += (datt[d0 + t2] / scale) * qkv_at(b, t2, 1u, h, i); }
    out[P.out_off + (b * P.t + tq) * 3u * P.c + col] = s;
}

// dk[b, t2, h, i] = sum over tq >= t2 of datt[b, h, tq, t2] / sqrt(hs) * q[b, tq, h, i];
// dv[b, t2, h, i] = sum over tq >= t2 of att[b, h, tq, t2] * dout[b, tq, h, i]; tq in increasing order.
@compute @workgroup_size(256)
fn attention_backward_dkv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.b * P.t * P.c) { return; }
    let col = g % P.c;
    let t2 = (g / P.c) % P.t;
    let b = g / (P.c * P.t);
    let h = col / hs();
    let i = col % hs();
    let scale = sqrt(f32(hs()));
    var sk = 0.0;
    var sv = 0.0;
    for (var tq = t2; tq < P.t; tq++) {
        let a = ((b * P.nh + h) * P.t + tq) * P.t + t2;
        sk += (datt[P.datt_off + a] / scale) * qkv_at(b, tq, 0u, h, i);
        sv += att[P.att_off + a] * dout[P.dout_off + (b * P.t + tq) * P.c + col];
    }
    let o = P.out_off + (b * P.t + t2) * 3u * P.c;
    out[o + P.c + col] = sk;
    out[o + 2u * P.c + col] = sv;
}
