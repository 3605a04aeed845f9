//! `config.json` + `model.safetensors`: the Hugging Face half of a checkpoint.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

use super::hf_config::{config_from_hf_json, hf_config_json};
use super::tensor_io::{
    self, decode_into, decoded_equals, with_safetensors, with_safetensors_bytes, write_small_file, write_tensors,
    F32View,
};
use super::{CONFIG_FILE, HF_PREFIX, MODEL_FILE};
use crate::model::{ModelConfig, ParamLayout, ParamSpec};

/// A config.json larger than this is not a GPT-2 config; refusing it bounds what we read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The untied-head key `GPT2LMHeadModel` may store; we accept it only as an exact copy of `wte`.
const LM_HEAD_KEY: &str = "lm_head.weight";
/// Error lists stop after this many names; the count says how many there were.
const MAX_LISTED: usize = 8;

/// Writes `config.json` and `model.safetensors` into an existing directory, fsyncing both.
///
/// This is not atomic on its own: [`super::save_checkpoint`] calls it on a fresh temporary directory.
pub fn save_model_files(dir: &Path, cfg: &ModelConfig, layout: &ParamLayout, params: &[f32]) -> Result<()> {
    check_params(cfg, layout, params)?;
    write_config(dir, cfg)?;
    write_model(dir, layout, params)
}

/// Loads a Hugging Face GPT-2 directory (ours or one saved by `transformers`) into a config and a flat
/// parameter buffer in [`ParamLayout`] order. Recovers from an interrupted save (see
/// [`super::resolve_checkpoint_dir`]).
pub fn load_model(dir: &Path) -> Result<(ModelConfig, Vec<f32>)> {
    let dir = super::resolve_checkpoint_dir(dir)?;
    let cfg = read_config(&dir)?;
    let path = dir.join(MODEL_FILE);
    let params = with_safetensors(&path, |st, _| {
        read_params(st, &cfg).with_context(|| format!("loading {}", path.display()))
    })?;
    Ok((cfg, params))
}

/// [`load_model`] over the two files already in memory (`config.json` and `model.safetensors`), with the
/// same checks; lets tests and fuzzers drive the loader without a file system.
pub fn load_model_bytes(config_json: &[u8], model: &[u8]) -> Result<(ModelConfig, Vec<f32>)> {
    let cfg = parse_config(config_json, CONFIG_FILE)?;
    let params = with_safetensors_bytes(model, MODEL_FILE, |st, _| {
        read_params(st, &cfg).with_context(|| format!("loading {MODEL_FILE}"))
    })?;
    Ok((cfg, params))
}

/// Rejects a save whose buffer or layout does not belong to `cfg`, before anything is written.
pub(crate) fn check_params(cfg: &ModelConfig, layout: &ParamLayout, params: &[f32]) -> Result<()> {
    cfg.validate()?;
    if *layout != ParamLayout::new(cfg) {
        bail!("checkpoint save: the parameter layout does not belong to the model config {cfg:?}");
    }
    if params.len() != layout.total {
        bail!(
            "checkpoint save: {} parameters given, the layout holds {}",
            params.len(),
            layout.total
        );
    }
    Ok(())
}

pub(crate) fn write_config(dir: &Path, cfg: &ModelConfig) -> Result<()> {
    let text = serde_json::to_string_pretty(&hf_config_json(cfg))? + "\n";
    write_small_file(&dir.join(CONFIG_FILE), text.as_bytes())
}

/// Streams every tensor from its slice of the flat buffer; no second copy of the model is built.
pub(crate) fn write_model(dir: &Path, layout: &ParamLayout, params: &[f32]) -> Result<()> {
    let tensors = layout
        .specs
        .iter()
        .map(|s| {
            (
                format!("{HF_PREFIX}{}", s.name),
                F32View {
                    shape: s.shape.clone(),
                    data: slice(params, s),
                },
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_tensors(&dir.join(MODEL_FILE), tensors, meta)
}

pub(crate) fn slice<'a>(buf: &'a [f32], spec: &ParamSpec) -> &'a [f32] {
    &buf[spec.offset..spec.offset + spec.len]
}

pub(crate) fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join(CONFIG_FILE);
    let bytes = tensor_io::read_small_file(&path, MAX_CONFIG_BYTES)?;
    parse_config(&bytes, &path.display().to_string())
}

/// A whole `config.json` (`name` for messages): small UTF-8 JSON describing a GPT-2 we can run.
fn parse_config(bytes: &[u8], name: &str) -> Result<ModelConfig> {
    let text = tensor_io::check_small(bytes, MAX_CONFIG_BYTES, name)?;
    config_from_hf_json(text).with_context(|| format!("reading {name}"))
}

/// Where each expected tensor lives in the file.
struct Plan<'a, 'data> {
    params: Vec<(&'a ParamSpec, String, TensorView<'data>)>,
    lm_head: Option<TensorView<'data>>,
}

/// Checks names, shapes and dtypes of the whole file, then allocates and decodes. Every allocation is
/// therefore bounded by what the file really holds, whatever config.json claims: the layout (a name per
/// tensor) is only built when the file holds at least half as many tensors, enough to name the missing ones
/// of a damaged file at a cost proportional to its own index; the parameter buffer only once every tensor
/// has its expected shape.
fn read_params(st: &SafeTensors<'_>, cfg: &ModelConfig) -> Result<Vec<f32>> {
    let needed = tensor_count(cfg);
    if needed > st.len().saturating_mul(2) {
        bail!(
            "holds {} tensors, but config.json (n_layer {}) describes a GPT-2 of {needed}",
            st.len(),
            cfg.n_layer
        );
    }
    let layout = &ParamLayout::new(cfg);
    let plan = plan_tensors(st, cfg, layout)?;
    let mut params = vec![0f32; layout.total];
    for (spec, key, view) in &plan.params {
        decode_into(view, key, &mut params[spec.offset..spec.offset + spec.len])?;
    }
    if let Some(view) = &plan.lm_head {
        let wte = &layout.specs[0];
        if !decoded_equals(view, LM_HEAD_KEY, slice(&params, wte))? {
            bail!(
                "{LM_HEAD_KEY} differs from {}; only LM heads tied to the token embedding are supported",
                wte.name
            );
        }
    }
    Ok(params)
}

/// The number of parameter tensors of a GPT-2 of `cfg`, as [`ParamLayout::new`] lays them out: wte, wpe,
/// 12 per block, ln_f weight and bias. Saturates rather than overflowing for absurd layer counts.
fn tensor_count(cfg: &ModelConfig) -> usize {
    cfg.n_layer.saturating_mul(12).saturating_add(4)
}

fn plan_tensors<'a, 'data>(
    st: &SafeTensors<'data>,
    cfg: &ModelConfig,
    layout: &'a ParamLayout,
) -> Result<Plan<'a, 'data>> {
    let by_name: HashMap<&str, &ParamSpec> = layout.specs.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut found: HashMap<&str, (String, TensorView<'data>)> = HashMap::new();
    let (mut unknown, mut lm_head) = (BTreeSet::new(), None);
    for (key, view) in st.iter() {
        let name = key.strip_prefix(HF_PREFIX).unwrap_or(key);
        if key == LM_HEAD_KEY {
            lm_head = Some(view);
        } else if let Some(spec) = by_name.get(name) {
            if let Some((other, _)) = found.insert(spec.name.as_str(), (key.to_string(), view)) {
                bail!("holds both {other} and {key}, which name the same parameter");
            }
        } else if !is_attention_buffer(name, cfg.n_layer) {
            unknown.insert(key.to_string());
        }
    }
    if !unknown.is_empty() {
        bail!(
            "unknown tensors (not part of a GPT-2 with this config.json): {}",
            list(&unknown)
        );
    }
    let prefix = if found.values().any(|(k, _)| k.starts_with(HF_PREFIX)) {
        HF_PREFIX
    } else {
        ""
    };
    let (mut params, mut missing) = (Vec::with_capacity(layout.specs.len()), Vec::new());
    for spec in &layout.specs {
        match found.remove(spec.name.as_str()) {
            Some((key, view)) => params.push((spec, key, view)),
            None => missing.push(format!("{prefix}{}", spec.name)),
        }
    }
    if !missing.is_empty() {
        bail!("missing tensors: {}", list(&missing));
    }
    for (spec, key, view) in &params {
        check_tensor(key, view, &spec.shape, cfg)?;
    }
    if let Some(view) = &lm_head {
        check_tensor(LM_HEAD_KEY, view, &layout.specs[0].shape, cfg)?;
    }
    Ok(Plan { params, lm_head })
}

/// The exact shape the config implies, and a dtype we can convert.
fn check_tensor(key: &str, view: &TensorView<'_>, expected: &[usize], cfg: &ModelConfig) -> Result<()> {
    if view.shape() != expected {
        bail!(
            "tensor {key} has shape {:?}, but config.json (n_layer {}, n_embd {}, vocab_size {}, n_positions {}) \
             expects {expected:?}",
            view.shape(),
            cfg.n_layer,
            cfg.n_embd,
            cfg.vocab_size,
            cfg.n_positions
        );
    }
    tensor_io::float_width(view.dtype(), key).map(|_| ())
}

/// `h.N.attn.bias` / `h.N.attn.masked_bias`: the causal-mask buffers old `transformers` versions saved.
/// They hold no parameters, so we skip them.
fn is_attention_buffer(name: &str, n_layer: usize) -> bool {
    let Some(rest) = name.strip_prefix("h.") else {
        return false;
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return false;
    };
    let layer_ok = layer.parse::<usize>().is_ok_and(|l| l < n_layer) && !layer.starts_with('+');
    layer_ok && (tail == "attn.bias" || tail == "attn.masked_bias")
}

/// A readable, bounded list of names for an error message.
fn list<S: AsRef<str>>(names: impl IntoIterator<Item = S>) -> String {
    let names: Vec<S> = names.into_iter().collect();
    let shown: Vec<&str> = names.iter().take(MAX_LISTED).map(|s| s.as_ref()).collect();
    match names.len() {
        n if n > MAX_LISTED => format!("{} … ({n} in all)", shown.join(", ")),
        _ => shown.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_buffers_are_recognised() {
        assert!(is_attention_buffer("h.0.attn.bias", 2));
        assert!(is_attention_buffer("h.1.attn.masked_bias", 2));
        assert!(!is_attention_buffer("h.2.attn.bias", 2));
        assert!(!is_attention_buffer("h.0.attn.c_attn.bias", 2));
        assert!(!is_attention_buffer("h.+0.attn.bias", 2));
    }

    #[test]
    fn tensor_count_matches_the_layout() {
        for n_layer in [1, 2, 5] {
            let cfg = ModelConfig {
                n_layer,
                ..ModelConfig::tiny()
            };
            assert_eq!(tensor_count(&cfg), ParamLayout::new(&cfg).specs.len());
        }
        assert_eq!(tensor_count(&ModelConfig::gpt2()), 148);
    }

    #[test]
    fn long_lists_are_cut() {
        let names: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
        let text = list(&names);
        assert!(
            text.contains("k7") && !text.contains("k8,") && text.contains("20 in all"),
            "{text}"
        );
    }
}
