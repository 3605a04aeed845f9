// Element-wise ops on vec4<f32> storage: residual add, in-place add, scale, fill, copy. The backend uses
// them when every view starts at a multiple of 4 elements; `n` and the offsets count vec4s, and the tail of
// fewer than 4 elements goes to the scalar kernels of residual.wgsl. A workgroup covers VPI * 256
// consecutive vec4s, lane li taking li, li + 256, ... so neighbouring lanes touch neighbouring memory.

struct Params {
    n: u32,
    dst_off: u32,
    a_off: u32,
    b_off: u32,
    s: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> a: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> b: array<vec4<f32>>;

// vec4s per invocation.
const VPI: u32 = 16u;

fn first_index(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return group_index(wg, nwg) * (WG * VPI) + li;
}

@compute @workgroup_size(256)
fn residual_forward4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) li: u32) {
    let g0 = first_index(wg, nwg, li);
    for (var i = 0u; i < VPI; i++) {
        let g = g0 + i * WG;
        if (g < P.n) { dst[P.dst_off + g] = a[P.a_off + g] + b[P.b_off + g]; }
    }
}

// dst += a
@compute @workgroup_size(256)
fn add_inplace4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) li: u32) {
    let g0 = first_index(wg, nwg, li);
    for (var i = 0u; i < VPI; i++) {
        let g = g0 + i * WG;
        if (g < P.n) { dst[P.dst_off + g] = dst[P.dst_off + g] + a[P.a_off + g]; }
    }
}

@compute @workgroup_size(256)
fn scale4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) li: u32) {
    let g0 = first_index(wg, nwg, li);
    for (var i = 0u; i < VPI; i++) {
        let g = g0 + i * WG;
        if (g < P.n) { dst[P.dst_off + g] = dst[P.dst_off + g] * P.s; }
    }
}

@compute @workgroup_size(256)
fn fill4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32) {
    let g0 = first_index(wg, nwg, li);
    for (var i = 0u; i < VPI; i++) {
        let g = g0 + i * WG;
        if (g < P.n) { dst[P.dst_off + g] = vec4<f32>(P.s); }
    }
}

// dst = a
@compute @workgroup_size(256)
fn copy4(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) li: u32) {
    let g0 = first_index(wg, nwg, li);
    for (var i = 0u; i < VPI; i++) {
        let g = g0 + i * WG;
        if (g < P.n) { dst[P.dst_off + g] = a[P.a_off + g]; }
    }
}
