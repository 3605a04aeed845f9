// sum(x^2), first level of a fixed two-level tree: one workgroup per block of 4096 elements (the CPU
// backend's SUM_BLOCK) writes the block's sum (each invocation sums 16 strided elements, then a fixed tree).
// The host adds the block sums in order, in f64.

struct Params {
    n: u32,
    x_off: u32,
    out_off: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> partial: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

const BLOCK: u32 = 4096u;
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn sum_squares(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) li: u32) {
    let blk = group_index(wg, nwg);
    if (blk * BLOCK >= P.n) { return; }
    var s = 0.0;
    for (var j = li; j < BLOCK; j += WG) {
        let i = blk * BLOCK + j;
        if (i < P.n) { let v = x[P.x_off + i]; s += v * v; }
    }
    red[li] = s;
    workgroupBarrier();
    for (var st = 128u; st > 0u; st = st >> 1u) {
        if (li < st) { red[li] = red[li] + red[li + st]; }
        workgroupBarrier();
    }
    if (li == 0u) { partial[P.out_off + blk] = red[0]; }
}
