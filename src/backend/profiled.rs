//! A backend that times and counts every op of the backend it wraps, by op family ([`super::op_cost`]):
//! what `ringtrain bench step --profile` prints. Each op is followed by a synchronisation, so its row holds
//! the op's own time on any backend (on a GPU, launch latency and the overlap the synchronisation takes
//! away count too; device timers are not used yet). Transfers (upload, download, read-backs) are not ops
//! and are not counted.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::op_args::*;
use super::op_cost::{fill_cost, scale_cost, sum_squares_cost, Costed, OpCost, OpFamily};
use super::{Backend, BackendMemory, Download, MatmulPrecision, StepShape, TokenView, View};
use anyhow::Result;

/// One family's totals since the profile was last cleared.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FamilyTotals {
    pub calls: u64,
    pub flops: f64,
    pub bytes: f64,
    pub seconds: f64,
}

/// Totals per op family, shared between the wrapper and whoever reads them.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    pub families: BTreeMap<OpFamily, FamilyTotals>,
}

impl Profile {
    fn add(&mut self, cost: OpCost, seconds: f64) {
        let t = self.families.entry(cost.family).or_default();
        t.calls += 1;
        t.flops += cost.flops;
        t.bytes += cost.bytes;
        t.seconds += seconds;
    }

    /// A family's totals (zero when none of its ops ran).
    pub fn get(&self, family: OpFamily) -> FamilyTotals {
        self.families.get(&family).copied().unwrap_or_default()
    }

    /// The op time over every family.
    pub fn seconds(&self) -> f64 {
        self.families.values().map(|t| t.seconds).sum()
    }
}

/// `inner`, with every op counted into a shared [`Profile`].
pub struct Profiled<B> {
    inner: B,
    profile: Arc<Mutex<Profile>>,
}

impl<B: Backend> Profiled<B> {
    /// Wraps `inner`; the handle reads (and clears) the totals while the wrapper is in use.
    pub fn new(inner: B) -> (Self, Arc<Mutex<Profile>>) {
        let profile = Arc::new(Mutex::new(Profile::default()));
        (
            Profiled {
                inner,
                profile: profile.clone(),
            },
            profile,
        )
    }

    /// Synchronises, then adds `cost` with the time since `started`. A failed synchronisation is left to
    /// the next call that returns a result (a download or the next synchronize), as without the wrapper.
    fn record(&mut self, cost: OpCost, started: Instant) {
        let _ = self.inner.synchronize();
        let seconds = started.elapsed().as_secs_f64();
        self.profile.lock().expect("profile lock").add(cost, seconds);
    }
}

/// Forwards each op to the wrapped backend and records its cost and time.
macro_rules! profiled_ops {
    ($($op:ident($args:ty)),* $(,)?) => {
        $(fn $op(&mut self, op: Checked<$args>) {
            let cost = op.cost();
            let started = Instant::now();
            self.inner.$op(op);
            self.record(cost, started);
        })*
    };
}

impl<B: Backend> Backend for Profiled<B> {
    every_op!(profiled_ops);

    fn name(&self) -> String {
        self.inner.name()
    }

    fn attention_saving(&self) -> AttentionSaving {
        self.inner.attention_saving()
    }

    fn set_matmul_precision(&mut self, precision: MatmulPrecision) -> Result<()> {
        self.inner.set_matmul_precision(precision)
    }

    fn alloc(&mut self, len: usize) -> Result<View> {
        self.inner.alloc(len)
    }

    fn alloc_tokens(&mut self, len: usize) -> Result<TokenView> {
        self.inner.alloc_tokens(len)
    }

    fn free(&mut self, view: View) {
        self.inner.free(view)
    }

    fn free_tokens(&mut self, view: TokenView) {
        self.inner.free_tokens(view)
    }

    fn upload(&mut self, dst: View, src: &[f32]) -> Result<()> {
        self.inner.upload(dst, src)
    }

    fn upload_tokens(&mut self, dst: TokenView, src: &[u32]) -> Result<()> {
        self.inner.upload_tokens(dst, src)
    }

    fn download(&mut self, src: View, dst: &mut [f32]) -> Result<()> {
        self.inner.download(src, dst)
    }

    fn fill(&mut self, dst: View, value: f32) {
        let started = Instant::now();
        self.inner.fill(dst, value);
        self.record(fill_cost(dst.len), started);
    }

    fn sum_squares(&mut self, x: View) -> Result<f64> {
        let started = Instant::now();
        let r = self.inner.sum_squares(x);
        self.record(sum_squares_cost(x.len), started);
        r
    }

    fn scale(&mut self, x: View, s: f32) {
        let started = Instant::now();
        self.inner.scale(x, s);
        self.record(scale_cost(x.len), started);
    }

    fn check_step_shape(&self, shape: StepShape) -> Result<()> {
        self.inner.check_step_shape(shape)
    }

    fn begin_download(&mut self, src: View, host: Vec<f32>) -> Result<Download> {
        self.inner.begin_download(src, host)
    }

    fn download_ready(&mut self, download: &Download) -> Result<bool> {
        self.inner.download_ready(download)
    }

    fn finish_download(&mut self, download: Download) -> Result<Vec<f32>> {
        self.inner.finish_download(download)
    }

    fn memory(&self) -> BackendMemory {
        self.inner.memory()
    }

    fn synchronize(&mut self) -> Result<()> {
        self.inner.synchronize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::init::init_params;
    use crate::model::{Gpt2, ModelConfig, ParamLayout};

    /// One forward and backward of a model of gpt2's widths (one block, to keep the test small): the
    /// matmul rows hold 6 FLOPs per matmul weight and 2 per matmul bias for each token, and attention its
    /// stated causal count, whatever the batch.
    #[test]
    fn the_counts_at_gpt2_widths_are_six_flops_per_weight_and_the_causal_attention() {
        let cfg = ModelConfig {
            n_layer: 1,
            ..ModelConfig::gpt2()
        };
        let layout = ParamLayout::new(&cfg);
        let (mut be, profile) = Profiled::new(CpuBackend::<f32>::new());
        let mut model = Gpt2::new(&mut be, cfg.clone(), &init_params(&cfg, &layout, 3)).unwrap();
        let (b, t) = (2, 8);
        let tokens: Vec<u32> = (0..(b * t) as u32).map(|i| i * 7919 % cfg.vocab_size as u32).collect();
        profile.lock().unwrap().families.clear();
        model.forward(&mut be, &tokens, &tokens, b, t).unwrap();
        model.backward(&mut be, 1.0 / (b * t) as f32).unwrap();
        let p = profile.lock().unwrap().clone();
        let (c, v, l) = (cfg.n_embd, cfg.vocab_size, cfg.n_layer);
        let weights = l * (3 * c * c + c * c + 4 * c * c + 4 * c * c) + v * c;
        let biases = l * (3 * c + c + 4 * c + c);
        let n = (b * t) as f64;
        let matmul = p.get(OpFamily::Matmul);
        assert_eq!(matmul.flops, n * (6 * weights + 2 * biases) as f64, "{matmul:?}");
        let attention = p.get(OpFamily::Attention);
        assert_eq!(attention.flops, (6 * l * b * c * t * (t + 1)) as f64, "{attention:?}");
        assert!(p.families.values().all(|f| f.seconds > 0.0 && f.calls > 0), "{p:?}");
    }
}
