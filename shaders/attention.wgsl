// Causal multi-head self-attention without the [t, t] matrices (flash-style), qkv [b, t, 3c] = q | k | v,
// heads hs = c / nh wide, hs <= HS (the host refuses wider heads).
//
// Forward: a workgroup of ROWS invocations owns ROWS query rows of one (b, h); it walks the key tiles of
// TILE keys up to its last row (tiles above the diagonal are skipped), staging each tile's k and v in
// workgroup memory, and keeps an online softmax per row: the running maximum m, the running sum l and the
// unnormalised output. It writes out = acc / l and each row's log-sum-exp lse = m + log(l) [b, nh, t].
// Backward recomputes the probabilities tile by tile from lse: `attention_backward_delta` writes each
// row's delta = dout . out [b, nh, t]; `attention_backward_dq` (a query row per invocation, key tiles),
// `attention_backward_dk` and `attention_backward_dv` (a key row per invocation, query tiles) each own
// their outputs and add their terms in increasing key or query order: no atomics, the same bits every run.
//
// Each invocation keeps its row's head vectors in private arrays of HS / 4 vec4s, zero past hs, so every
// loop has a fixed trip count and the zeros add nothing. Rows past t run the loops (barriers are
// workgroup-wide) and write nothing. Loops step two vec4s at a time: llvmpipe stops an invocation's loops
// after 65535 iterations in all (see loop_budget.rs).

const ROWS: u32 = 64u;  // invocations per workgroup: query rows (forward, dq) or key rows (dk, dv)
const TILE: u32 = 32u;  // rows of k and v (or q and dout) staged per tile
const HS: u32 = 64u;    // widest head
const HV: u32 = 16u;    // HS / 4

struct Params {
    b: u32,
    t: u32,
    c: u32,
    nh: u32,
    out_off: u32,   // out (forward) or dqkv (backward) [b, t, 3c]
    lse_off: u32,   // [b, nh, t]
    qkv_off: u32,
    delta_off: u32, // [b, nh, t]
    dout_off: u32,  // [b, t, c]
    fout_off: u32,  // the forward's out [b, t, c] (delta only)
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;   // out / dqkv
@group(0) @binding(2) var<storage, read_write> lse: array<f32>;
@group(0) @binding(3) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(4) var<storage, read_write> delta: array<f32>;
@group(0) @binding(5) var<storage, read_write> dout: array<f32>;
@group(0) @binding(6) var<storage, read_write> fout: array<f32>;

// Two tiles of TILE rows x HS: k and v (forward, dq) or q and dout (dk, dv). 2 x 8 KiB, within WebGPU's
// 16 KiB default.
var<workgroup> tile_a: array<vec4<f32>, 512>;  // [TILE, HV]
var<workgroup> tile_b: array<vec4<f32>, 512>;  // [TILE, HV]

fn hs() -> u32 { return P.c / P.nh; }

// Index of element i of head h of part (0 q, 1 k, 2 v) at position tp of sequence b.
fn qkv_index(b: u32, tp: u32, part: u32, h: u32, i: u32) -> u32 {
    return P.qkv_off + (b * P.t + tp) * 3u * P.c + part * P.c + h * hs() + i;
}

// Elements i0 .. i0 + 3 of the head row at `base` of qkv, 0 past hs and where `live` is false (rows past
// t).
fn qkv4(base: u32, i0: u32, live: bool) -> vec4<f32> {
    let n = select(0u, hs(), live);
    var r = vec4<f32>(0.0);
    if (i0 < n) { r.x = qkv[base + i0]; }
    if (i0 + 1u < n) { r.y = qkv[base + i0 + 1u]; }
    if (i0 + 2u < n) { r.z = qkv[base + i0 + 2u]; }
    if (i0 + 3u < n) { r.w = qkv[base + i0 + 3u]; }
    return r;
}

// `qkv4` of dout.
fn dout4(base: u32, i0: u32, live: bool) -> vec4<f32> {
    let n = select(0u, hs(), live);
    var r = vec4<f32>(0.0);
    if (i0 < n) { r.x = dout[base + i0]; }
    if (i0 + 1u < n) { r.y = dout[base + i0 + 1u]; }
    if (i0 + 2u < n) { r.z = dout[base + i0 + 2u]; }
    if (i0 + 3u < n) { r.w = dout[base + i0 + 3u]; }
    return r;
}

// Index of row tp of head h of dout [b, t, c].
fn dout_index(b: u32, tp: u32, h: u32) -> u32 {
    return P.dout_off + (b * P.t + tp) * P.c + h * hs();
}

// Stages rows r0 .. r0 + TILE of (b, h): k into tile_a, v into tile_b; rows past t are zeros. Every
// invocation of the workgroup must call it.
fn stage_kv(b: u32, h: u32, r0: u32, li: u32) {
    workgroupBarrier();
    for (var e = li; e < TILE * HV; e += ROWS) {
        let row = r0 + e / HV;
        let rr = min(row, P.t - 1u);
        tile_a[e] = qkv4(qkv_index(b, rr, 1u, h, 0u), (e % HV) * 4u, row < P.t);
        tile_b[e] = qkv4(qkv_index(b, rr, 2u, h, 0u), (e % HV) * 4u, row < P.t);
    }
    workgroupBarrier();
}

// `stage_kv` of q (tile_a) and dout (tile_b).
fn stage_qd(b: u32, h: u32, r0: u32, li: u32) {
    workgroupBarrier();
    for (var e = li; e < TILE * HV; e += ROWS) {
        let row = r0 + e / HV;
        let rr = min(row, P.t - 1u);
        tile_a[e] = qkv4(qkv_index(b, rr, 0u, h, 0u), (e % HV) * 4u, row < P.t);
        tile_b[e] = dout4(dout_index(b, rr, h), (e % HV) * 4u, row < P.t);
    }
    workgroupBarrier();
}

// x . y over HS, terms added in increasing index, each product rounded.
fn dot_row(x: ptr<function, array<vec4<f32>, 16>>, tile: u32, row: u32) -> f32 {
    var s = 0.0;
    for (var j = 0u; j < HV; j += 2u) {
        var y0: vec4<f32>;
        var y1: vec4<f32>;
        if (tile == 0u) { y0 = tile_a[row * HV + j]; y1 = tile_a[row * HV + j + 1u]; }
        else { y0 = tile_b[row * HV + j]; y1 = tile_b[row * HV + j + 1u]; }
        let x0 = (*x)[j];
        let x1 = (*x)[j + 1u];
        s += x0.x * y0.x; s += x0.y * y0.y; s += x0.z * y0.z; s += x0.w * y0.w;
        s += x1.x * y1.x; s += x1.y * y1.y; s += x1.z * y1.z; s += x1.w * y1.w;
    }
    return s;
}

// acc += w * (row of a tile).
fn axpy_row(acc: ptr<function, array<vec4<f32>, 16>>, w: f32, tile: u32, row: u32) {
    for (var j = 0u; j < HV; j += 2u) {
        if (tile == 0u) {
            (*acc)[j] += w * tile_a[row * HV + j];
            (*acc)[j + 1u] += w * tile_a[row * HV + j + 1u];
        } else {
            (*acc)[j] += w * tile_b[row * HV + j];
            (*acc)[j + 1u] += w * tile_b[row * HV + j + 1u];
        }
    }
}

// Loads the head row at `base` of qkv into x, zero past hs.
fn load_qkv_row(x: ptr<function, array<vec4<f32>, 16>>, base: u32, live: bool) {
    for (var j = 0u; j < HV; j++) { (*x)[j] = qkv4(base, j * 4u, live); }
}

// `load_qkv_row` of dout.
fn load_dout_row(x: ptr<function, array<vec4<f32>, 16>>, base: u32, live: bool) {
    for (var j = 0u; j < HV; j++) { (*x)[j] = dout4(base, j * 4u, live); }
}

// Writes x (hs elements) at `base` of out.
fn store_row(x: ptr<function, array<vec4<f32>, 16>>, base: u32) {
    let n = hs();
    for (var i = 0u; i < n; i++) { out[base + i] = (*x)[i / 4u][i % 4u]; }
}

// (b, h, first row) of this workgroup: the rows of one (b, h) in ROWS-row blocks.
fn block_of(g: u32) -> vec3<u32> {
    let blocks = (P.t + ROWS - 1u) / ROWS;
    return vec3<u32>(g / (blocks * P.nh), (g / blocks) % P.nh, (g % blocks) * ROWS);
}

@compute @workgroup_size(64)
fn attention_forward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) li: u32) {
    let g = group_index(wg, nwg);
    if (g >= P.b * P.nh * ((P.t + ROWS - 1u) / ROWS)) { return; }
    let blk = block_of(g);
    let b = blk.x;
    let h = blk.y;
    let tq = blk.z + li;
    let live = tq < P.t;
    let scale = sqrt(f32(hs()));
    var q: array<vec4<f32>, 16>;
    var acc: array<vec4<f32>, 16>;
    var s: array<f32, 32>;
    load_qkv_row(&q, qkv_index(b, min(tq, P.t - 1u), 0u, h, 0u), live);
    var m = -3.4028235e38;
    var l = 0.0;
    let end = min(blk.z + ROWS, P.t);
    for (var k0 = 0u; k0 < end; k0 += TILE) {
        stage_kv(b, h, k0, li);
        var mt = m;
        for (var j = 0u; j < TILE; j++) {
            s[j] = dot_row(&q, 0u, j) / scale;
            if (k0 + j <= tq) { mt = max(mt, s[j]); }
        }
        let corr = exp(m - mt);
        l = l * corr;
        for (var j = 0u; j < HV; j++) { acc[j] = acc[j] * corr; }
        for (var j = 0u; j < TILE; j++) {
            if (k0 + j <= tq) {
                let p = exp(s[j] - mt);
                l += p;
                axpy_row(&acc, p, 1u, j);
            }
        }
        m = mt;
    }
    if (!live) { return; }
    let inv = 1.0 / l;
    for (var j = 0u; j < HV; j++) { acc[j] = acc[j] * inv; }
    store_row(&acc, P.out_off + (b * P.t + tq) * P.c + h * hs());
    lse[P.lse_off + (b * P.nh + h) * P.t + tq] = m + log(l);
}

// delta[b, h, tq] = sum over i < hs (in order) of dout[b, tq, h, i] * out[b, tq, h, i]; one row per
// invocation, 256 per workgroup.
@compute @workgroup_size(256)
fn attention_backward_delta(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_index) li: u32) {
    let row = flat_index(wg, nwg, li);
    if (row >= P.b * P.nh * P.t) { return; }
    let tq = row % P.t;
    let h = (row / P.t) % P.nh;
    let b = row / (P.t * P.nh);
    let n = hs();
    let o = (b * P.t + tq) * P.c + h * n;
    var s = 0.0;
    for (var i = 0u; i < n; i++) { s += dout[P.dout_off + o + i] * fout[P.fout_off + o + i]; }
    delta[P.delta_off + row] = s;
}

// dq[b, tq, h] = sum over t2 <= tq of ds / sqrt(hs) * k[b, t2, h], ds = p * (dout . v - delta),
// p = exp(q . k / sqrt(hs) - lse). A query row per invocation; writes the q part of dqkv.
@compute @workgroup_size(64)
fn attention_backward_dq(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) li: u32) {
    let g = group_index(wg, nwg);
    if (g >= P.b * P.nh * ((P.t + ROWS - 1u) / ROWS)) { return; }
    let blk = block_of(g);
    let b = blk.x;
    let h = blk.y;
    let tq = blk.z + li;
    let live = tq < P.t;
    let rq = min(tq, P.t - 1u);
    let scale = sqrt(f32(hs()));
    var q: array<vec4<f32>, 16>;
    var d: array<vec4<f32>, 16>;
    var dq: array<vec4<f32>, 16>;
    load_qkv_row(&q, qkv_index(b, rq, 0u, h, 0u), live);
    load_dout_row(&d, dout_index(b, rq, h), live);
    let row = (b * P.nh + h) * P.t + rq;
    let row_lse = lse[P.lse_off + row];
    let row_delta = delta[P.delta_off + row];
    let end = min(blk.z + ROWS, P.t);
    for (var k0 = 0u; k0 < end; k0 += TILE) {
        stage_kv(b, h, k0, li);
        for (var j = 0u; j < TILE; j++) {
            if (k0 + j <= tq) {
                let p = exp(dot_row(&q, 0u, j) / scale - row_lse);
                let ds = p * (dot_row(&d, 1u, j) - row_delta);
                axpy_row(&dq, ds / scale, 0u, j);
            }
        }
    }
    if (!live) { return; }
    store_row(&dq, P.out_off + (b * P.t + tq) * 3u * P.c + h * hs());
}

// The key-row kernels' walk: query tiles from this block's first key to t, in order; for each query tq >=
// the invocation's key, p and (for dk) ds as in dq. dk[b, t2, h] = sum over tq >= t2 of ds / sqrt(hs) *
// q[b, tq, h]; writes the k part of dqkv.
@compute @workgroup_size(64)
fn attention_backward_dk(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) li: u32) {
    let g = group_index(wg, nwg);
    if (g >= P.b * P.nh * ((P.t + ROWS - 1u) / ROWS)) { return; }
    let blk = block_of(g);
    let b = blk.x;
    let h = blk.y;
    let t2 = blk.z + li;
    let live = t2 < P.t;
    let rk = min(t2, P.t - 1u);
    let scale = sqrt(f32(hs()));
    var k: array<vec4<f32>, 16>;
    var v: array<vec4<f32>, 16>;
    var dk: array<vec4<f32>, 16>;
    load_qkv_row(&k, qkv_index(b, rk, 1u, h, 0u), live);
    load_qkv_row(&v, qkv_index(b, rk, 2u, h, 0u), live);
    let rows = (b * P.nh + h) * P.t;
    for (var q0 = blk.z; q0 < P.t; q0 += TILE) {
        stage_qd(b, h, q0, li);
        for (var i = 0u; i < TILE; i++) {
            let tq = q0 + i;
            if (tq >= t2 && tq < P.t) {
                let p = exp(dot_row(&k, 0u, i) / scale - lse[P.lse_off + rows + tq]);
                let ds = p * (dot_row(&v, 1u, i) - delta[P.delta_off + rows + tq]);
                axpy_row(&dk, ds / scale, 0u, i);
            }
        }
    }
    if (!live) { return; }
    store_row(&dk, P.out_off + (b * P.t + t2) * 3u * P.c + P.c + h * hs());
}

// dv[b, t2, h] = sum over tq >= t2 (in order) of p * dout[b, tq, h]; writes the v part of dqkv.
@compute @workgroup_size(64)
fn attention_backward_dv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) li: u32) {
    let g = group_index(wg, nwg);
    if (g >= P.b * P.nh * ((P.t + ROWS - 1u) / ROWS)) { return; }
    let blk = block_of(g);
    let b = blk.x;
    let h = blk.y;
    let t2 = blk.z + li;
    let live = t2 < P.t;
    let rk = min(t2, P.t - 1u);
    let scale = sqrt(f32(hs()));
    var k: array<vec4<f32>, 16>;
    var dv: array<vec4<f32>, 16>;
    load_qkv_row(&k, qkv_index(b, rk, 1u, h, 0u), live);
    let rows = (b * P.nh + h) * P.t;
    for (var q0 = blk.z; q0 < P.t; q0 += TILE) {
        stage_qd(b, h, q0, li);
        for (var i = 0u; i < TILE; i++) {
            let tq = q0 + i;
            if (tq >= t2 && tq < P.t) {
                let p = exp(dot_row(&k, 0u, i) / scale - lse[P.lse_off + rows + tq]);
                axpy_row(&dv, p, 1u, i);
            }
        }
    }
    if (!live) { return; }
    store_row(&dv, P.out_off + (b * P.t + t2) * 3u * P.c + 2u * P.c + h * hs());
}
