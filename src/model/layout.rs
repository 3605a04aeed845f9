//! The flat parameter layout: every GPT-2 tensor is a named view into one buffer, in the order of Hugging
//! Face's `named_parameters()` (without the `transformer.` prefix). Gradients and the AdamW moments use the
//! same layout, so a flat range means the same tensors in each of them.

use super::config::ModelConfig;

/// One named tensor of the flat parameter buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Hugging Face name without the `transformer.` prefix, e.g. `h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape as stored; Conv1D weights are `[in, out]`.
    pub shape: Vec<usize>,
    /// Element offset into the flat buffer.
    pub offset: usize,
    pub len: usize,
}

impl ParamSpec {
    /// AdamW decays tensors of rank >= 2 only (not biases or layer-norm parameters).
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// Offsets of one transformer block's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockParams {
    pub ln_1_w: usize,
    pub ln_1_b: usize,
    pub attn_w: usize,
    pub attn_b: usize,
    pub attn_proj_w: usize,
    pub attn_proj_b: usize,
    pub ln_2_w: usize,
    pub ln_2_b: usize,
    pub fc_w: usize,
    pub fc_b: usize,
    pub fc_proj_w: usize,
    pub fc_proj_b: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    pub specs: Vec<ParamSpec>,
    pub total: usize,
    pub wte: usize,
    pub wpe: usize,
    pub blocks: Vec<BlockParams>,
    pub ln_f_w: usize,
    pub ln_f_b: usize,
}

impl ParamLayout {
    pub fn new(cfg: &ModelConfig) -> Self {
        let (c, v, t) = (cfg.n_embd, cfg.vocab_size, cfg.n_positions);
        let mut specs = Vec::new();
        let mut total = 0usize;
        let mut push = |name: String, shape: Vec<usize>| -> usize {
            let len = shape.iter().product();
            let offset = total;
            specs.push(ParamSpec {
                name,
                shape,
                offset,
                len,
            });
            total += len;
            offset
        };
        let wte = push("wte.weight".into(), vec![v, c]);
        let wpe = push("wpe.weight".into(), vec![t, c]);
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let p = |s: &str| format!("h.{l}.{s}");
            blocks.push(BlockParams {
                ln_1_w: push(p("ln_1.weight"), vec![c]),
                ln_1_b: push(p("ln_1.bias"), vec![c]),
                attn_w: push(p("attn.c_attn.weight"), vec![c, 3 * c]),
                attn_b: push(p("attn.c_attn.bias"), vec![3 * c]),
                attn_proj_w: push(p("attn.c_proj.weight"), vec![c, c]),
                attn_proj_b: push(p("attn.c_proj.bias"), vec![c]),
                ln_2_w: push(p("ln_2.weight"), vec![c]),
                ln_2_b: push(p("ln_2.bias"), vec![c]),
                fc_w: push(p("mlp.c_fc.weight"), vec![c, 4 * c]),
                fc_b: push(p("mlp.c_fc.bias"), vec![4 * c]),
                fc_proj_w: push(p("mlp.c_proj.weight"), vec![4 * c, c]),
                fc_proj_b: push(p("mlp.c_proj.bias"), vec![c]),
            });
        }
        let ln_f_w = push("ln_f.weight".into(), vec![c]);
        let ln_f_b = push("ln_f.bias".into(), vec![c]);
        ParamLayout {
            specs,
            total,
            wte,
            wpe,
            blocks,
            ln_f_w,
            ln_f_b,
        }
    }

    pub fn get(&self, name: &str) -> Option<&ParamSpec> {
        self.specs.iter().find(|s| s.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_matches_the_config_count() {
        let custom = ModelConfig {
            n_layer: 3,
            n_embd: 48,
            n_head: 3,
            vocab_size: 300,
            n_positions: 40,
        };
        for cfg in [ModelConfig::tiny(), ModelConfig::small(), ModelConfig::gpt2(), custom] {
            assert_eq!(ParamLayout::new(&cfg).total, cfg.param_count(), "{cfg:?}");
        }
    }
}
