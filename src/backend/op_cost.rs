//! What each op costs by its arguments alone: the FLOPs it executes and the bytes it must move at least,
//! grouped by op family. `ringtrain bench step --profile` sums these beside the time each family took, so
//! the first run on a device says where the time goes against what the work needs.
//!
//! Conventions (counts, not measurements):
//! - A multiply-add is 2 FLOPs. A matmul `[n, c] @ [c, oc]` is `2·n·c·oc`; its backward `4·n·c·oc` (the
//!   input's and the weight's gradient); a bias adds `n·oc` forward and `n·oc` to its gradient. So one
//!   token's matmuls over a step are `6·P_w + 2·P_b` (P_w the matmul weights, the tied LM head included,
//!   P_b their biases).
//! - Causal attention counts its contractions over the causal half, the diagonal included: forward
//!   `Q·Kᵀ` and `P·V`, `hs·t(t+1)` each per sequence and head, so `2·b·c·t(t+1)` in all; backward, with
//!   the probabilities saved, four (`dP`, `dV`, `dQ`, `dK`), `4·b·c·t(t+1)`; recomputing them from each
//!   row's log-sum-exp (the GPU kernels), eight: the `dQ` pass recomputes `Q·Kᵀ` and `dP`, the `dK` pass
//!   both again, the `dV` pass `Q·Kᵀ`, so `8·b·c·t(t+1)`. Masked scores inside a tile on the diagonal are
//!   computed and thrown away by the tiled kernels; they are not counted. Softmax and scaling are not counted (a few FLOPs per score,
//!   against `2·hs` per score in each contraction).
//! - Element-wise and row-wise ops count the arithmetic per element their CPU kernels run, rounded: layer
//!   norm 8 forward and 12 backward, GELU (tanh form) 10 and 16, softmax with cross-entropy 4 per logit
//!   (max, subtract, exp, sum) and 3 more for the gradient, AdamW 14 per parameter.
//! - Bytes: every operand view read once and every output written once (an accumulated output is read and
//!   written), 4 bytes per f32 or token. Kernels that re-read tiles move more; the row says what the op
//!   needs, so bytes / time is a lower bound on the bandwidth it used.

use super::op_args::*;

/// The op families the profile reports, in its row order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OpFamily {
    Matmul,
    Attention,
    LayerNorm,
    Gelu,
    CrossEntropy,
    Encoder,
    AdamW,
    /// Residual adds, copies, fills, scaling and the gradient norm's sum of squares.
    Elementwise,
}

impl OpFamily {
    pub const ALL: [OpFamily; 8] = [
        OpFamily::Matmul,
        OpFamily::Attention,
        OpFamily::LayerNorm,
        OpFamily::Gelu,
        OpFamily::CrossEntropy,
        OpFamily::Encoder,
        OpFamily::AdamW,
        OpFamily::Elementwise,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpFamily::Matmul => "matmul",
            OpFamily::Attention => "attention",
            OpFamily::LayerNorm => "layer norm",
            OpFamily::Gelu => "gelu",
            OpFamily::CrossEntropy => "cross-entropy",
            OpFamily::Encoder => "embedding",
            OpFamily::AdamW => "adamw",
            OpFamily::Elementwise => "element-wise",
        }
    }
}

/// One op's work: its family, FLOPs and bytes (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpCost {
    pub family: OpFamily,
    pub flops: f64,
    pub bytes: f64,
}

/// Bytes of `f32s` values.
fn f32_bytes(f32s: usize) -> f64 {
    4.0 * f32s as f64
}

/// The cost of one op's arguments.
pub trait Costed {
    fn cost(&self) -> OpCost;
}

fn cost(family: OpFamily, flops: f64, f32s_moved: usize) -> OpCost {
    OpCost {
        family,
        flops,
        bytes: f32_bytes(f32s_moved),
    }
}

/// FLOPs of the two (forward) causal contractions of attention: `2·b·c·t(t+1)`.
pub fn attention_forward_flops(s: &AttentionShape) -> f64 {
    2.0 * (s.b * s.c) as f64 * (s.t * (s.t + 1)) as f64
}

impl Costed for MatmulForward {
    fn cost(&self) -> OpCost {
        let MatmulShape { n, c, oc, .. } = self.shape;
        let bias = self.bias.map_or(0, |b| b.len);
        let flops = 2.0 * (n * c * oc) as f64 + if bias > 0 { (n * oc) as f64 } else { 0.0 };
        cost(OpFamily::Matmul, flops, n * c + c * oc + bias + n * oc)
    }
}

impl Costed for MatmulBackward {
    fn cost(&self) -> OpCost {
        let MatmulShape { n, c, oc, .. } = self.shape;
        let dbias = self.dbias.map_or(0, |b| b.len);
        let flops = 4.0 * (n * c * oc) as f64 + if dbias > 0 { (n * oc) as f64 } else { 0.0 };
        // Reads dout, inp and weight; writes dinp; accumulates dweight and dbias.
        cost(
            OpFamily::Matmul,
            flops,
            n * oc + n * c + c * oc + n * c + 2 * (c * oc + dbias),
        )
    }
}

impl Costed for MatmulGeluForward {
    fn cost(&self) -> OpCost {
        let MatmulShape { n, c, oc, .. } = self.shape;
        // The fused op is a matmul (with bias) and a GELU, timed as one: its row is the matmul's, and the
        // GELU's arithmetic (10 per output) is left out so that matmul FLOPs keep their convention.
        let flops = 2.0 * (n * c * oc) as f64 + (n * oc) as f64;
        cost(OpFamily::Matmul, flops, n * c + c * oc + oc + 2 * n * oc)
    }
}

impl Costed for AttentionForward {
    fn cost(&self) -> OpCost {
        cost(
            OpFamily::Attention,
            attention_forward_flops(&self.shape),
            self.qkv.len + self.saved.len + self.out.len,
        )
    }
}

impl Costed for AttentionBackward {
    fn cost(&self) -> OpCost {
        let moved = self.dout.len + self.qkv.len + self.saved.len + self.scratch.len + self.dqkv.len;
        // Recomputing kernels also read the output, for each row's dout · out.
        let (passes, moved) = match self.saving {
            AttentionSaving::Probabilities => (2.0, moved),
            AttentionSaving::RowLogSumExp => (4.0, moved + self.out.len),
        };
        cost(
            OpFamily::Attention,
            passes * attention_forward_flops(&self.shape),
            moved,
        )
    }
}

impl Costed for LayerNormForward {
    fn cost(&self) -> OpCost {
        let RowsShape { n, c } = self.shape;
        cost(OpFamily::LayerNorm, 8.0 * (n * c) as f64, 2 * n * c + 2 * c + 2 * n)
    }
}

impl Costed for LayerNormBackward {
    fn cost(&self) -> OpCost {
        let RowsShape { n, c } = self.shape;
        // Reads dout, inp, weight, mean, rstd; accumulates dinp, dweight, dbias.
        cost(
            OpFamily::LayerNorm,
            12.0 * (n * c) as f64,
            2 * n * c + c + 2 * n + 2 * (n * c + 2 * c),
        )
    }
}

impl Costed for AddLayerNormForward {
    fn cost(&self) -> OpCost {
        let RowsShape { n, c } = self.shape;
        // residual += skip (read both, write one), then the layer norm of the result.
        cost(
            OpFamily::LayerNorm,
            9.0 * (n * c) as f64,
            3 * n * c + n * c + 2 * c + 2 * n,
        )
    }
}

impl Costed for GeluForward {
    fn cost(&self) -> OpCost {
        cost(OpFamily::Gelu, 10.0 * self.inp.len as f64, 2 * self.inp.len)
    }
}

impl Costed for GeluBackward {
    fn cost(&self) -> OpCost {
        cost(OpFamily::Gelu, 16.0 * self.inp.len as f64, 3 * self.inp.len)
    }
}

impl Costed for CrossEntropyForward {
    fn cost(&self) -> OpCost {
        let LogitsShape { n, v } = self.shape;
        cost(OpFamily::CrossEntropy, 4.0 * (n * v) as f64, n * v + 2 * n)
    }
}

impl Costed for CrossEntropyBackward {
    fn cost(&self) -> OpCost {
        let LogitsShape { n, v } = self.shape;
        cost(OpFamily::CrossEntropy, 7.0 * (n * v) as f64, 2 * n * v + n)
    }
}

impl Costed for CrossEntropyForwardBackward {
    fn cost(&self) -> OpCost {
        let LogitsShape { n, v } = self.shape;
        cost(OpFamily::CrossEntropy, 7.0 * (n * v) as f64, 2 * n * v + 2 * n)
    }
}

impl Costed for EncoderForward {
    fn cost(&self) -> OpCost {
        let EncoderShape { b, t, c } = self.shape;
        let n = b * t;
        cost(OpFamily::Encoder, (n * c) as f64, n + 3 * n * c)
    }
}

impl Costed for EncoderBackward {
    fn cost(&self) -> OpCost {
        let EncoderShape { b, t, c } = self.shape;
        let n = b * t;
        // Reads dout and the tokens; accumulates a row of dwte and of dwpe per position.
        cost(OpFamily::Encoder, 2.0 * (n * c) as f64, n + n * c + 4 * n * c)
    }
}

impl Costed for AdamWUpdate {
    fn cost(&self) -> OpCost {
        let n = self.params.len;
        // Reads the gradients; reads and writes parameters and both moments.
        cost(OpFamily::AdamW, 14.0 * n as f64, n + 6 * n)
    }
}

impl Costed for ResidualForward {
    fn cost(&self) -> OpCost {
        cost(OpFamily::Elementwise, self.out.len as f64, 3 * self.out.len)
    }
}

impl Costed for AddInplace {
    fn cost(&self) -> OpCost {
        cost(OpFamily::Elementwise, self.dst.len as f64, 3 * self.dst.len)
    }
}

impl Costed for CopyInto {
    fn cost(&self) -> OpCost {
        cost(OpFamily::Elementwise, 0.0, 2 * self.dst.len)
    }
}

/// `fill`: writes `len` values.
pub fn fill_cost(len: usize) -> OpCost {
    cost(OpFamily::Elementwise, 0.0, len)
}

/// `scale`: reads and writes `len` values, one multiply each.
pub fn scale_cost(len: usize) -> OpCost {
    cost(OpFamily::Elementwise, len as f64, 2 * len)
}

/// `sum_squares`: reads `len` values, a multiply-add each.
pub fn sum_squares_cost(len: usize) -> OpCost {
    cost(OpFamily::Elementwise, 2.0 * len as f64, len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::View;

    fn view(len: usize) -> View {
        View { buf: 0, offset: 0, len }
    }

    #[test]
    fn a_matmul_and_its_backward_cost_six_flops_per_weight_and_row_plus_the_bias() {
        let shape = MatmulShape {
            n: 3,
            c: 4,
            oc: 5,
            layout: WeightLayout::InOut,
        };
        let f = MatmulForward {
            out: view(15),
            inp: view(12),
            weight: view(20),
            bias: Some(view(5)),
            shape,
        };
        let b = MatmulBackward {
            dinp: view(12),
            dweight: view(20),
            dbias: Some(view(5)),
            dout: view(15),
            inp: view(12),
            weight: view(20),
            shape,
        };
        assert_eq!(f.cost().flops + b.cost().flops, (6 * 3 * 20 + 2 * 3 * 5) as f64);
        assert_eq!(f.cost().bytes, 4.0 * (12 + 20 + 5 + 15) as f64);
    }

    #[test]
    fn causal_attention_counts_the_lower_triangle_with_its_diagonal() {
        // One sequence of 3 tokens, one head of 2 channels: Q·Kᵀ has 1 + 2 + 3 = 6 scores of 2 multiply-adds.
        let s = AttentionShape {
            b: 1,
            t: 3,
            c: 2,
            nh: 1,
        };
        assert_eq!(attention_forward_flops(&s), 2.0 * 2.0 * 6.0 * 2.0);
    }
}
