//! Compute time of one rank, per layer, in the order the trainer reaches each layer.
//!
//! Forward is a list of segments in run order, each needing the parameters `..upto` (the points where
//! `Gpt2::forward_train` calls `needs`, where a sharded trainer waits for the parameter all-gather).
//! Backward is a list of segments after each of which the gradients `from..` are final (the points where
//! `Gpt2::backward_reporting` calls `finished`, where the gradient sync hands a bucket over). So a bucket's
//! ready time follows from the real model's backward order, not from one number per step.

use anyhow::{bail, Result};
use ringtrain::backend::Backend;
use ringtrain::model::{Gpt2, ModelConfig, ParamLayout};
use ringtrain::optim::{AdamW, AdamWConfig};
use std::time::Instant;

/// A stretch of compute and the flat offset that bounds it (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Segment {
    /// Forward: the parameters `..bound` must be current before it runs. Backward: the gradients
    /// `bound..` are final after it.
    pub bound: usize,
    pub seconds: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ComputeProfile {
    /// One micro-batch's forward, in run order.
    pub forward: Vec<Segment>,
    /// One micro-batch's backward, in run order (the last has `bound` 0).
    pub backward: Vec<Segment>,
    /// The optimizer update over every parameter (a sharded rank updates its share of it).
    pub update_s: f64,
    /// Where the figures came from, for reports.
    pub source: String,
}

impl ComputeProfile {
    pub fn forward_s(&self) -> f64 {
        self.forward.iter().map(|s| s.seconds).sum()
    }

    pub fn backward_s(&self) -> f64 {
        self.backward.iter().map(|s| s.seconds).sum()
    }

    /// Given totals for one micro-batch, split over the layers in proportion to the weights each
    /// segment multiplies by (matmul FLOPs scale with them; attention's `t²` terms and element-wise ops
    /// are left out: a measured profile has them).
    pub fn given(config: &ModelConfig, forward_s: f64, backward_s: f64, update_s: f64) -> Result<Self> {
        for (what, x) in [("forward", forward_s), ("backward", backward_s), ("update", update_s)] {
            if !(x.is_finite() && x >= 0.0) {
                bail!("--compute-ms {what} must be a finite, non-negative number of milliseconds");
            }
        }
        config.validate()?;
        let lay = ParamLayout::new(config);
        let (c, v) = (config.n_embd, config.vocab_size);
        let spread = |weights: Vec<(usize, usize)>, total: f64| {
            let sum: usize = weights.iter().map(|w| w.1).sum();
            weights
                .into_iter()
                .map(|(bound, w)| Segment {
                    bound,
                    seconds: total * w as f64 / sum.max(1) as f64,
                })
                .collect::<Vec<_>>()
        };
        // Forward: the embedding lookup, each block, then the final norm and the tied head (v × c).
        let block_end = |l: usize| lay.blocks.get(l + 1).map_or(lay.ln_f_w, |next| next.ln_1_w);
        let first = lay.blocks.first().map_or(lay.ln_f_w, |b| b.ln_1_w);
        let mut forward = vec![(first, 0)];
        forward.extend((0..lay.blocks.len()).map(|l| (block_end(l), block_end(l) - lay.blocks[l].ln_1_w)));
        forward.push((lay.total, v * c));
        // Backward: the head, then each block's ops from the last block down (each weighs the elements it
        // finishes, i.e. its weights), then the embedding backward.
        let mut backward = vec![(lay.ln_f_w, v * c)];
        let mut end = lay.ln_f_w;
        for b in lay.blocks.iter().rev() {
            for from in [b.fc_proj_w, b.fc_w, b.ln_2_w, b.attn_proj_w, b.attn_w, b.ln_1_w] {
                backward.push((from, end - from));
                end = from;
            }
        }
        backward.push((0, config.n_positions * c));
        Ok(ComputeProfile {
            forward: spread(forward, forward_s),
            backward: spread(backward, backward_s),
            update_s,
            source: format!(
                "given: forward {:.1} ms, backward {:.1} ms, update {:.1} ms per micro-batch",
                forward_s * 1e3,
                backward_s * 1e3,
                update_s * 1e3
            ),
        })
    }

    /// Runs the model on `be` for `steps` forward/backward passes of a `[batch, seq]` micro-batch (plus one
    /// warm-up) and one AdamW update each, timing every segment with a synchronisation at its bounds; keeps
    /// the fastest time of each segment.
    pub fn measure<B: Backend>(
        be: &mut B,
        backend_name: &str,
        config: &ModelConfig,
        batch: usize,
        seq: usize,
        steps: usize,
    ) -> Result<Self> {
        if steps == 0 {
            bail!("measuring a compute profile needs at least one step");
        }
        let lay = ParamLayout::new(config);
        let init = ringtrain::model::init::init_params(config, &lay, 1337);
        let mut model = Gpt2::new(be, config.clone(), &init)?;
        let mut opt = AdamW::new(be, AdamWConfig::default(), lay.total)?;
        // Any tokens do: the time does not depend on their values.
        let tokens: Vec<u32> = (0..batch * seq + 1)
            .map(|i| ((i as u64 * 2_654_435_761) % config.vocab_size as u64) as u32)
            .collect();
        let (inputs, targets) = (&tokens[..batch * seq], &tokens[1..]);
        let dloss = 1.0 / (batch * seq) as f32;
        let mut best: Option<ComputeProfile> = None;
        for _ in 0..=steps {
            model.zero_grads(be);
            be.synchronize()?;
            let mut forward: Vec<Segment> = Vec::new();
            let mut mark = Instant::now();
            model.forward_train(be, inputs, targets, batch, seq, Some(dloss), &mut |be, upto| {
                be.synchronize()?;
                if let Some(last) = forward.last_mut() {
                    last.seconds = mark.elapsed().as_secs_f64();
                }
                forward.push(Segment {
                    bound: upto,
                    seconds: 0.0,
                });
                mark = Instant::now();
                Ok(())
            })?;
            be.synchronize()?;
            if let Some(last) = forward.last_mut() {
                last.seconds = mark.elapsed().as_secs_f64();
            }
            let mut backward = Vec::new();
            let mut mark = Instant::now();
            model.backward_reporting(be, dloss, &mut |be, from| {
                be.synchronize()?;
                backward.push(Segment {
                    bound: from,
                    seconds: mark.elapsed().as_secs_f64(),
                });
                mark = Instant::now();
                Ok(())
            })?;
            let update = Instant::now();
            opt.update(be, &model.layout, model.params, model.grads, 1e-4, 1.0)?;
            be.synchronize()?;
            let run = ComputeProfile {
                forward,
                backward,
                update_s: update.elapsed().as_secs_f64(),
                source: String::new(),
            };
            best = Some(match best {
                // The first pass warms caches and allocates; it is not kept.
                None => ComputeProfile {
                    update_s: f64::INFINITY,
                    ..run
                },
                Some(b) => b.fastest(&run)?,
            });
        }
        let mut profile = best.expect("at least two passes ran");
        profile.source = format!(
            "measured on {backend_name}: {} at batch {batch} × {seq}, fastest of {steps} passes per layer",
            model_name(config)
        );
        Ok(profile)
    }

    /// Per segment, the faster of two runs of the same model.
    fn fastest(self, other: &ComputeProfile) -> Result<ComputeProfile> {
        let pick = |a: Vec<Segment>, b: &[Segment]| -> Result<Vec<Segment>> {
            if a.len() != b.len() || a.iter().zip(b).any(|(x, y)| x.bound != y.bound) {
                bail!("two passes of the same model reported different layers");
            }
            Ok(a.into_iter()
                .zip(b)
                .map(|(x, y)| Segment {
                    bound: x.bound,
                    seconds: x.seconds.min(y.seconds),
                })
                .collect())
        };
        let warm_up_pass = self.update_s.is_infinite();
        Ok(ComputeProfile {
            forward: if warm_up_pass {
                other.forward.clone()
            } else {
                pick(self.forward, &other.forward)?
            },
            backward: if warm_up_pass {
                other.backward.clone()
            } else {
                pick(self.backward, &other.backward)?
            },
            update_s: self.update_s.min(other.update_s),
            source: self.source,
        })
    }
}

fn model_name(config: &ModelConfig) -> String {
    format!("{} layers × {} wide", config.n_layer, config.n_embd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_totals_are_spread_in_backward_order() {
        let cfg = ModelConfig::tiny();
        let p = ComputeProfile::given(&cfg, 0.010, 0.020, 0.005).unwrap();
        assert!((p.forward_s() - 0.010).abs() < 1e-12);
        assert!((p.backward_s() - 0.020).abs() < 1e-12);
        let bounds: Vec<usize> = p.backward.iter().map(|s| s.bound).collect();
        assert!(
            bounds.windows(2).all(|w| w[0] > w[1]),
            "backward finishes a shrinking suffix"
        );
        assert_eq!(bounds.last(), Some(&0));
        let uptos: Vec<usize> = p.forward.iter().map(|s| s.bound).collect();
        assert!(
            uptos.windows(2).all(|w| w[0] < w[1]),
            "forward reaches a growing prefix"
        );
        assert!(ComputeProfile::given(&cfg, -1.0, 0.0, 0.0).is_err());
    }

    #[test]
    fn measured_profile_has_the_models_layers() {
        let cfg = ModelConfig::tiny();
        let (mut be, _) =
            ringtrain::backend::factory::open(ringtrain::backend::factory::BackendChoice::Cpu, 0).unwrap();
        let measured = ComputeProfile::measure(&mut be, "cpu", &cfg, 2, 16, 2).unwrap();
        let given = ComputeProfile::given(&cfg, 1.0, 1.0, 1.0).unwrap();
        let bounds = |s: &[Segment]| s.iter().map(|x| x.bound).collect::<Vec<_>>();
        assert_eq!(bounds(&measured.forward), bounds(&given.forward));
        assert_eq!(bounds(&measured.backward), bounds(&given.backward));
        assert!(measured.backward_s() > 0.0 && measured.update_s.is_finite());
    }
}
