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

/// What attention keeps from its forward for its backward. Each backend chooses one
/// ([`Backend::attention_saving`](crate::backend::Backend)); the model carves the lengths it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionSaving {
    /// The softmax probabilities `[b, nh, t, t]` (0 above the diagonal), and a `[b, nh, t, t]` scratch for
    /// their gradient: the CPU backend's algorithm, the readable specification.
    Probabilities,
    /// Each row's log-sum-exp of its scaled scores `[b, nh, t]`, and a `[b, nh, t]` scratch for each row's
    /// `dout · out`: backward recomputes the probabilities tile by tile (the GPU backends' flash kernels).
    RowLogSumExp,
}

impl AttentionSaving {
    /// Elements of the saved state for `shape`.
    pub fn saved_len(self, s: AttentionShape) -> usize {
        match self {
            AttentionSaving::Probabilities => s.b * s.nh * s.t * s.t,
            AttentionSaving::RowLogSumExp => s.b * s.nh * s.t,
        }
    }

    /// Elements of backward's scratch for `shape`.
    pub fn scratch_len(self, s: AttentionShape) -> usize {
        self.saved_len(s)
    }
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
