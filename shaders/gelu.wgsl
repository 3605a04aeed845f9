// GELU, tanh approximation (gelu_new). The tanh argument is clamped to +-15, where tanh is +-1 in f32,
// so that backends whose tanh/cosh overflow for large inputs still give finite results.

struct Params {
    n: u32,
    out_off: u32,
    inp_off: u32,
    dout_off: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;   // out / dinp
@group(0) @binding(2) var<storage, read_write> inp: array<f32>;
@group(0) @binding(3) var<storage, read_write> dout: array<f32>;

const GELU_K: f32 = 0.7978845608028654; // sqrt(2 / pi)

@compute @workgroup_size(256)
fn gelu_forward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n) { return; }
    let x = inp[P.inp_off + g];
    let cube = 0.044715 * x * x * x;
    let arg = clamp(GELU_K * (x + cube), -15.0, 15.0);
    out[P.out_off + g] = 0.5 * x * (1.0 + tanh(arg));
}

@compute @workgroup_size(256)
fn gelu_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) li: u32) {
    let g = flat_index(wg, nwg, li);
    if (g >= P.n) { return; }
    let x = inp[P.inp_off + g];
    let cube = 0.044715 * x * x * x;
    let arg = clamp(GELU_K * (x + cube), -15.0, 15.0);
    let th = tanh(arg);
    let ch = cosh(arg);
    let sech2 = 1.0 / (ch * ch);
    let local = 0.5 * (1.0 + th) + x * 0.5 * sech2 * GELU_K * (1.0 + 3.0 * 0.044715 * x * x);
    out[P.out_off + g] = local * dout[P.dout_off + g];
}
