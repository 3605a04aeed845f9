//! Checkpoint format, loading of Hugging Face directories, corrupt inputs and crash-safe saving.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{BufWriter, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use ringtrain::model::checkpoint::{
    config_from_hf_json, hf_config_json, load_model, load_model_bytes, load_trainer_state, load_trainer_state_bytes,
    resolve_checkpoint_dir, save_checkpoint, save_checkpoint_with_hook, save_model_files, save_trainer_state,
    SaveStage, TrainerState,
};
use ringtrain::model::{ModelConfig, ParamLayout};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

mod common;

// ---------------------------------------------------------------------------------------------------------
// Helpers

/// Deterministic values covering the awkward bit patterns: -0.0, a subnormal, the extremes.
fn pattern(n: usize, salt: u32) -> Vec<f32> {
    let mut out: Vec<f32> = (0..n as u32)
        .map(|i| {
            let h = i.wrapping_add(salt).wrapping_mul(2_654_435_761).rotate_left(13) ^ salt;
            (h as f32 / u32::MAX as f32 - 0.5) * 0.2
        })
        .collect();
    for (slot, special) in out.iter_mut().zip([-0.0, f32::MIN_POSITIVE / 8.0, f32::MAX, -f32::MAX]) {
        *slot = special;
    }
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn state_for(layout: &ParamLayout, cfg: &ModelConfig, step: u64) -> TrainerState {
    TrainerState {
        step,
        tokens_seen: step * 4096,
        data_cursor: step * 16 + 3,
        world_size: 4,
        config_hash: cfg.hash_hex(),
        seed: 1337,
        m: pattern(layout.total, 100 + step as u32),
        v: pattern(layout.total, 200 + step as u32)
            .iter()
            .map(|x| x.abs())
            .collect(),
        extra: BTreeMap::from([
            ("train_args".to_string(), r#"{"lr":0.0006,"batch_size":8}"#.to_string()),
            ("rng".to_string(), "chacha:0123456789abcdef".to_string()),
        ]),
        sync: BTreeMap::from([
            ("anchor".to_string(), pattern(7, 300 + step as u32)),
            ("empty".to_string(), Vec::new()),
        ]),
    }
}

fn err_text<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

fn assert_err_mentions<T: std::fmt::Debug>(r: anyhow::Result<T>, needles: &[&str]) {
    let text = err_text(r);
    for n in needles {
        assert!(text.contains(n), "error {text:?} should mention {n:?}");
    }
}

/// A tiny checkpoint written by our own saver, with its parameters.
fn tiny_checkpoint(dir: &Path) -> (ModelConfig, ParamLayout, Vec<f32>) {
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let params = pattern(layout.total, 7);
    save_checkpoint(dir, &cfg, &layout, &params, Some(&state_for(&layout, &cfg, 1))).unwrap();
    (cfg, layout, params)
}

/// An owned tensor: dtype, shape, little-endian bytes.
type Owned = (Dtype, Vec<usize>, Vec<u8>);

fn read_tensors(path: &Path) -> BTreeMap<String, Owned> {
    let bytes = fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(k, v)| (k.to_string(), (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn write_tensors(path: &Path, tensors: &BTreeMap<String, Owned>, meta: HashMap<String, String>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(k, (d, s, b))| (k.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

/// Rewrites the tensors of `dir/<file>` through `edit`, keeping its metadata.
fn edit_tensors(dir: &Path, file: &str, edit: impl FnOnce(&mut BTreeMap<String, Owned>)) {
    let path = dir.join(file);
    let bytes = fs::read(&path).unwrap();
    let meta = SafeTensors::read_metadata(&bytes)
        .unwrap()
        .1
        .metadata()
        .clone()
        .unwrap_or_default();
    let mut tensors = read_tensors(&path);
    edit(&mut tensors);
    write_tensors(&path, &tensors, meta);
}

fn f32_le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Replaces the first occurrence of `from` in a file's bytes by `to`, of the same length, so the safetensors
/// header keeps its size.
fn patch_bytes(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut out = bytes.to_vec();
    if let Some(at) = bytes.windows(from.len()).position(|w| w == from.as_bytes()) {
        out[at..at + to.len()].copy_from_slice(to.as_bytes());
    }
    out
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

// ---------------------------------------------------------------------------------------------------------
// Format and roundtrip

#[test]
fn roundtrip_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let params = pattern(layout.total, 7);
    let state = state_for(&layout, &cfg, 42);
    save_checkpoint(&dir, &cfg, &layout, &params, Some(&state)).unwrap();

    let (cfg2, params2) = load_model(&dir).unwrap();
    assert_eq!(cfg2, cfg);
    assert!(same_bits(&params, &params2));
    let state2 = load_trainer_state(&dir, &layout).unwrap();
    assert!(same_bits(&state.m, &state2.m) && same_bits(&state.v, &state2.v));
    let strip = |s: &TrainerState| TrainerState {
        m: vec![],
        v: vec![],
        ..s.clone()
    };
    assert_eq!(strip(&state2), strip(&state));
    assert_eq!(dir_names(tmp.path()), ["ckpt"], "no temporary siblings may remain");

    // The in-memory loaders (what the fuzzers drive) read the same files to the same bits.
    let read = |name: &str| fs::read(dir.join(name)).unwrap();
    let (cfg3, params3) = load_model_bytes(&read("config.json"), &read("model.safetensors")).unwrap();
    assert_eq!(cfg3, cfg);
    assert!(same_bits(&params, &params3));
    let state3 = load_trainer_state_bytes(&read("trainer_state.safetensors"), &layout).unwrap();
    assert!(same_bits(&state.m, &state3.m) && same_bits(&state.v, &state3.v));
    assert_eq!(strip(&state3), strip(&state));
}

#[test]
fn files_follow_the_hugging_face_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, layout, params) = tiny_checkpoint(tmp.path());

    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(tmp.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(config["activation_function"], "gelu_new");
    assert_eq!(config["layer_norm_epsilon"], 1e-5);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["n_ctx"], cfg.n_positions);
    assert_eq!(config["resid_pdrop"], 0.0);

    let bytes = fs::read(tmp.path().join("model.safetensors")).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(header.metadata().as_ref().unwrap()["format"], "pt");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), layout.specs.len(), "lm_head must not be stored");
    for spec in &layout.specs {
        let view = st.tensor(&format!("transformer.{}", spec.name)).unwrap();
        assert_eq!(view.dtype(), Dtype::F32);
        assert_eq!(view.shape(), spec.shape.as_slice());
        assert_eq!(
            view.data(),
            f32_le(&params[spec.offset..spec.offset + spec.len]).as_slice()
        );
    }

    let st_bytes = fs::read(tmp.path().join("trainer_state.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    // Both moments of every parameter, and the two `sync.*` tensors of `state_for`.
    assert_eq!(st.len(), 2 * layout.specs.len() + 2);
    assert_eq!(
        st.tensor("exp_avg.wte.weight").unwrap().shape(),
        [cfg.vocab_size, cfg.n_embd]
    );
    assert_eq!(st.tensor("exp_avg_sq.ln_f.bias").unwrap().shape(), [cfg.n_embd]);
}

#[test]
fn keys_with_and_without_prefix_load_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, _, params) = tiny_checkpoint(tmp.path());
    edit_tensors(tmp.path(), "model.safetensors", |t| {
        *t = std::mem::take(t)
            .into_iter()
            .map(|(k, v)| (k.trim_start_matches("transformer.").to_string(), v))
            .collect();
    });
    assert!(read_tensors(&tmp.path().join("model.safetensors")).contains_key("wte.weight"));
    let (cfg2, params2) = load_model(tmp.path()).unwrap();
    assert_eq!(cfg2, cfg);
    assert!(same_bits(&params, &params2));
}

#[test]
fn old_hf_buffers_and_a_tied_lm_head_are_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, layout, params) = tiny_checkpoint(tmp.path());
    let t = cfg.n_positions;
    edit_tensors(tmp.path(), "model.safetensors", |m| {
        for l in 0..cfg.n_layer {
            m.insert(
                format!("transformer.h.{l}.attn.bias"),
                (Dtype::F32, vec![1, 1, t, t], vec![0; 4 * t * t]),
            );
            m.insert(format!("h.{l}.attn.masked_bias"), (Dtype::F32, vec![], f32_le(&[-1e4])));
        }
        let wte = &layout.specs[0];
        m.insert(
            "lm_head.weight".into(),
            (Dtype::F32, wte.shape.clone(), f32_le(&params[..wte.len])),
        );
    });
    let (_, loaded) = load_model(tmp.path()).unwrap();
    assert!(same_bits(&params, &loaded));
}

#[test]
fn an_untied_lm_head_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, layout, params) = tiny_checkpoint(tmp.path());
    let wte = &layout.specs[0];
    let mut head = params[..wte.len].to_vec();
    head[5] += 1.0;
    edit_tensors(tmp.path(), "model.safetensors", |m| {
        m.insert("lm_head.weight".into(), (Dtype::F32, wte.shape.clone(), f32_le(&head)));
    });
    assert_err_mentions(load_model(tmp.path()), &["lm_head.weight", "tied"]);
}

#[test]
fn half_precision_weights_are_widened_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, layout, _) = tiny_checkpoint(tmp.path());
    // Values exactly representable in both f16 and bf16: small multiples of 1/8.
    let values: Vec<f32> = (0..layout.total).map(|i| ((i % 33) as f32 - 16.0) / 8.0).collect();
    for dtype in [Dtype::F16, Dtype::BF16] {
        edit_tensors(tmp.path(), "model.safetensors", |m| {
            for spec in &layout.specs {
                let half: Vec<u8> = values[spec.offset..spec.offset + spec.len]
                    .iter()
                    .flat_map(|&x| {
                        if dtype == Dtype::F16 {
                            to_f16(x)
                        } else {
                            (x.to_bits() >> 16) as u16
                        }
                        .to_le_bytes()
                    })
                    .collect();
                m.insert(format!("transformer.{}", spec.name), (dtype, spec.shape.clone(), half));
            }
        });
        let (_, loaded) = load_model(tmp.path()).unwrap();
        assert!(same_bits(&values, &loaded), "{dtype:?}");
    }
}

/// f32 → f16 for values that are exact in f16 (normal range, 10 mantissa bits); enough for this test.
fn to_f16(x: f32) -> u16 {
    if x == 0.0 {
        return if x.is_sign_negative() { 0x8000 } else { 0 };
    }
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    assert!((1..31).contains(&exp) && bits & 0x1fff == 0, "{x} is not exact in f16");
    sign | ((exp as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
}

#[test]
fn the_pytorch_reference_checkpoint_loads() {
    let dir = common::pytorch_reference_dir().join("model");
    let (cfg, params) = load_model(&dir).unwrap();
    assert_eq!(cfg, ModelConfig::tiny());
    let layout = ParamLayout::new(&cfg);
    assert_eq!(params.len(), layout.total);
    let raw = read_tensors(&dir.join("model.safetensors"));
    for spec in &layout.specs {
        let (dtype, shape, bytes) = &raw[&format!("transformer.{}", spec.name)];
        assert_eq!((*dtype, shape), (Dtype::F32, &spec.shape));
        assert_eq!(
            bytes,
            &f32_le(&params[spec.offset..spec.offset + spec.len]),
            "{}",
            spec.name
        );
    }
    // LayerNorm init is 1/0, which tells us tensors landed at the right offsets.
    assert!(params[layout.ln_f_w..layout.ln_f_w + cfg.n_embd]
        .iter()
        .all(|&x| x == 1.0));
    assert!(params[layout.ln_f_b..layout.ln_f_b + cfg.n_embd]
        .iter()
        .all(|&x| x == 0.0));
}

// ---------------------------------------------------------------------------------------------------------
// GPT-2 124M shapes, written by hand in the layout `transformers` publishes (no prefix, attn.bias buffers)

/// A GPT-2 config.json in the style of the published one (dropout on, n_ctx, summary fields).
fn published_style_config(cfg: &ModelConfig) -> String {
    serde_json::json!({
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1,
        "bos_token_id": 50256, "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": cfg.n_positions, "n_positions": cfg.n_positions,
        "n_embd": cfg.n_embd, "n_head": cfg.n_head, "n_layer": cfg.n_layer,
        "summary_activation": null, "summary_first_dropout": 0.1, "summary_proj_to_labels": true,
        "summary_type": "cls_index", "summary_use_proj": true,
        "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
        "vocab_size": cfg.vocab_size
    })
    .to_string()
}

/// The value we write at element `j` of tensor number `t`: cheap to recompute, different per tensor.
fn cell(t: usize, j: usize) -> f32 {
    ((t * 7919 + j) % 65_521) as f32 / 1024.0
}

/// Streams a safetensors file tensor by tensor, so a 500 MB model never exists in memory while writing.
fn write_streamed(path: &Path, entries: &[(String, Vec<usize>)]) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0usize;
    for (key, shape) in entries {
        let bytes = 4 * shape.iter().product::<usize>();
        header.insert(
            key.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_string(&header).unwrap();
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let mut out = BufWriter::with_capacity(1 << 20, fs::File::create(path).unwrap());
    out.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    out.write_all(text.as_bytes()).unwrap();
    let mut chunk = Vec::with_capacity(1 << 20);
    for (t, (_, shape)) in entries.iter().enumerate() {
        let n: usize = shape.iter().product();
        for j in 0..n {
            chunk.extend_from_slice(&cell(t, j).to_le_bytes());
            if chunk.len() >= 1 << 20 {
                out.write_all(&chunk).unwrap();
                chunk.clear();
            }
        }
    }
    out.write_all(&chunk).unwrap();
    out.flush().unwrap();
}

fn hf_124m_style_dir(dir: &Path, cfg: &ModelConfig) {
    let layout = ParamLayout::new(cfg);
    let t = cfg.n_positions;
    let mut entries: Vec<(String, Vec<usize>)> =
        layout.specs.iter().map(|s| (s.name.clone(), s.shape.clone())).collect();
    for l in 0..cfg.n_layer {
        entries.push((format!("h.{l}.attn.bias"), vec![1, 1, t, t]));
    }
    fs::write(dir.join("config.json"), published_style_config(cfg)).unwrap();
    write_streamed(&dir.join("model.safetensors"), &entries);
}

fn check_124m_style(cfg: ModelConfig) {
    let tmp = tempfile::tempdir().unwrap();
    hf_124m_style_dir(tmp.path(), &cfg);
    let (loaded_cfg, params) = load_model(tmp.path()).unwrap();
    assert_eq!(loaded_cfg, cfg);
    let layout = ParamLayout::new(&cfg);
    assert_eq!(params.len(), layout.total);
    for (t, spec) in layout.specs.iter().enumerate() {
        let got = &params[spec.offset..spec.offset + spec.len];
        assert!(
            got.iter().enumerate().all(|(j, &x)| x == cell(t, j)),
            "{} landed wrong",
            spec.name
        );
    }
}

/// The real 124M vocabulary and context with one layer: the big embedding tables, quick enough for CI.
#[test]
fn gpt2_124m_vocab_and_positions_load() {
    check_124m_style(ModelConfig {
        n_layer: 1,
        ..ModelConfig::gpt2()
    });
}

/// The full GPT-2 124M shapes: 500 MB written and read back, about 3 s and 1 GB resident (the parameter
/// buffer plus the mapped file) on a 2-core machine.
#[test]
fn gpt2_124m_full_shapes_load() {
    check_124m_style(ModelConfig::gpt2());
    assert_eq!(ModelConfig::gpt2().param_count(), 124_439_808);
}

// ---------------------------------------------------------------------------------------------------------
// Corrupt inputs: each a clear error, never a panic

#[test]
fn garbage_safetensors_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let path = tmp.path().join("model.safetensors");
    fs::write(&path, b"this is not a safetensors file at all, just some text").unwrap();
    assert_err_mentions(
        load_model(tmp.path()),
        &["model.safetensors", "not a valid safetensors"],
    );
    fs::write(&path, b"abc").unwrap();
    assert_err_mentions(load_model(tmp.path()), &["model.safetensors", "8-byte"]);
    fs::write(&path, b"").unwrap();
    assert_err_mentions(load_model(tmp.path()), &["model.safetensors"]);
}

#[test]
fn header_length_beyond_the_file_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let path = tmp.path().join("model.safetensors");
    let mut bytes = fs::read(&path).unwrap();
    for claimed in [bytes.len() as u64, u64::MAX, 50 << 20] {
        bytes[..8].copy_from_slice(&claimed.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        assert_err_mentions(
            load_model(tmp.path()),
            &["model.safetensors", "not a valid safetensors"],
        );
    }
}

#[test]
fn truncated_tensor_data_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let path = tmp.path().join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    assert_err_mentions(
        load_model(tmp.path()),
        &["model.safetensors", "not a valid safetensors"],
    );
}

#[test]
fn config_json_that_is_not_json_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    fs::write(tmp.path().join("config.json"), "{ n_layer: 2, oops").unwrap();
    assert_err_mentions(load_model(tmp.path()), &["config.json", "not valid JSON"]);
    fs::write(tmp.path().join("config.json"), [0xff, 0xfe, 0x00]).unwrap();
    assert_err_mentions(load_model(tmp.path()), &["config.json"]);
    fs::write(tmp.path().join("config.json"), "[1, 2]").unwrap();
    assert_err_mentions(load_model(tmp.path()), &["config.json", "object"]);
    fs::remove_file(tmp.path().join("config.json")).unwrap();
    assert_err_mentions(load_model(tmp.path()), &["config.json"]);
}

#[test]
fn config_with_other_shapes_than_the_tensors_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let cfg = ModelConfig {
        n_embd: 128,
        ..ModelConfig::tiny()
    };
    fs::write(tmp.path().join("config.json"), hf_config_json(&cfg).to_string()).unwrap();
    assert_err_mentions(
        load_model(tmp.path()),
        &["transformer.wte.weight", "[256, 64]", "[256, 128]"],
    );
    // Fewer layers than the file holds: the extra layers are unknown tensors.
    let cfg = ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    };
    fs::write(tmp.path().join("config.json"), hf_config_json(&cfg).to_string()).unwrap();
    assert_err_mentions(load_model(tmp.path()), &["unknown tensors", "transformer.h.1."]);
}

#[test]
fn unsupported_numerics_in_config_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    for (key, value) in [
        ("activation_function", serde_json::json!("gelu")),
        ("layer_norm_epsilon", serde_json::json!(1e-6)),
    ] {
        let mut config = hf_config_json(&ModelConfig::tiny());
        config[key] = value;
        fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
        assert_err_mentions(load_model(tmp.path()), &[key]);
    }
    let mut config = hf_config_json(&ModelConfig::tiny());
    config["activation_function"] = "gelu_pytorch_tanh".into();
    assert!(config_from_hf_json(&config.to_string()).is_ok());
}

#[test]
fn a_huge_config_is_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let cfg = r#"{"n_layer":1000,"n_embd":65536,"n_head":1,"vocab_size":1048576,"n_positions":1048576}"#;
    fs::write(tmp.path().join("config.json"), cfg).unwrap();
    assert_err_mentions(load_model(tmp.path()), &["config.json", "parameters"]);
    // Valid but larger than the tensors: caught by the shape check, before the buffer is allocated.
    let cfg = ModelConfig {
        vocab_size: 1 << 20,
        n_embd: 1024,
        n_head: 8,
        ..ModelConfig::tiny()
    };
    fs::write(tmp.path().join("config.json"), hf_config_json(&cfg).to_string()).unwrap();
    assert_err_mentions(load_model(tmp.path()), &["has shape"]);
}

/// Found by `tests/fuzz_readers.rs`: a config.json claiming hundreds of layers of a tiny width passes the
/// parameter-count limit, and the loader used to build the parameter layout (a name and shape for each of
/// 12 tensors per layer, about 0.5 MB here) before looking at the file. It is now refused first, from the
/// number of tensors the file holds; a file missing a few tensors still gets them named.
#[test]
fn many_layers_over_few_tensors_are_refused_before_building_the_layout() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    let cfg = ModelConfig {
        n_layer: 598,
        n_embd: 4,
        n_head: 2,
        ..ModelConfig::tiny()
    };
    fs::write(tmp.path().join("config.json"), hf_config_json(&cfg).to_string()).unwrap();
    let model = fs::read(tmp.path().join("model.safetensors")).unwrap();
    let config = fs::read(tmp.path().join("config.json")).unwrap();
    for result in [load_model(tmp.path()), load_model_bytes(&config, &model)] {
        assert_err_mentions(
            result,
            &["model.safetensors", "holds 28 tensors", "n_layer 598", "7180"],
        );
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    edit_tensors(tmp.path(), "model.safetensors", |m| {
        m.remove("transformer.h.1.mlp.c_fc.bias");
    });
    assert_err_mentions(
        load_model(tmp.path()),
        &["missing tensors", "transformer.h.1.mlp.c_fc.bias"],
    );
    fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    assert_err_mentions(load_model(tmp.path()), &["model.safetensors"]);
}

#[test]
fn an_unknown_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    edit_tensors(tmp.path(), "model.safetensors", |m| {
        m.insert(
            "transformer.h.0.attn.rotary.inv_freq".into(),
            (Dtype::F32, vec![2], f32_le(&[1.0, 2.0])),
        );
    });
    assert_err_mentions(
        load_model(tmp.path()),
        &["unknown tensors", "transformer.h.0.attn.rotary.inv_freq"],
    );
}

#[test]
fn duplicate_names_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    edit_tensors(tmp.path(), "model.safetensors", |m| {
        let copy = m["transformer.ln_f.bias"].clone();
        m.insert("ln_f.bias".into(), copy);
    });
    assert_err_mentions(load_model(tmp.path()), &["ln_f.bias", "same parameter"]);
}

#[test]
fn a_wrong_dtype_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_checkpoint(tmp.path());
    edit_tensors(tmp.path(), "model.safetensors", |m| {
        let (_, shape, bytes) = m["transformer.ln_f.weight"].clone();
        m.insert("transformer.ln_f.weight".into(), (Dtype::I32, shape, bytes));
    });
    assert_err_mentions(load_model(tmp.path()), &["transformer.ln_f.weight", "I32"]);
}

#[test]
fn trainer_state_problems_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, layout, _) = tiny_checkpoint(tmp.path());
    let file = "trainer_state.safetensors";
    let original = fs::read(tmp.path().join(file)).unwrap();

    edit_tensors(tmp.path(), file, |m| {
        m.insert(
            "exp_avg.ln_f.bias".into(),
            (Dtype::F32, vec![cfg.n_embd + 1], vec![0; 4 * (cfg.n_embd + 1)]),
        );
    });
    assert_err_mentions(
        load_trainer_state(tmp.path(), &layout),
        &["exp_avg.ln_f.bias", "[65]", "[64]"],
    );

    fs::write(tmp.path().join(file), &original).unwrap();
    edit_tensors(tmp.path(), file, |m| {
        m.remove("exp_avg_sq.wpe.weight");
    });
    assert_err_mentions(
        load_trainer_state(tmp.path(), &layout),
        &["missing", "exp_avg_sq.wpe.weight"],
    );

    // The moments of another model.
    let other = ParamLayout::new(&ModelConfig {
        n_layer: 3,
        ..cfg.clone()
    });
    fs::write(tmp.path().join(file), &original).unwrap();
    assert_err_mentions(load_trainer_state(tmp.path(), &other), &["missing", "h.2."]);

    // Metadata: not ours (a file without our keys), then a field that is not a number.
    fs::write(tmp.path().join(file), &original).unwrap();
    let path = tmp.path().join(file);
    write_tensors(
        &path,
        &read_tensors(&path),
        HashMap::from([("format".to_string(), "pt".to_string())]),
    );
    assert_err_mentions(load_trainer_state(tmp.path(), &layout), &["ringtrain.kind"]);
    let mut state = state_for(&layout, &cfg, 3);
    save_trainer_state(tmp.path(), &layout, &state).unwrap();
    let bytes = fs::read(tmp.path().join(file)).unwrap();
    // A same-length edit keeps the header valid.
    let patched = patch_bytes(&bytes, "\"step\":\"3\"", "\"step\":\"x\"");
    assert_ne!(patched.as_slice(), bytes.as_slice(), "metadata layout assumption");
    fs::write(tmp.path().join(file), patched.as_slice()).unwrap();
    assert_err_mentions(load_trainer_state(tmp.path(), &layout), &["step = \"x\"", "integer"]);

    // Saving refuses a moment of the wrong size before writing anything.
    state.v.pop();
    assert_err_mentions(
        save_trainer_state(tmp.path(), &layout, &state),
        &["exp_avg_sq", "values"],
    );
    fs::remove_file(tmp.path().join(file)).unwrap();
    assert_err_mentions(load_trainer_state(tmp.path(), &layout), &["trainer_state.safetensors"]);
}

#[test]
fn trainer_state_with_wrong_moment_dtype_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, layout, _) = tiny_checkpoint(tmp.path());
    let state = state_for(&layout, &cfg, 5);
    save_trainer_state(tmp.path(), &layout, &state).unwrap();
    let path = tmp.path().join("trainer_state.safetensors");
    let bytes = fs::read(&path).unwrap();
    // Same byte length, so the header stays valid: the moment becomes I32.
    let patched = patch_bytes(
        &bytes,
        "\"exp_avg.ln_f.bias\":{\"dtype\":\"F32\"",
        "\"exp_avg.ln_f.bias\":{\"dtype\":\"I32\"",
    );
    assert_ne!(patched.as_slice(), bytes.as_slice(), "header layout assumption");
    fs::write(&path, patched.as_slice()).unwrap();
    assert_err_mentions(load_trainer_state(tmp.path(), &layout), &["exp_avg.ln_f.bias", "I32"]);
}

#[test]
fn save_rejects_a_buffer_that_does_not_match_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let short = vec![0.0; layout.total - 1];
    assert_err_mentions(save_checkpoint(&dir, &cfg, &layout, &short, None), &["parameters"]);
    let other = ParamLayout::new(&ModelConfig::small());
    let params = vec![0.0; other.total];
    assert_err_mentions(save_checkpoint(&dir, &cfg, &other, &params, None), &["layout"]);
    assert!(dir_names(tmp.path()).is_empty(), "nothing may be written");
    assert!(save_model_files(tmp.path(), &cfg, &layout, &short).is_err());
}

// ---------------------------------------------------------------------------------------------------------
// Atomic saving

/// Simulates a crash: the hook fails (or panics) right after `crash_at`.
fn crashing_save(dir: &Path, params: &[f32], state: &TrainerState, crash_at: SaveStage, panic: bool) -> bool {
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let mut reached = false;
    let mut hook = |s: SaveStage| {
        if s == crash_at {
            reached = true;
            if panic {
                panic!("simulated crash at {s:?}");
            }
            anyhow::bail!("simulated crash at {s:?}");
        }
        Ok(())
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        save_checkpoint_with_hook(dir, &cfg, &layout, params, Some(state), &mut hook)
    }));
    match result {
        Ok(r) => assert!(r.is_err() || !reached, "a failing hook must fail the save"),
        Err(_) => assert!(panic),
    }
    reached
}

fn assert_checkpoint_is(dir: &Path, params: &[f32], state: &TrainerState, what: &str) {
    let (_, loaded) = load_model(dir).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert!(same_bits(&loaded, params), "{what}: parameters differ");
    let layout = ParamLayout::new(&ModelConfig::tiny());
    let loaded = load_trainer_state(dir, &layout).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert_eq!(
        loaded.step, state.step,
        "{what}: model and trainer state must come from the same save"
    );
    assert!(same_bits(&loaded.m, &state.m), "{what}: moments differ");
}

#[test]
fn a_crash_at_every_stage_leaves_a_whole_checkpoint() {
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let (old_params, new_params, last_params) = (
        pattern(layout.total, 1),
        pattern(layout.total, 2),
        pattern(layout.total, 3),
    );
    let (old_state, new_state, last_state) = (
        state_for(&layout, &cfg, 10),
        state_for(&layout, &cfg, 20),
        state_for(&layout, &cfg, 30),
    );
    for stage in SaveStage::ALL {
        for panic in [false, true] {
            let what = format!("crash after {stage:?} (panic: {panic})");
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("ckpt");
            save_checkpoint(&dir, &cfg, &layout, &old_params, Some(&old_state)).unwrap();

            assert!(
                crashing_save(&dir, &new_params, &new_state, stage, panic),
                "{what}: stage not reached"
            );
            let installed = matches!(stage, SaveStage::Installed | SaveStage::RemovedPrevious);
            if installed {
                assert_checkpoint_is(&dir, &new_params, &new_state, &what);
            } else {
                assert_checkpoint_is(&dir, &old_params, &old_state, &what);
            }

            // The next save recovers and leaves nothing behind.
            save_checkpoint(&dir, &cfg, &layout, &last_params, Some(&last_state)).unwrap();
            assert_checkpoint_is(&dir, &last_params, &last_state, &what);
            assert_eq!(dir_names(tmp.path()), ["ckpt"], "{what}");
        }
    }
}

#[test]
fn a_crash_during_the_first_save_leaves_no_half_checkpoint() {
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let (params, state) = (pattern(layout.total, 4), state_for(&layout, &cfg, 1));
    for stage in SaveStage::ALL {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let reached = crashing_save(&dir, &params, &state, stage, false);
        assert_eq!(reached, stage != SaveStage::MovedPreviousAside, "{stage:?}");
        if !reached || matches!(stage, SaveStage::Installed | SaveStage::RemovedPrevious) {
            assert_checkpoint_is(&dir, &params, &state, &format!("{stage:?}"));
        } else {
            assert_err_mentions(load_model(&dir), &["does not exist"]);
        }
        save_checkpoint(&dir, &cfg, &layout, &params, Some(&state)).unwrap();
        assert_eq!(dir_names(tmp.path()), ["ckpt"], "{stage:?}");
    }
}

#[test]
fn resolve_falls_back_to_the_previous_checkpoint_set_aside() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let (_, _, params) = tiny_checkpoint(&dir);
    fs::rename(&dir, tmp.path().join("ckpt.ringtrain-old")).unwrap();
    assert_eq!(
        resolve_checkpoint_dir(&dir).unwrap(),
        tmp.path().join("ckpt.ringtrain-old")
    );
    let (_, loaded) = load_model(&dir).unwrap();
    assert!(same_bits(&loaded, &params));
    assert_err_mentions(resolve_checkpoint_dir(&tmp.path().join("nothing")), &["does not exist"]);
}

#[test]
fn overwriting_a_checkpoint_and_an_empty_dir_is_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("empty");
    fs::create_dir(&dir).unwrap();
    tiny_checkpoint(&dir);
    // A model-only checkpoint replaces one with a trainer state: the old state must not survive.
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let params = pattern(layout.total, 9);
    save_checkpoint(&dir, &cfg, &layout, &params, None).unwrap();
    assert_eq!(dir_names(&dir), ["config.json", "model.safetensors"]);
    assert!(same_bits(&load_model(&dir).unwrap().1, &params));
}

#[test]
fn a_users_directory_is_never_overwritten() {
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let params = pattern(layout.total, 5);
    let tmp = tempfile::tempdir().unwrap();

    let notes = tmp.path().join("notes");
    fs::create_dir(&notes).unwrap();
    fs::write(notes.join("thesis.txt"), "precious").unwrap();
    assert_err_mentions(
        save_checkpoint(&notes, &cfg, &layout, &params, None),
        &["refusing", "not a checkpoint"],
    );
    assert_eq!(dir_names(&notes), ["thesis.txt"]);

    // A checkpoint that also holds the user's files (a downloaded HF repo with its tokenizer).
    let hf = tmp.path().join("hf");
    tiny_checkpoint(&hf);
    fs::write(hf.join("tokenizer.json"), "{}").unwrap();
    assert_err_mentions(
        save_checkpoint(&hf, &cfg, &layout, &params, None),
        &["refusing", "tokenizer.json"],
    );
    assert!(hf.join("tokenizer.json").is_file() && hf.join("model.safetensors").is_file());

    let file = tmp.path().join("plain-file");
    fs::write(&file, "data").unwrap();
    assert_err_mentions(
        save_checkpoint(&file, &cfg, &layout, &params, None),
        &["not a directory"],
    );
    assert_eq!(fs::read_to_string(&file).unwrap(), "data");

    // Stale sibling names that hold something of the user's are not deleted either.
    let dir = tmp.path().join("run");
    let stale = tmp.path().join("run.ringtrain-tmp");
    fs::create_dir(&stale).unwrap();
    fs::write(stale.join("mine.txt"), "keep").unwrap();
    assert_err_mentions(
        save_checkpoint(&dir, &cfg, &layout, &params, None),
        &["refusing", "mine.txt"],
    );
    assert_eq!(fs::read_to_string(stale.join("mine.txt")).unwrap(), "keep");
}

#[cfg(unix)]
#[test]
fn a_symlinked_target_is_refused() {
    let cfg = ModelConfig::tiny();
    let layout = ParamLayout::new(&cfg);
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real");
    let (_, _, params) = tiny_checkpoint(&real);
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert_err_mentions(save_checkpoint(&link, &cfg, &layout, &params, None), &["symbolic link"]);
    assert!(
        same_bits(&load_model(&link).unwrap().1, &params),
        "loading through a link is fine"
    );
}

// ---------------------------------------------------------------------------------------------------------
// Cross-check with Hugging Face transformers, where it is installed

/// Loads our checkpoint with `GPT2LMHeadModel.from_pretrained` and compares every tensor.
const HF_CHECK: &str = r#"
import sys, torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel
model, info = GPT2LMHeadModel.from_pretrained(sys.argv[1], output_loading_info=True)
missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
assert not missing and not info["unexpected_keys"] and not info["mismatched_keys"], info
state = model.state_dict()
for key, value in load_file(sys.argv[1] + "/model.safetensors").items():
    assert torch.equal(state[key], value), key
assert torch.equal(model.lm_head.weight, model.transformer.wte.weight), "head not tied"
cfg = model.config
assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_positions) == tuple(int(a) for a in sys.argv[2:7])
assert cfg.activation_function == "gelu_new" and cfg.layer_norm_epsilon == 1e-5
print("transformers loaded the checkpoint")
"#;

#[test]
fn transformers_loads_our_checkpoint() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import torch, transformers, safetensors"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("skipping: python3 with torch, transformers and safetensors is not available");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let cfg = ModelConfig {
        n_layer: 3,
        n_embd: 48,
        n_head: 6,
        vocab_size: 300,
        n_positions: 40,
    };
    let layout = ParamLayout::new(&cfg);
    save_checkpoint(&dir, &cfg, &layout, &pattern(layout.total, 11), None).unwrap();
    let dims = [cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_positions].map(|d| d.to_string());
    let out = std::process::Command::new("python3")
        .args(["-c", HF_CHECK, dir.to_str().unwrap()])
        .args(dims)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("transformers loaded"),
        "transformers rejected it:\n{text}"
    );
}
