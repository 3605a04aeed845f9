//! `ringtrain sample`: text from a checkpoint, with temperature and top-k.

use anyhow::{bail, ensure, Result};
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::data::{Tokenizer, TokenizerKind};
use ringtrain::model::{checkpoint, Gpt2, ModelConfig};
use std::path::Path;

/// The tokenizer a checkpoint was trained with, from its vocabulary size.
pub fn tokenizer_for(cfg: &ModelConfig) -> Result<Tokenizer> {
    let kind = match cfg.vocab_size {
        256 => TokenizerKind::Byte,
        v if v >= ringtrain::data::GPT2_VOCAB_SIZE => TokenizerKind::Gpt2,
        v => bail!("cannot tell the tokenizer of a model with vocabulary {v}: expected 256 (byte) or >= 50257 (gpt2)"),
    };
    Ok(Tokenizer::new(kind)?)
}

pub struct SampleOptions {
    pub prompt: String,
    pub tokens: usize,
    pub temperature: f64,
    pub top_k: usize,
    pub seed: u64,
}

/// Index drawn from `logits / temperature` restricted to the `top_k` largest (0: all); greedy at temperature 0.
pub fn sample_token(logits: &[f32], temperature: f64, top_k: usize, rng: &mut ChaCha8Rng) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if temperature <= 0.0 {
        return order[0];
    }
    let keep = if top_k == 0 {
        order.len()
    } else {
        top_k.min(order.len())
    };
    let top = &order[..keep];
    let max = logits[top[0]] as f64;
    let weights: Vec<f64> = top
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    let mut acc = 0.0;
    for (&i, w) in top.iter().zip(&weights) {
        acc += w;
        if u < acc {
            return i;
        }
    }
    top[keep - 1]
}

pub fn run_sample(dir: &Path, o: &SampleOptions) -> Result<()> {
    ensure!(
        o.temperature.is_finite() && o.temperature >= 0.0,
        "--temperature must be a non-negative number"
    );
    let dir = checkpoint::resolve_checkpoint_dir(dir)?;
    let (cfg, params) = checkpoint::load_model(&dir)?;
    let tokenizer = tokenizer_for(&cfg)?;
    let mut ids: Vec<u32> = tokenizer.encode(&o.prompt);
    if ids.is_empty() {
        // An empty prompt starts from a newline (byte) or end-of-text (gpt2).
        ids.push(if cfg.vocab_size == 256 {
            b'\n' as u32
        } else {
            ringtrain::data::GPT2_EOT
        });
    }
    let (mut be, _) = factory::open(BackendChoice::Cpu, 0)?;
    let mut model = Gpt2::new(&mut be, cfg.clone(), &params)?;
    let mut rng = ChaCha8Rng::seed_from_u64(o.seed);
    let window = cfg.n_positions;
    let prompt_len = ids.len();
    // One fixed shape [1, window]: causal attention makes padding after the last real token harmless.
    let mut input = vec![0u32; window];
    for _ in 0..o.tokens {
        let start = ids.len().saturating_sub(window);
        let ctx = &ids[start..];
        input[..ctx.len()].copy_from_slice(ctx);
        let logits = model.logits(&mut be, &input, 1, window)?;
        let last = &logits[(ctx.len() - 1) * cfg.vocab_size..ctx.len() * cfg.vocab_size];
        ids.push(sample_token(last, o.temperature, o.top_k, &mut rng) as u32);
    }
    print!("{}", tokenizer.decode(&ids[..prompt_len]));
    println!("{}", tokenizer.decode(&ids[prompt_len..]));
    Ok(())
}
