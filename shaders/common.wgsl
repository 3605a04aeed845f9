// Shared helpers, prepended to every op family's source by the wgpu backend.
// Every kernel runs 256 invocations per workgroup. Large 1-D problems are dispatched on a 2-D grid of
// workgroups (at most 65535 per dimension), so a flat index is rebuilt from the workgroup id.

const WG: u32 = 256u;

// Index of this workgroup in a 2-D grid laid out row by row.
fn group_index(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.y * nwg.x + wg.x;
}

// Flat invocation index for 1-D kernels.
fn flat_index(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return group_index(wg, nwg) * WG + li;
}
