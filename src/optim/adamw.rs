//! AdamW with `torch.optim.AdamW` semantics over the flat parameter buffer, plus global-norm clipping.
//!
//! The update works on any element range of the flat buffer, so the same code serves the replicated update
//! (the whole range) and the ZeRO-1 sharded update (the shard a rank owns): each tensor of the layout that
//! intersects the range is updated with its own weight decay (rank >= 2 tensors only).

use crate::backend::{AdamWStep, Backend, View};
use crate::model::ParamLayout;
use anyhow::Result;
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// Optimizer state on the device: the two moments of the parameters this optimizer owns, and the step
/// count.
pub struct AdamW {
    pub config: AdamWConfig,
    /// The elements of the flat parameter buffer whose moments live here: all of them for a replicated
    /// update, the rank's own chunk for a sharded (ZeRO-1) one.
    pub owned: Range<usize>,
    /// [owned.len()]: first moment (torch `exp_avg`) of the owned elements.
    pub m: View,
    /// [owned.len()]: second moment (torch `exp_avg_sq`) of the owned elements.
    pub v: View,
    /// Optimizer steps taken so far.
    pub step: u64,
}

impl AdamW {
    /// An optimizer owning all `len` elements.
    pub fn new<B: Backend>(be: &mut B, config: AdamWConfig, len: usize) -> Result<Self> {
        Self::for_range(be, config, 0..len)
    }

    /// An optimizer owning the elements `owned` of the flat buffers: moments are allocated for them only.
    pub fn for_range<B: Backend>(be: &mut B, config: AdamWConfig, owned: Range<usize>) -> Result<Self> {
        Ok(AdamW {
            config,
            m: be.alloc(owned.len())?,
            v: be.alloc(owned.len())?,
            owned,
            step: 0,
        })
    }

    /// The scalars of the next step (1-based `t = self.step + 1`), bias corrections in f64 as torch does.
    pub fn step_scalars(&self, lr: f64, grad_scale: f64) -> AdamWStep {
        let t = (self.step + 1) as i32;
        let c = &self.config;
        let bias_correction1 = 1.0 - c.beta1.powi(t);
        let bias_correction2 = 1.0 - c.beta2.powi(t);
        AdamWStep {
            lr: lr as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            eps: c.eps as f32,
            weight_decay: c.weight_decay as f32,
            step_size: (lr / bias_correction1) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            grad_scale: grad_scale as f32,
        }
    }

    /// Updates the elements `[lo, hi)` of the flat buffers, which must lie in [`AdamW::owned`], then counts
    /// the step.
    #[allow(clippy::too_many_arguments)]
    pub fn update_range<B: Backend>(
        &mut self,
        be: &mut B,
        layout: &ParamLayout,
        params: View,
        grads: View,
        lo: usize,
        hi: usize,
        lr: f64,
        grad_scale: f64,
    ) {
        assert!(
            self.owned.start <= lo && hi <= self.owned.end,
            "update of [{lo}, {hi}) outside the owned range {:?}",
            self.owned
        );
        let scalars = self.step_scalars(lr, grad_scale);
        for spec in &layout.specs {
            let start = spec.offset.max(lo);
            let end = (spec.offset + spec.len).min(hi);
            if start >= end {
                continue;
            }
            let step = AdamWStep {
                weight_decay: if spec.decays() { scalars.weight_decay } else { 0.0 },
                ..scalars
            };
            let len = end - start;
            be.adamw(
                params.sub(start, len),
                grads.sub(start, len),
                self.m.sub(start - self.owned.start, len),
                self.v.sub(start - self.owned.start, len),
                &step,
            );
        }
        self.step += 1;
    }
}

/// torch's `clip_grad_norm_` coefficient: `min(1, max_norm / (norm + 1e-6))`; 1 when clipping is off.
pub fn clip_coefficient(grad_norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (grad_norm + 1e-6)).min(1.0)
}
