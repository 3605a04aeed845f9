//! AdamW with `torch.optim.AdamW` semantics over the flat parameter buffer, plus global-norm clipping.
//!
//! The update works on any set of element ranges of the flat buffer, so the same code serves the replicated
//! update (the whole buffer) and the ZeRO-1 sharded update (the rank's chunk of every gradient bucket): one
//! AdamW call per range, whose weight decay applies to the rank >= 2 tensors only (the range's decay runs,
//! a small table uploaded once), and the step is counted once per update, so bias correction does not
//! depend on the ranges.

use crate::backend::{AdamWStep, AdamWUpdate, Backend, TokenView, View};
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
    /// The elements of the flat parameter buffer whose moments live here, ascending and disjoint: all of
    /// them for a replicated update, the rank's chunk of every gradient bucket for a sharded (ZeRO-1) one.
    pub owned: Vec<Range<usize>>,
    /// [sum of owned lengths]: first moment (torch `exp_avg`) of the owned elements, range after range.
    pub m: View,
    /// [sum of owned lengths]: second moment (torch `exp_avg_sq`) of the owned elements, range after range.
    pub v: View,
    /// Optimizer steps taken so far.
    pub step: u64,
    /// Each updated range's decay runs on the device ([`decay_runs`]), uploaded on its first update.
    decay_tables: Vec<(Range<usize>, TokenView)>,
}

impl AdamW {
    /// An optimizer owning all `len` elements.
    pub fn new<B: Backend>(be: &mut B, config: AdamWConfig, len: usize) -> Result<Self> {
        Self::for_ranges(be, config, std::iter::once(0..len).collect())
    }

    /// An optimizer owning the elements `owned` (ascending, disjoint) of the flat buffers: moments are
    /// allocated for them only.
    pub fn for_ranges<B: Backend>(be: &mut B, config: AdamWConfig, owned: Vec<Range<usize>>) -> Result<Self> {
        assert!(
            owned.windows(2).all(|w| w[0].end <= w[1].start),
            "owned ranges must be ascending and disjoint: {owned:?}"
        );
        let len = owned.iter().map(|r| r.len()).sum();
        Ok(AdamW {
            config,
            m: be.alloc(len)?,
            v: be.alloc(len)?,
            owned,
            step: 0,
            decay_tables: Vec::new(),
        })
    }

    /// Elements owned.
    pub fn owned_len(&self) -> usize {
        self.m.len
    }

    /// The owned elements of a full flat tensor (a saved moment), range after range: `[owned_len]`.
    pub fn cut(&self, full: &[f32]) -> Vec<f32> {
        self.owned
            .iter()
            .flat_map(|r| full[r.clone()].iter().copied())
            .collect()
    }

    /// Writes owned values (`[owned_len]`, range after range) to their places in a full flat tensor.
    pub fn place(&self, owned_values: &[f32], full: &mut [f32]) {
        let mut at = 0;
        for r in &self.owned {
            full[r.clone()].copy_from_slice(&owned_values[at..at + r.len()]);
            at += r.len();
        }
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

    /// One step over every owned element, then counts the step (once, however many ranges are owned).
    #[allow(clippy::too_many_arguments)]
    pub fn update<B: Backend>(
        &mut self,
        be: &mut B,
        layout: &ParamLayout,
        params: View,
        grads: View,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let scalars = self.step_scalars(lr, grad_scale);
        let mut moment_at = 0;
        for r in self.owned.clone() {
            let len = r.len();
            self.apply(be, layout, params, grads, r, moment_at, &scalars)?;
            moment_at += len;
        }
        self.step += 1;
        Ok(())
    }

    /// Updates the elements `[lo, hi)` of the flat buffers, which must lie in one owned range, then counts
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
    ) -> Result<()> {
        let mut moment_at = 0;
        let within = self.owned.iter().find_map(|r| {
            let found = (r.start <= lo && hi <= r.end).then_some(moment_at + lo - r.start);
            moment_at += r.len();
            found
        });
        let Some(moment_at) = within else {
            panic!("update of [{lo}, {hi}) outside the owned ranges {:?}", self.owned)
        };
        let scalars = self.step_scalars(lr, grad_scale);
        self.apply(be, layout, params, grads, lo..hi, moment_at, &scalars)?;
        self.step += 1;
        Ok(())
    }

    /// The AdamW kernel over the flat `range`, whose moments start at `moment_at`: one call for all the
    /// tensors it crosses, the weight decay applying inside the decaying ones' runs (rank >= 2 tensors).
    #[allow(clippy::too_many_arguments)]
    fn apply<B: Backend>(
        &mut self,
        be: &mut B,
        layout: &ParamLayout,
        params: View,
        grads: View,
        range: Range<usize>,
        moment_at: usize,
        scalars: &AdamWStep,
    ) -> Result<()> {
        let runs = self.decay_runs_of(be, layout, &range)?;
        let len = range.len();
        be.adamw(
            AdamWUpdate {
                params: params.sub(range.start, len),
                grads: grads.sub(range.start, len),
                m: self.m.sub(moment_at, len),
                v: self.v.sub(moment_at, len),
                step: *scalars,
                decay_runs: Some(runs),
            }
            .checked(),
        );
        Ok(())
    }

    /// The decay runs of `range` on the device, uploaded on first use (an optimizer updates the same ranges
    /// every step).
    fn decay_runs_of<B: Backend>(
        &mut self,
        be: &mut B,
        layout: &ParamLayout,
        range: &Range<usize>,
    ) -> Result<TokenView> {
        if let Some((_, runs)) = self.decay_tables.iter().find(|(r, _)| r == range) {
            return Ok(*runs);
        }
        let runs = decay_runs(layout, range);
        let table = be.alloc_tokens(runs.len())?; // [runs.len()]
        be.upload_tokens(table, &runs)?;
        self.decay_tables.push((range.clone(), table));
        Ok(table)
    }
}

/// Offsets within `range` of the parts of decaying tensors it holds, merged where they touch:
/// `[s0, e0, s1, e1, ...]`, ascending.
pub fn decay_runs(layout: &ParamLayout, range: &Range<usize>) -> Vec<u32> {
    let offset = |x: usize| u32::try_from(x - range.start).expect("an update range below 2^32 elements");
    let mut runs: Vec<u32> = Vec::new();
    for spec in layout.specs.iter().filter(|s| s.decays()) {
        let (start, end) = (spec.offset.max(range.start), (spec.offset + spec.len).min(range.end));
        if start >= end {
            continue;
        }
        let (s, e) = (offset(start), offset(end));
        match runs.last_mut() {
            Some(last) if *last == s => *last = e,
            _ => runs.extend([s, e]),
        }
    }
    debug_assert!(runs.windows(2).all(|w| w[0] <= w[1]), "layout order is offset order");
    runs
}

/// torch's `clip_grad_norm_` coefficient: `min(1, max_norm / (norm + 1e-6))`; 1 when clipping is off.
pub fn clip_coefficient(grad_norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (grad_norm + 1e-6)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::op_cost::OpFamily;
    use crate::backend::profiled::Profiled;
    use crate::model::ModelConfig;

    /// The runs of a whole GPT-2 layout hold exactly its rank >= 2 tensors, merged where they touch (`wte`
    /// and `wpe`), and a range cut through them keeps its share.
    #[test]
    fn decay_runs_hold_the_rank_two_tensors() {
        let layout = ParamLayout::new(&ModelConfig::tiny());
        let runs = decay_runs(&layout, &(0..layout.total));
        let decaying: usize = layout.specs.iter().filter(|s| s.decays()).map(|s| s.len).sum();
        let covered: usize = runs.chunks(2).map(|r| (r[1] - r[0]) as usize).sum();
        assert_eq!(covered, decaying);
        let (wte, wpe) = (&layout.specs[0], &layout.specs[1]);
        assert_eq!(runs[..2], [0, (wte.len + wpe.len) as u32], "wte and wpe make one run");
        let cut = 100..layout.total - 7;
        let inside: usize = decay_runs(&layout, &cut)
            .chunks(2)
            .map(|r| (r[1] - r[0]) as usize)
            .sum();
        assert_eq!(
            inside,
            decaying - 100,
            "the cut drops 100 elements of wte; the tail decays not"
        );
    }

    /// An update over the whole buffer is one AdamW call, however many tensors it crosses, and its runs
    /// table is uploaded once.
    #[test]
    fn an_update_is_one_adamw_call() {
        let layout = ParamLayout::new(&ModelConfig::tiny());
        let (mut be, profile) = Profiled::new(CpuBackend::<f32>::new());
        let (params, grads) = (be.alloc(layout.total).unwrap(), be.alloc(layout.total).unwrap());
        let mut opt = AdamW::new(&mut be, AdamWConfig::default(), layout.total).unwrap();
        for _ in 0..3 {
            opt.update(&mut be, &layout, params, grads, 1e-3, 1.0).unwrap();
        }
        assert_eq!(profile.lock().unwrap().get(OpFamily::AdamW).calls, 3);
        assert_eq!(opt.decay_tables.len(), 1);
    }
}
