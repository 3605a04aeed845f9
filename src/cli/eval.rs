//! `ringtrain eval`: mean loss and perplexity of a checkpoint on a corpus; optionally dumps one batch of
//! logits for the Hugging Face cross-check (`scripts/hf_check.py`).

use super::sample::tokenizer_for;
use anyhow::{bail, Context, Result};
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::data::{eval_windows, fill_batch, load_eval_tokens};
use ringtrain::model::{checkpoint, Gpt2};
use std::path::Path;

pub struct EvalOptions {
    pub batch_size: usize,
    pub seq_len: Option<usize>,
    pub batches: usize,
    pub dump_logits: Option<std::path::PathBuf>,
}

pub fn run_eval(dir: &Path, data: &str, o: &EvalOptions) -> Result<()> {
    let dir = checkpoint::resolve_checkpoint_dir(dir)?;
    let (cfg, params) = checkpoint::load_model(&dir)?;
    let tokenizer = tokenizer_for(&cfg)?;
    let eval_data = load_eval_tokens(data, tokenizer.kind())?;
    let stream = eval_data.stream;
    stream.validate_vocab(cfg.vocab_size)?;
    let t = o.seq_len.unwrap_or(cfg.n_positions);
    if t == 0 || t > cfg.n_positions || o.batch_size == 0 {
        bail!(
            "--seq-len must be in 1..={} and --batch-size at least 1",
            cfg.n_positions
        );
    }
    let batches = eval_windows(stream.n_windows(t), o.batches, o.batch_size);
    if batches.is_empty() {
        bail!(
            "{data}: fewer than {} windows of {t} tokens to evaluate on",
            o.batch_size
        );
    }
    // stdout keeps its one JSON line; what was read goes to stderr.
    eprintln!("eval: reading {} ({} tokens)", eval_data.description, stream.len());
    let (mut be, _) = factory::open(BackendChoice::Cpu, 0)?;
    let mut model = Gpt2::new(&mut be, cfg.clone(), &params)?;
    let n = o.batch_size * t;
    let (mut inputs, mut targets) = (vec![0u32; n], vec![0u32; n]);
    if let Some(path) = &o.dump_logits {
        fill_batch(&stream, &batches[0], t, &mut inputs, &mut targets)?;
        let logits = model.logits(&mut be, &inputs, o.batch_size, t)?;
        dump_logits(path, &inputs, &logits, o.batch_size, t, cfg.vocab_size)?;
        eprintln!(
            "wrote {} ({} x {} inputs and their logits)",
            path.display(),
            o.batch_size,
            t
        );
    }
    let mut sum = 0.0;
    for windows in &batches {
        fill_batch(&stream, windows, t, &mut inputs, &mut targets)?;
        sum += model.forward(&mut be, &inputs, &targets, o.batch_size, t)?;
    }
    let loss = sum / batches.len() as f64;
    println!(
        "{}",
        serde_json::json!({"loss": loss, "perplexity": loss.exp(), "batches": batches.len(), "tokens": batches.len() * n})
    );
    Ok(())
}

/// `inputs` int32 [b, t] and `logits` f32 [b, t, v] as safetensors.
fn dump_logits(path: &Path, inputs: &[u32], logits: &[f32], b: usize, t: usize, v: usize) -> Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    let input_bytes: Vec<u8> = inputs.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
    let logit_bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let tensors = [
        ("inputs", TensorView::new(Dtype::I32, vec![b, t], &input_bytes)?),
        ("logits", TensorView::new(Dtype::F32, vec![b, t, v], &logit_bytes)?),
    ];
    safetensors::serialize_to_file(tensors, None, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
