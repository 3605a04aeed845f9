//! The arguments of every op, and the one place their shapes are checked.
//!
//! Each op of [`Backend`](super::Backend) takes one argument struct: the views it reads and writes and the
//! shape they follow. A backend receives it as a [`Checked`], which only the struct's `checked` makes, so every
//! backend gets operands whose lengths match the shape and whose outputs alias nothing they should not:
//! no backend repeats these checks. A failed check is a programming error and panics, naming the op, the
//! operand and the length the shape needs. What only a backend can know (its binding limits, its loop
//! budget, token ids against the vocabulary where it reads them) it still checks itself.
//!
//! Aliasing (the module doc of [`backend`](super) states the rule): an output never overlaps another output
//! or an input, except where an op says so.

mod elementwise;
mod layers;
mod shapes;
#[cfg(test)]
mod tests;

pub use elementwise::{AdamWUpdate, AddInplace, CopyInto, GeluBackward, GeluForward, ResidualForward};
pub use layers::{
    AddLayerNormForward, AttentionBackward, AttentionForward, CrossEntropyBackward, CrossEntropyForward,
    CrossEntropyForwardBackward, EncoderBackward, EncoderForward, LayerNormBackward, LayerNormForward, MatmulBackward,
    MatmulForward, MatmulGeluForward,
};
pub use shapes::{AttentionSaving, AttentionShape, EncoderShape, LogitsShape, MatmulShape, RowsShape, WeightLayout};

use super::View;
use std::fmt::Debug;
use std::ops::Deref;

/// An op's arguments that passed their check. Only their `checked` method makes one, so a backend that takes a
/// `Checked<T>` knows the operands fit the shape; it reads them through `Deref`.
#[derive(Clone, Copy, Debug)]
pub struct Checked<T>(T);

impl<T> Deref for Checked<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// The arguments of one op.
pub trait OpArgs: Copy + Debug {
    /// The op's name in messages: the name of its [`Backend`](super::Backend) method.
    const OP: &'static str;

    /// Panics, naming the operand, where a view's length does not follow the shape, the shape itself is
    /// impossible, or an output aliases another operand.
    fn check(&self);
}

/// Gives each argument struct its `checked`, the only way to a [`Checked`] (an inherent method, so callers
/// need not import [`OpArgs`]).
macro_rules! checked_by_check {
    ($($args:ident),* $(,)?) => {
        $(impl $args {
            /// The arguments, checked: panics where [`OpArgs::check`] fails.
            pub fn checked(self) -> Checked<Self> {
                self.check();
                Checked(self)
            }
        })*
    };
}

checked_by_check!(
    EncoderForward,
    EncoderBackward,
    LayerNormForward,
    LayerNormBackward,
    AddLayerNormForward,
    MatmulForward,
    MatmulBackward,
    MatmulGeluForward,
    AttentionForward,
    AttentionBackward,
    GeluForward,
    GeluBackward,
    ResidualForward,
    AddInplace,
    CopyInto,
    CrossEntropyForward,
    CrossEntropyBackward,
    CrossEntropyForwardBackward,
    AdamWUpdate,
);

/// Collects one op's requirements and panics at the first that fails.
pub(super) struct Check<'a> {
    op: &'static str,
    args: &'a dyn Debug,
}

impl<'a> Check<'a> {
    pub(super) fn new(op: &'static str, args: &'a dyn Debug) -> Self {
        Check { op, args }
    }

    pub(super) fn fail(&self, what: std::fmt::Arguments) -> ! {
        panic!("{}: {what} (arguments {:?})", self.op, self.args)
    }

    /// The operand `name` holds exactly `need` elements.
    pub(super) fn len(&self, name: &str, len: usize, need: usize) -> &Self {
        if len != need {
            self.fail(format_args!("{name} holds {len} elements, the shape needs {need}"));
        }
        self
    }

    /// The operand `name` holds at least `need` elements.
    pub(super) fn len_at_least(&self, name: &str, len: usize, need: usize) -> &Self {
        if len < need {
            self.fail(format_args!(
                "{name} holds {len} elements, the shape needs at least {need}"
            ));
        }
        self
    }

    pub(super) fn require(&self, holds: bool, what: &str) -> &Self {
        if !holds {
            self.fail(format_args!("{what}"));
        }
        self
    }

    /// No output overlaps another output or an input.
    pub(super) fn disjoint(&self, outputs: &[(&str, View)], inputs: &[(&str, View)]) -> &Self {
        for (i, (name, out)) in outputs.iter().enumerate() {
            for (other, view) in outputs[i + 1..].iter().chain(inputs) {
                if out.overlaps(view) {
                    self.fail(format_args!("output {name} overlaps {other}"));
                }
            }
        }
        self
    }
}

/// All the views given hold the same number of elements.
pub(super) fn same_len(check: &Check, views: &[(&str, View)]) {
    let (first, len) = (views[0].0, views[0].1.len);
    for (name, view) in &views[1..] {
        if view.len != len {
            check.fail(format_args!("{name} holds {} elements, {first} holds {len}", view.len));
        }
    }
}

/// A zero-length view standing in for an absent optional operand: it overlaps nothing.
pub(super) fn or_empty(view: Option<View>) -> View {
    view.unwrap_or(View {
        buf: usize::MAX,
        offset: 0,
        len: 0,
    })
}
