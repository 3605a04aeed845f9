//! The arguments of the model's layer ops: embedding, layer norm, matmul, attention, cross-entropy, and
//! their fused forms.

use super::{
    or_empty, AttentionSaving, AttentionShape, Check, EncoderShape, LogitsShape, MatmulShape, OpArgs, RowsShape,
};
use crate::backend::{TokenView, View};

/// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]`.
#[derive(Clone, Copy, Debug)]
pub struct EncoderForward {
    /// `[b*t, c]`
    pub out: View,
    /// `[b*t]`
    pub tokens: TokenView,
    /// `[v, c]`
    pub wte: View,
    /// `[>=t, c]`
    pub wpe: View,
    pub shape: EncoderShape,
}

impl OpArgs for EncoderForward {
    const OP: &'static str = "encoder_forward";

    fn check(&self) {
        let EncoderShape { b, t, c } = self.shape;
        let k = Check::new(Self::OP, self);
        k.require(c > 0 && self.wte.len % c == 0, "wte is not whole rows of c channels")
            .len("out", self.out.len, b * t * c)
            .len("tokens", self.tokens.len, b * t)
            .len_at_least("wpe", self.wpe.len, t * c)
            .disjoint(&[("out", self.out)], &[("wte", self.wte), ("wpe", self.wpe)]);
    }
}

/// `dwte[tokens[b,t],:] += dout[b,t,:]`, `dwpe[t,:] += dout[b,t,:]`.
#[derive(Clone, Copy, Debug)]
pub struct EncoderBackward {
    /// `[v, c]`, accumulated
    pub dwte: View,
    /// `[>=t, c]`, accumulated
    pub dwpe: View,
    /// `[b*t, c]`
    pub dout: View,
    /// `[b*t]`
    pub tokens: TokenView,
    pub shape: EncoderShape,
}

impl OpArgs for EncoderBackward {
    const OP: &'static str = "encoder_backward";

    fn check(&self) {
        let EncoderShape { b, t, c } = self.shape;
        let k = Check::new(Self::OP, self);
        k.require(c > 0 && self.dwte.len % c == 0, "dwte is not whole rows of c channels")
            .len("dout", self.dout.len, b * t * c)
            .len("tokens", self.tokens.len, b * t)
            .len_at_least("dwpe", self.dwpe.len, t * c)
            .disjoint(&[("dwte", self.dwte), ("dwpe", self.dwpe)], &[("dout", self.dout)]);
    }
}

/// Layer norm over the last axis, eps 1e-5, saving each row's mean and 1/std for backward.
#[derive(Clone, Copy, Debug)]
pub struct LayerNormForward {
    /// `[n, c]`
    pub out: View,
    /// `[n]`
    pub mean: View,
    /// `[n]`
    pub rstd: View,
    /// `[n, c]`
    pub inp: View,
    /// `[c]`
    pub weight: View,
    /// `[c]`
    pub bias: View,
    pub shape: RowsShape,
}

impl OpArgs for LayerNormForward {
    const OP: &'static str = "layernorm_forward";

    fn check(&self) {
        let RowsShape { n, c } = self.shape;
        let k = Check::new(Self::OP, self);
        k.len("out", self.out.len, n * c)
            .len("mean", self.mean.len, n)
            .len("rstd", self.rstd.len, n)
            .len("inp", self.inp.len, n * c)
            .len("weight", self.weight.len, c)
            .len("bias", self.bias.len, c)
            .disjoint(
                &[("out", self.out), ("mean", self.mean), ("rstd", self.rstd)],
                &[("inp", self.inp), ("weight", self.weight), ("bias", self.bias)],
            );
    }
}

/// Layer norm's backward: accumulates into `dinp` (the residual stream's gradient), `dweight` and `dbias`.
#[derive(Clone, Copy, Debug)]
pub struct LayerNormBackward {
    /// `[n, c]`, accumulated
    pub dinp: View,
    /// `[c]`, accumulated
    pub dweight: View,
    /// `[c]`, accumulated
    pub dbias: View,
    /// `[n, c]`
    pub dout: View,
    /// `[n, c]`
    pub inp: View,
    /// `[c]`
    pub weight: View,
    /// `[n]`
    pub mean: View,
    /// `[n]`
    pub rstd: View,
    pub shape: RowsShape,
}

impl OpArgs for LayerNormBackward {
    const OP: &'static str = "layernorm_backward";

    fn check(&self) {
        let RowsShape { n, c } = self.shape;
        let k = Check::new(Self::OP, self);
        k.len("dinp", self.dinp.len, n * c)
            .len("dweight", self.dweight.len, c)
            .len("dbias", self.dbias.len, c)
            .len("dout", self.dout.len, n * c)
            .len("inp", self.inp.len, n * c)
            .len("weight", self.weight.len, c)
            .len("mean", self.mean.len, n)
            .len("rstd", self.rstd.len, n)
            .disjoint(
                &[("dinp", self.dinp), ("dweight", self.dweight), ("dbias", self.dbias)],
                &[
                    ("dout", self.dout),
                    ("inp", self.inp),
                    ("weight", self.weight),
                    ("mean", self.mean),
                    ("rstd", self.rstd),
                ],
            );
    }
}

/// `residual += skip`, then the layer norm of the new `residual` into `out` (fused: the same as
/// [`AddInplace`] then [`LayerNormForward`]).
#[derive(Clone, Copy, Debug)]
pub struct AddLayerNormForward {
    /// `[n, c]`, updated in place
    pub residual: View,
    /// `[n, c]`
    pub skip: View,
    /// `[n, c]`
    pub out: View,
    /// `[n]`
    pub mean: View,
    /// `[n]`
    pub rstd: View,
    /// `[c]`
    pub weight: View,
    /// `[c]`
    pub bias: View,
    pub shape: RowsShape,
}

impl OpArgs for AddLayerNormForward {
    const OP: &'static str = "add_layernorm_forward";

    fn check(&self) {
        let RowsShape { n, c } = self.shape;
        let k = Check::new(Self::OP, self);
        k.len("residual", self.residual.len, n * c)
            .len("skip", self.skip.len, n * c)
            .len("out", self.out.len, n * c)
            .len("mean", self.mean.len, n)
            .len("rstd", self.rstd.len, n)
            .len("weight", self.weight.len, c)
            .len("bias", self.bias.len, c)
            .disjoint(
                &[
                    ("residual", self.residual),
                    ("out", self.out),
                    ("mean", self.mean),
                    ("rstd", self.rstd),
                ],
                &[("skip", self.skip), ("weight", self.weight), ("bias", self.bias)],
            );
    }
}

/// `out = inp @ W (+ bias)`.
#[derive(Clone, Copy, Debug)]
pub struct MatmulForward {
    /// `[n, oc]`
    pub out: View,
    /// `[n, c]`
    pub inp: View,
    /// `[c, oc]` or `[oc, c]` per `shape.layout`
    pub weight: View,
    /// `[oc]`
    pub bias: Option<View>,
    pub shape: MatmulShape,
}

impl OpArgs for MatmulForward {
    const OP: &'static str = "matmul_forward";

    fn check(&self) {
        let MatmulShape { n, c, oc, .. } = self.shape;
        let k = Check::new(Self::OP, self);
        k.len("out", self.out.len, n * oc)
            .len("inp", self.inp.len, n * c)
            .len("weight", self.weight.len, c * oc)
            .len("bias", self.bias.map_or(oc, |b| b.len), oc)
            .disjoint(
                &[("out", self.out)],
                &[
                    ("inp", self.inp),
                    ("weight", self.weight),
                    ("bias", or_empty(self.bias)),
                ],
            );
    }
}

/// The matmul's backward: overwrites `dinp`; accumulates into `dweight` and `dbias`.
#[derive(Clone, Copy, Debug)]
pub struct MatmulBackward {
    /// `[n, c]`
    pub dinp: View,
    /// as `weight`, accumulated
    pub dweight: View,
    /// `[oc]`, accumulated
    pub dbias: Option<View>,
    /// `[n, oc]`
    pub dout: View,
    /// `[n, c]`
    pub inp: View,
    /// `[c, oc]` or `[oc, c]` per `shape.layout`
    pub weight: View,
    pub shape: MatmulShape,
}

impl OpArgs for MatmulBackward {
    const OP: &'static str = "matmul_backward";

    fn check(&self) {
        let MatmulShape { n, c, oc, .. } = self.shape;
        let k = Check::new(Self::OP, self);
        k.len("dinp", self.dinp.len, n * c)
            .len("dweight", self.dweight.len, c * oc)
            .len("dbias", self.dbias.map_or(oc, |b| b.len), oc)
            .len("dout", self.dout.len, n * oc)
            .len("inp", self.inp.len, n * c)
            .len("weight", self.weight.len, c * oc)
            .disjoint(
                &[
                    ("dinp", self.dinp),
                    ("dweight", self.dweight),
                    ("dbias", or_empty(self.dbias)),
                ],
                &[("dout", self.dout), ("inp", self.inp), ("weight", self.weight)],
            );
    }
}

/// `pre = inp @ W + bias`, then `out = gelu(pre)` (fused: the same as [`MatmulForward`] then
/// [`GeluForward`]).
#[derive(Clone, Copy, Debug)]
pub struct MatmulGeluForward {
    /// `[n, oc]`
    pub pre: View,
    /// `[n, oc]`
    pub out: View,
    /// `[n, c]`
    pub inp: View,
    /// `[c, oc]` or `[oc, c]` per `shape.layout`
    pub weight: View,
    /// `[oc]`
    pub bias: View,
    pub shape: MatmulShape,
}

impl OpArgs for MatmulGeluForward {
    const OP: &'static str = "matmul_gelu_forward";

    fn check(&self) {
        let MatmulShape { n, c, oc, .. } = self.shape;
        let k = Check::new(Self::OP, self);
        k.len("pre", self.pre.len, n * oc)
            .len("out", self.out.len, n * oc)
            .len("inp", self.inp.len, n * c)
            .len("weight", self.weight.len, c * oc)
            .len("bias", self.bias.len, oc)
            .disjoint(
                &[("pre", self.pre), ("out", self.out)],
                &[("inp", self.inp), ("weight", self.weight), ("bias", self.bias)],
            );
    }
}

/// Causal multi-head attention, keeping what the backend's [`AttentionSaving`] says for backward.
#[derive(Clone, Copy, Debug)]
pub struct AttentionForward {
    /// `[b, t, c]`
    pub out: View,
    /// `saving.saved_len(shape)`: the softmax probabilities `[b, nh, t, t]` or the rows' log-sum-exp
    /// `[b, nh, t]`
    pub saved: View,
    /// `[b, t, 3c]` laid out as q | k | v
    pub qkv: View,
    /// What `saved` holds: the backend's own [`Backend::attention_saving`](crate::backend::Backend).
    pub saving: AttentionSaving,
    pub shape: AttentionShape,
}

impl OpArgs for AttentionForward {
    const OP: &'static str = "attention_forward";

    fn check(&self) {
        let AttentionShape { b, t, c, nh } = self.shape;
        let k = Check::new(Self::OP, self);
        k.require(nh > 0 && c % nh == 0, "c is not a whole number of heads")
            .len("out", self.out.len, b * t * c)
            .len("saved", self.saved.len, self.saving.saved_len(self.shape))
            .len("qkv", self.qkv.len, b * t * 3 * c)
            .disjoint(&[("out", self.out), ("saved", self.saved)], &[("qkv", self.qkv)]);
    }
}

/// Attention's backward: overwrites `dqkv`; `scratch` is the backend's to use.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBackward {
    /// `[b, t, 3c]`
    pub dqkv: View,
    /// `saving.scratch_len(shape)`
    pub scratch: View,
    /// `[b, t, c]`
    pub dout: View,
    /// `[b, t, 3c]`
    pub qkv: View,
    /// `[b, t, c]`: the forward's output
    pub out: View,
    /// What the forward saved (`saving.saved_len(shape)`)
    pub saved: View,
    pub saving: AttentionSaving,
    pub shape: AttentionShape,
}

impl OpArgs for AttentionBackward {
    const OP: &'static str = "attention_backward";

    fn check(&self) {
        let AttentionShape { b, t, c, nh } = self.shape;
        let k = Check::new(Self::OP, self);
        k.require(nh > 0 && c % nh == 0, "c is not a whole number of heads")
            .len("dqkv", self.dqkv.len, b * t * 3 * c)
            .len("scratch", self.scratch.len, self.saving.scratch_len(self.shape))
            .len("dout", self.dout.len, b * t * c)
            .len("qkv", self.qkv.len, b * t * 3 * c)
            .len("out", self.out.len, b * t * c)
            .len("saved", self.saved.len, self.saving.saved_len(self.shape))
            .disjoint(
                &[("dqkv", self.dqkv), ("scratch", self.scratch)],
                &[
                    ("dout", self.dout),
                    ("qkv", self.qkv),
                    ("out", self.out),
                    ("saved", self.saved),
                ],
            );
    }
}

/// Per-position cross-entropy of `softmax(logits)` against `targets`.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyForward {
    /// `[n]`
    pub losses: View,
    /// `[n, v]`
    pub logits: View,
    /// `[n]`
    pub targets: TokenView,
    pub shape: LogitsShape,
}

impl OpArgs for CrossEntropyForward {
    const OP: &'static str = "crossentropy_forward";

    fn check(&self) {
        let LogitsShape { n, v } = self.shape;
        let k = Check::new(Self::OP, self);
        k.require(v > 0, "an empty vocabulary")
            .len("losses", self.losses.len, n)
            .len("logits", self.logits.len, n * v)
            .len("targets", self.targets.len, n)
            .disjoint(&[("losses", self.losses)], &[("logits", self.logits)]);
    }
}

/// `dlogits = dloss * (softmax(logits) - onehot(targets))`; `dlogits` may be the same view as `logits`
/// (the gradient replaces the logits), but may not overlap it otherwise.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyBackward {
    /// `[n, v]`
    pub dlogits: View,
    /// `[n, v]`
    pub logits: View,
    /// `[n]`
    pub targets: TokenView,
    pub shape: LogitsShape,
    pub dloss: f32,
}

impl OpArgs for CrossEntropyBackward {
    const OP: &'static str = "crossentropy_backward";

    fn check(&self) {
        let LogitsShape { n, v } = self.shape;
        let k = Check::new(Self::OP, self);
        k.require(v > 0, "an empty vocabulary")
            .len("dlogits", self.dlogits.len, n * v)
            .len("logits", self.logits.len, n * v)
            .len("targets", self.targets.len, n);
        if self.dlogits != self.logits {
            k.disjoint(&[("dlogits", self.dlogits)], &[("logits", self.logits)]);
        }
    }
}

/// The per-position losses, then `logits` replaced in place by their gradient (fused: the same as
/// [`CrossEntropyForward`] then [`CrossEntropyBackward`] in place).
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyForwardBackward {
    /// `[n]`
    pub losses: View,
    /// `[n, v]`, replaced by the gradient
    pub logits: View,
    /// `[n]`
    pub targets: TokenView,
    pub shape: LogitsShape,
    pub dloss: f32,
}

impl OpArgs for CrossEntropyForwardBackward {
    const OP: &'static str = "crossentropy_forward_backward";

    fn check(&self) {
        let LogitsShape { n, v } = self.shape;
        let k = Check::new(Self::OP, self);
        k.require(v > 0, "an empty vocabulary")
            .len("losses", self.losses.len, n)
            .len("logits", self.logits.len, n * v)
            .len("targets", self.targets.len, n)
            .disjoint(&[("losses", self.losses), ("logits", self.logits)], &[]);
    }
}
