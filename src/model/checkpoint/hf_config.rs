//! The mapping between [`ModelConfig`] and a Hugging Face `GPT2Config` (`config.json`).
//!
//! Writing produces a config `transformers` accepts for `GPT2LMHeadModel`. Reading accepts any GPT-2 config
//! whose numerics match ours (ARCHITECTURE.md, "Numerics") and rejects, with the field named, the
//! options that would make our forward pass differ from the one the weights were trained with.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use crate::model::ModelConfig;

/// The layer-norm epsilon of the numerics contract.
const LAYER_NORM_EPS: f64 = 1e-5;
/// Activation names meaning the tanh approximation of GELU, which is what we compute.
const TANH_GELUS: [&str; 2] = ["gelu_new", "gelu_pytorch_tanh"];
/// The GPT-2 BPE vocabulary size: its end-of-text token (50256) is also the BOS/EOS id.
const GPT2_VOCAB: usize = 50257;

/// A Hugging Face `GPT2Config` for `cfg`: dropout off, tied head, `gelu_new`, eps 1e-5.
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    let special = if cfg.vocab_size == GPT2_VOCAB {
        GPT2_VOCAB - 1
    } else {
        0
    };
    json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_ctx": cfg.n_positions,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "add_cross_attention": false,
        "tie_word_embeddings": true,
        "use_cache": true,
        "bos_token_id": special,
        "eos_token_id": special,
    })
}

/// Parses a Hugging Face GPT-2 `config.json` into a validated [`ModelConfig`].
///
/// `n_positions` is preferred and `n_ctx` accepted when it is absent (old configs). Options that change the
/// numerics (activation, epsilon, `n_inner`, attention scaling, untied head, cross-attention) are rejected
/// rather than silently ignored, because the model would load and then compute something else.
pub fn config_from_hf_json(text: &str) -> Result<ModelConfig> {
    let value: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
    let Some(obj) = value.as_object() else {
        bail!("config.json must be a JSON object, found {}", kind(&value));
    };
    check_model_type(obj)?;
    let n_positions = match optional(obj, "n_positions") {
        Some(_) => usize_field(obj, "n_positions")?,
        None if optional(obj, "n_ctx").is_some() => usize_field(obj, "n_ctx")?,
        None => bail!("config.json: missing \"n_positions\" (or \"n_ctx\")"),
    };
    let cfg = ModelConfig {
        n_layer: usize_field(obj, "n_layer")?,
        n_embd: usize_field(obj, "n_embd")?,
        n_head: usize_field(obj, "n_head")?,
        vocab_size: usize_field(obj, "vocab_size")?,
        n_positions,
    };
    check_numerics(obj, &cfg)?;
    cfg.validate().context("config.json")?;
    Ok(cfg)
}

/// A field that is present and not null.
fn optional<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn usize_field(obj: &Map<String, Value>, key: &str) -> Result<usize> {
    let Some(value) = optional(obj, key) else {
        bail!("config.json: missing \"{key}\"");
    };
    value
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .with_context(|| format!("config.json: \"{key}\" must be a non-negative integer, found {value}"))
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check_model_type(obj: &Map<String, Value>) -> Result<()> {
    match optional(obj, "model_type") {
        None => Ok(()),
        Some(Value::String(t)) if t == "gpt2" => Ok(()),
        Some(other) => bail!("config.json: model_type {other} is not supported; only \"gpt2\" is"),
    }
}

/// Rejects every option whose value would make our forward pass differ from Hugging Face's.
fn check_numerics(obj: &Map<String, Value>, cfg: &ModelConfig) -> Result<()> {
    if let Some(act) = optional(obj, "activation_function") {
        if !act.as_str().is_some_and(|a| TANH_GELUS.contains(&a)) {
            bail!("config.json: activation_function {act} is not supported; only \"gelu_new\" (tanh GELU) is");
        }
    }
    if let Some(eps) = optional(obj, "layer_norm_epsilon") {
        let ok = eps
            .as_f64()
            .is_some_and(|e| (e - LAYER_NORM_EPS).abs() <= LAYER_NORM_EPS * 1e-6);
        if !ok {
            bail!("config.json: layer_norm_epsilon {eps} is not supported; the numerics contract fixes it at 1e-5");
        }
    }
    if let Some(inner) = optional(obj, "n_inner") {
        if inner.as_u64() != Some(4 * cfg.n_embd as u64) {
            bail!("config.json: n_inner {inner} is not supported; the MLP width must be 4 * n_embd");
        }
    }
    require_bool(
        obj,
        "scale_attn_weights",
        true,
        "attention must be scaled by 1/sqrt(head_dim)",
    )?;
    require_bool(
        obj,
        "scale_attn_by_inverse_layer_idx",
        false,
        "per-layer attention scaling is not implemented",
    )?;
    require_bool(
        obj,
        "tie_word_embeddings",
        true,
        "only an LM head tied to wte is supported",
    )?;
    require_bool(obj, "add_cross_attention", false, "cross-attention is not supported")
}

/// A boolean option that, when present, must have the one value we implement.
fn require_bool(obj: &Map<String, Value>, key: &str, want: bool, why: &str) -> Result<()> {
    match optional(obj, key) {
        None => Ok(()),
        Some(Value::Bool(b)) if *b == want => Ok(()),
        Some(other) => bail!("config.json: {key} = {other} is not supported ({why})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_through_json() {
        for cfg in [ModelConfig::tiny(), ModelConfig::gpt2()] {
            let text = hf_config_json(&cfg).to_string();
            assert_eq!(config_from_hf_json(&text).unwrap(), cfg);
        }
    }

    #[test]
    fn special_tokens_follow_vocab() {
        assert_eq!(hf_config_json(&ModelConfig::gpt2())["eos_token_id"], 50256);
        assert_eq!(hf_config_json(&ModelConfig::tiny())["bos_token_id"], 0);
    }

    #[test]
    fn n_ctx_is_accepted_without_n_positions() {
        let text = r#"{"n_layer":1,"n_embd":8,"n_head":2,"vocab_size":10,"n_ctx":16}"#;
        assert_eq!(config_from_hf_json(text).unwrap().n_positions, 16);
    }

    #[test]
    fn rejections_name_the_field() {
        let base = hf_config_json(&ModelConfig::tiny());
        let cases: [(&str, Value); 6] = [
            ("activation_function", json!("relu")),
            ("layer_norm_epsilon", json!(1e-6)),
            ("n_inner", json!(100)),
            ("n_embd", json!(-3)),
            ("tie_word_embeddings", json!(false)),
            ("model_type", json!("llama")),
        ];
        for (key, bad) in cases {
            let mut v = base.clone();
            v[key] = bad;
            let err = config_from_hf_json(&v.to_string()).unwrap_err();
            assert!(format!("{err:#}").contains(key), "{key}: {err:#}");
        }
    }

    #[test]
    fn invalid_shapes_fail_validation() {
        let text = r#"{"n_layer":1,"n_embd":10,"n_head":3,"vocab_size":10,"n_positions":16}"#;
        let err = config_from_hf_json(text).unwrap_err();
        assert!(format!("{err:#}").contains("n_head"), "{err:#}");
    }
}
