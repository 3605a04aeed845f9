//! The arguments of the element-wise ops and AdamW: equally long views.

use super::{same_len, Check, OpArgs};
use crate::backend::{AdamWStep, TokenView, View};

/// GELU, tanh approximation (`gelu_new`).
#[derive(Clone, Copy, Debug)]
pub struct GeluForward {
    /// `[n]`
    pub out: View,
    /// `[n]`
    pub inp: View,
}

impl OpArgs for GeluForward {
    const OP: &'static str = "gelu_forward";

    fn check(&self) {
        let k = Check::new(Self::OP, self);
        same_len(&k, &[("out", self.out), ("inp", self.inp)]);
        k.disjoint(&[("out", self.out)], &[("inp", self.inp)]);
    }
}

/// GELU's backward: overwrites `dinp`.
#[derive(Clone, Copy, Debug)]
pub struct GeluBackward {
    /// `[n]`
    pub dinp: View,
    /// `[n]`
    pub inp: View,
    /// `[n]`
    pub dout: View,
}

impl OpArgs for GeluBackward {
    const OP: &'static str = "gelu_backward";

    fn check(&self) {
        let k = Check::new(Self::OP, self);
        same_len(&k, &[("dinp", self.dinp), ("inp", self.inp), ("dout", self.dout)]);
        k.disjoint(&[("dinp", self.dinp)], &[("inp", self.inp), ("dout", self.dout)]);
    }
}

/// `out = a + b`.
#[derive(Clone, Copy, Debug)]
pub struct ResidualForward {
    /// `[n]`
    pub out: View,
    /// `[n]`
    pub a: View,
    /// `[n]`
    pub b: View,
}

impl OpArgs for ResidualForward {
    const OP: &'static str = "residual_forward";

    fn check(&self) {
        let k = Check::new(Self::OP, self);
        same_len(&k, &[("out", self.out), ("a", self.a), ("b", self.b)]);
        k.disjoint(&[("out", self.out)], &[("a", self.a), ("b", self.b)]);
    }
}

/// `dst += src`.
#[derive(Clone, Copy, Debug)]
pub struct AddInplace {
    /// `[n]`, updated in place
    pub dst: View,
    /// `[n]`
    pub src: View,
}

impl OpArgs for AddInplace {
    const OP: &'static str = "add_inplace";

    fn check(&self) {
        let k = Check::new(Self::OP, self);
        same_len(&k, &[("dst", self.dst), ("src", self.src)]);
        k.disjoint(&[("dst", self.dst)], &[("src", self.src)]);
    }
}

/// `dst = src`.
#[derive(Clone, Copy, Debug)]
pub struct CopyInto {
    /// `[n]`
    pub dst: View,
    /// `[n]`
    pub src: View,
}

impl OpArgs for CopyInto {
    const OP: &'static str = "copy";

    fn check(&self) {
        let k = Check::new(Self::OP, self);
        same_len(&k, &[("dst", self.dst), ("src", self.src)]);
        k.disjoint(&[("dst", self.dst)], &[("src", self.src)]);
    }
}

/// One AdamW step (torch.optim.AdamW semantics) over equally long views.
#[derive(Clone, Copy, Debug)]
pub struct AdamWUpdate {
    /// `[n]`, updated in place
    pub params: View,
    /// `[n]`
    pub grads: View,
    /// `[n]`, first moments, updated in place
    pub m: View,
    /// `[n]`, second moments, updated in place
    pub v: View,
    pub step: AdamWStep,
    /// `[2k]`: ascending element offsets into the views, `[s0, e0, s1, e1, ...]`: `step.weight_decay`
    /// applies inside each `[s, e)` only (the tensors that decay), so one call updates many tensors; `None`:
    /// everywhere.
    pub decay_runs: Option<TokenView>,
}

impl OpArgs for AdamWUpdate {
    const OP: &'static str = "adamw";

    fn check(&self) {
        let k = Check::new(Self::OP, self);
        let views = [("params", self.params), ("m", self.m), ("v", self.v)];
        same_len(&k, &[views[0], ("grads", self.grads), views[1], views[2]]);
        k.disjoint(&views, &[("grads", self.grads)]);
        if let Some(runs) = self.decay_runs {
            k.require(runs.len % 2 == 0, "decay_runs holds (start, end) pairs");
        }
    }
}
