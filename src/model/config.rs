//! GPT-2 model hyper-parameters: the presets, custom values and their limits (the Hugging Face `config.json`
//! mapping is `checkpoint/hf_config.rs`).

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// The shape of a GPT-2 model. `n_positions` is the longest sequence the position table holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub vocab_size: usize,
    pub n_positions: usize,
}

/// Upper bounds that keep a hostile config.json from asking for absurd allocations.
const MAX_LAYERS: usize = 1024;
const MAX_EMBD: usize = 1 << 16;
const MAX_VOCAB: usize = 1 << 20;
const MAX_POSITIONS: usize = 1 << 20;
const MAX_PARAMS: usize = 1 << 34;

impl ModelConfig {
    /// L=2, C=64, NH=4, T=64, V=256: the test model.
    pub fn tiny() -> Self {
        ModelConfig {
            n_layer: 2,
            n_embd: 64,
            n_head: 4,
            vocab_size: 256,
            n_positions: 64,
        }
    }

    /// L=4, C=128, NH=4, T=128, V=256.
    pub fn small() -> Self {
        ModelConfig {
            n_layer: 4,
            n_embd: 128,
            n_head: 4,
            vocab_size: 256,
            n_positions: 128,
        }
    }

    /// GPT-2 124M: L=12, C=768, NH=12, T=1024, V=50257.
    pub fn gpt2() -> Self {
        ModelConfig {
            n_layer: 12,
            n_embd: 768,
            n_head: 12,
            vocab_size: 50257,
            n_positions: 1024,
        }
    }

    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "small" => Ok(Self::small()),
            "gpt2" | "gpt2-124m" => Ok(Self::gpt2()),
            other => bail!("unknown model preset {other:?}: expected tiny, small or gpt2"),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Rejects shapes the model cannot run, with a message naming the field.
    pub fn validate(&self) -> Result<()> {
        let checks: [(&str, usize, usize); 4] = [
            ("n_layer", self.n_layer, MAX_LAYERS),
            ("n_embd", self.n_embd, MAX_EMBD),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("n_positions", self.n_positions, MAX_POSITIONS),
        ];
        for (name, value, max) in checks {
            if value == 0 || value > max {
                bail!("model config: {name} = {value} is out of range 1..={max}");
            }
        }
        if self.n_head == 0 || self.n_embd % self.n_head != 0 {
            bail!(
                "model config: n_embd = {} is not divisible by n_head = {}",
                self.n_embd,
                self.n_head
            );
        }
        let params = self.param_count();
        if params > MAX_PARAMS {
            bail!("model config: {params} parameters is more than this trainer supports ({MAX_PARAMS})");
        }
        Ok(())
    }

    /// Number of parameters, from the shape alone (so that a config can be bounded before anything is
    /// allocated); equals the `total` of its [`ParamLayout`](super::ParamLayout). Saturates at `usize::MAX`.
    pub fn param_count(&self) -> usize {
        let (c, v, t, l) = (
            self.n_embd as u128,
            self.vocab_size as u128,
            self.n_positions as u128,
            self.n_layer as u128,
        );
        // ln_1, c_attn, attn c_proj, ln_2, c_fc, mlp c_proj: weights and biases.
        let per_block = 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * c + (c * 4 * c + 4 * c) + (4 * c * c + c);
        // wte, wpe, the blocks, ln_f.
        let n = v * c + t * c + l * per_block + 2 * c;
        usize::try_from(n).unwrap_or(usize::MAX)
    }

    /// A stable digest of the shape, used in the hello handshake and checkpoint metadata.
    pub fn hash_hex(&self) -> String {
        let text = format!(
            "gpt2:L{}:C{}:H{}:V{}:T{}",
            self.n_layer, self.n_embd, self.n_head, self.vocab_size, self.n_positions
        );
        blake3::hash(text.as_bytes()).to_hex()[..16].to_string()
    }
}
