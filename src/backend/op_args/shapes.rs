//! The shape structs the op arguments carry.

/// How a matmul weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[in, out]`: Hugging Face `Conv1D` layout, `out = inp @ w`.
    InOut,
    /// `[out, in]`: the tied LM head reads `wte` `[V, C]` this way, `out = inp @ w^T`.
    OutIn,
}

/// Shape of a matmul: `inp [n, c] -> out [n, oc]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    pub n: usize,
    pub c: usize,
    pub oc: usize,
    pub layout: WeightLayout,
}

/// Shape of causal self-attention over a `[b, t, c]` activation with `nh` heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

/// Shape of the token and position embedding: `b` sequences of `t` tokens, `c` channels. The vocabulary is
/// the token table's rows (`wte.len / c`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
}

/// Shape of a row-wise op (layer norm): `n` rows of `c` channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsShape {
    pub n: usize,
    pub c: usize,
}

/// Shape of the classifier's loss: `n` positions, each with `v` logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogitsShape {
    pub n: usize,
    pub v: usize,
}
