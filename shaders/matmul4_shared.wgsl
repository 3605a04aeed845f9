// Shared by matmul4.wgsl and matmul4t.wgsl (the backend puts it in front of each): their parameters, the
// C and bias bindings, and the store of one 4-column block of C. The A and B bindings (2 and 3) differ:
// vec4 storage arrays in matmul4, rgba32f textures in matmul4t.
struct Params {
    m: u32,
    n: u32,
    k: u32,
    c_off: u32,
    c_rs: u32,
    a_off: u32,     // vec4s (unused by matmul4t)
    a_rs: u32,      // vec4s (unused by matmul4t)
    a_cs: u32,      // unused (1)
    b_off: u32,     // vec4s (unused by matmul4t)
    b_rs: u32,      // vec4s (unused by matmul4t)
    b_cs: u32,      // unused (1)
    bias_off: u32,
    flags: u32,     // bit 0: accumulate into C; bit 1: add bias
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> C: array<f32>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;

// Writes row gm, columns gn0 .. gn0 + 3 of C from acc, adding bias and/or C as the flags say; rows past m
// and blocks past n are skipped (n is a multiple of 4).
fn store4(gm: u32, gn0: u32, acc: vec4<f32>) {
    if (gm >= P.m || gn0 >= P.n) { return; }
    for (var q = 0u; q < 4u; q++) {
        let gn = gn0 + q;
        var v = acc[q];
        if ((P.flags & 2u) != 0u) { v = v + bias[P.bias_off + gn]; }
        let o = P.c_off + gm * P.c_rs + gn;
        if ((P.flags & 1u) != 0u) { v = C[o] + v; }
        C[o] = v;
    }
}
