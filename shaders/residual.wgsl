// Element-wise ops: residual add, in-place add, scale, fill, copy.

struct Params {
    n: u32,
    dst_off: u32,
    a_off: u32,
    b_off: u32,
    s: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read_write> a: array<f32>;
@group(0) @binding(3) var<storage, read_write> b: array<f32>;

@compute @workgroup_size(256)
fn residual_forward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n) { return; }
    dst[P.dst_off + g] = a[P.a_off + g] + b[P.b_off + g];
}

// dst += a
@compute @workgroup_size(256)
fn add_inplace(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n) { return; }
    dst[P.dst_off + g] = dst[P.dst_off + g] + a[P.a_off + g];
}

@compute @workgroup_size(256)
fn scale(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n) { return; }
    dst[P.dst_off + g] = dst[P.dst_off + g] * P.s;
}

@compute @workgroup_size(256)
fn fill(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n) { return; }
    dst[P.dst_off + g] = P.s;
}

// dst = a
@compute @workgroup_size(256)
fn copy(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n) { return; }
    dst[P.dst_off + g] = a[P.a_off + g];
}
