//! `trainer_state.safetensors`: what `--resume` needs beyond the model to continue bit-identically.
//!
//! The AdamW moments are stored as full tensors `exp_avg.<name>` / `exp_avg_sq.<name>` (the names of
//! [`ParamLayout`], gathered from the shards in sharded mode), so a resume can re-cut them for any world size.
//! The counters are safetensors metadata strings, which keeps the file readable by any safetensors tool.
//! The gradient synchronisation's own state, when it keeps any (`GradientSync::checkpoint_state`), is
//! stored as one-dimensional F32 tensors `sync.<name>`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};

use super::model_files::slice;
use super::tensor_io::{decode_into, with_safetensors, with_safetensors_bytes, write_tensors, F32View};
use super::TRAINER_STATE_FILE;
use crate::model::ParamLayout;

/// Bumped when the meaning of a stored field changes, so an old file is rejected instead of misread.
const VERSION: &str = "1";
const KIND: &str = "trainer_state";
const KEY_KIND: &str = "ringtrain.kind";
const KEY_VERSION: &str = "ringtrain.version";
/// Extra entries are stored under this prefix so they can never collide with the fixed keys.
const EXTRA_PREFIX: &str = "extra.";
const M_PREFIX: &str = "exp_avg.";
const V_PREFIX: &str = "exp_avg_sq.";
const SYNC_PREFIX: &str = "sync.";

/// Everything besides the parameters that a resumed run needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Tokens consumed, cumulative over all ranks.
    pub tokens_seen: u64,
    /// Global windows consumed: where the sampler resumes, whatever the new world size.
    pub data_cursor: u64,
    /// World size of the run that saved this state (a resume may use another).
    pub world_size: usize,
    /// [`crate::model::ModelConfig::hash_hex`] of the model; the caller compares it with the loaded config.
    pub config_hash: String,
    pub seed: u64,
    /// AdamW first moment, in [`ParamLayout`] order.
    pub m: Vec<f32>,
    /// AdamW second moment, in [`ParamLayout`] order.
    pub v: Vec<f32>,
    /// Free-form strings: the train arguments as JSON, RNG state, and so on.
    pub extra: BTreeMap<String, String>,
    /// The gradient synchronisation's own state, by name (empty for the per-step sync).
    pub sync: BTreeMap<String, Vec<f32>>,
}

/// Writes `trainer_state.safetensors` into an existing directory and fsyncs it (not atomic on its own).
pub fn save_trainer_state(dir: &Path, layout: &ParamLayout, state: &TrainerState) -> Result<()> {
    check_state(layout, state)?;
    let mut tensors = Vec::with_capacity(2 * layout.specs.len());
    for (prefix, buf) in [(M_PREFIX, &state.m), (V_PREFIX, &state.v)] {
        for spec in &layout.specs {
            tensors.push((
                format!("{prefix}{}", spec.name),
                F32View {
                    shape: spec.shape.clone(),
                    data: slice(buf, spec),
                },
            ));
        }
    }
    for (name, values) in &state.sync {
        let view = F32View {
            shape: vec![values.len()],
            data: values,
        };
        tensors.push((format!("{SYNC_PREFIX}{name}"), view));
    }
    write_tensors(&dir.join(TRAINER_STATE_FILE), tensors, metadata(state))
}

/// Loads and validates `trainer_state.safetensors` against `layout`. Recovers from an interrupted save
/// (see [`super::resolve_checkpoint_dir`]).
pub fn load_trainer_state(dir: &Path, layout: &ParamLayout) -> Result<TrainerState> {
    let dir = super::resolve_checkpoint_dir(dir)?;
    let path = dir.join(TRAINER_STATE_FILE);
    with_safetensors(&path, |st, meta| read_state(st, meta, layout))
        .with_context(|| format!("loading {}", path.display()))
}

/// [`load_trainer_state`] over the file already in memory, with the same checks; lets tests and fuzzers
/// drive the loader without a file system.
pub fn load_trainer_state_bytes(bytes: &[u8], layout: &ParamLayout) -> Result<TrainerState> {
    with_safetensors_bytes(bytes, TRAINER_STATE_FILE, |st, meta| read_state(st, meta, layout))
        .with_context(|| format!("loading {TRAINER_STATE_FILE}"))
}

/// Validates everything (metadata, names, shapes, dtypes) before allocating the moments.
fn read_state(st: &SafeTensors<'_>, meta: &HashMap<String, String>, layout: &ParamLayout) -> Result<TrainerState> {
    let mut state = parse_metadata(meta)?;
    check_tensor_names(st, layout)?;
    check_moments(st, layout)?;
    state.m = read_moment(st, layout, M_PREFIX)?;
    state.v = read_moment(st, layout, V_PREFIX)?;
    state.sync = read_sync_state(st)?;
    Ok(state)
}

pub(crate) fn check_state(layout: &ParamLayout, state: &TrainerState) -> Result<()> {
    for (name, buf) in [("m (exp_avg)", &state.m), ("v (exp_avg_sq)", &state.v)] {
        if buf.len() != layout.total {
            bail!(
                "trainer state: {name} has {} values, the parameter layout holds {}",
                buf.len(),
                layout.total
            );
        }
    }
    if state.world_size == 0 {
        bail!("trainer state: world_size must be at least 1");
    }
    Ok(())
}

fn metadata(state: &TrainerState) -> HashMap<String, String> {
    let mut meta: HashMap<String, String> = [
        ("format", "pt".to_string()),
        (KEY_KIND, KIND.to_string()),
        (KEY_VERSION, VERSION.to_string()),
        ("step", state.step.to_string()),
        ("tokens_seen", state.tokens_seen.to_string()),
        ("data_cursor", state.data_cursor.to_string()),
        ("world_size", state.world_size.to_string()),
        ("config_hash", state.config_hash.clone()),
        ("seed", state.seed.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    meta.extend(
        state
            .extra
            .iter()
            .map(|(k, v)| (format!("{EXTRA_PREFIX}{k}"), v.clone())),
    );
    meta
}

/// The scalar fields; the moments are filled in by the caller once the tensors are validated.
fn parse_metadata(meta: &HashMap<String, String>) -> Result<TrainerState> {
    let kind = field(meta, KEY_KIND)?;
    if kind != KIND {
        bail!("metadata {KEY_KIND} = {kind:?}: this is not a ringtrain trainer state");
    }
    let version = field(meta, KEY_VERSION)?;
    if version != VERSION {
        bail!("trainer state version {version:?} is not supported by this build (expects {VERSION})");
    }
    let state = TrainerState {
        step: number(meta, "step")?,
        tokens_seen: number(meta, "tokens_seen")?,
        data_cursor: number(meta, "data_cursor")?,
        world_size: number(meta, "world_size")?,
        config_hash: field(meta, "config_hash")?.to_string(),
        seed: number(meta, "seed")?,
        m: Vec::new(),
        v: Vec::new(),
        sync: BTreeMap::new(),
        extra: meta
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(EXTRA_PREFIX)?.to_string(), v.clone())))
            .collect(),
    };
    if state.world_size == 0 {
        bail!("metadata world_size is 0; it must be at least 1");
    }
    Ok(state)
}

fn field<'a>(meta: &'a HashMap<String, String>, key: &str) -> Result<&'a str> {
    meta.get(key)
        .map(String::as_str)
        .with_context(|| format!("metadata is missing {key:?}"))
}

fn number<T: FromStr>(meta: &HashMap<String, String>, key: &str) -> Result<T> {
    let text = field(meta, key)?;
    text.parse()
        .ok()
        .with_context(|| format!("metadata {key} = {text:?} is not a non-negative integer"))
}

/// Exactly one `exp_avg.*` and one `exp_avg_sq.*` tensor per parameter, and the sync's `sync.*` tensors;
/// nothing else.
fn check_tensor_names(st: &SafeTensors<'_>, layout: &ParamLayout) -> Result<()> {
    let expected: BTreeSet<String> = [M_PREFIX, V_PREFIX]
        .iter()
        .flat_map(|p| layout.specs.iter().map(move |s| format!("{p}{}", s.name)))
        .collect();
    let present: BTreeSet<String> = st
        .names()
        .into_iter()
        .filter(|name| !name.starts_with(SYNC_PREFIX))
        .map(str::to_string)
        .collect();
    let unknown: Vec<&String> = present.difference(&expected).take(8).collect();
    if !unknown.is_empty() {
        bail!("unknown tensors {unknown:?} (is the trainer state from another model?)");
    }
    let missing: Vec<&String> = expected.difference(&present).take(8).collect();
    if !missing.is_empty() {
        bail!("missing tensors {missing:?}");
    }
    Ok(())
}

/// Shapes and dtypes of both moments, checked before either buffer is allocated. F32 only: resuming
/// bit-identically needs the moments exactly as they were.
fn check_moments(st: &SafeTensors<'_>, layout: &ParamLayout) -> Result<()> {
    for prefix in [M_PREFIX, V_PREFIX] {
        for spec in &layout.specs {
            let key = format!("{prefix}{}", spec.name);
            let view = st.tensor(&key).with_context(|| format!("tensor {key}"))?;
            if view.shape() != spec.shape.as_slice() {
                bail!(
                    "tensor {key} has shape {:?}, the model expects {:?}",
                    view.shape(),
                    spec.shape
                );
            }
            if view.dtype() != Dtype::F32 {
                bail!(
                    "tensor {key} has dtype {:?}; optimizer moments must be F32",
                    view.dtype()
                );
            }
        }
    }
    Ok(())
}

fn read_moment(st: &SafeTensors<'_>, layout: &ParamLayout, prefix: &str) -> Result<Vec<f32>> {
    let mut buf = vec![0f32; layout.total];
    for spec in &layout.specs {
        let key = format!("{prefix}{}", spec.name);
        let view = st.tensor(&key).with_context(|| format!("tensor {key}"))?;
        decode_into(&view, &key, &mut buf[spec.offset..spec.offset + spec.len])?;
    }
    Ok(buf)
}

/// The `sync.*` tensors: one-dimensional and F32 (the state must come back with the bits it was saved with).
/// Their lengths are the file's own, which the safetensors header has already checked against its size.
fn read_sync_state(st: &SafeTensors<'_>) -> Result<BTreeMap<String, Vec<f32>>> {
    let mut state = BTreeMap::new();
    for key in st.names() {
        let Some(name) = key.strip_prefix(SYNC_PREFIX) else {
            continue;
        };
        let view = st.tensor(key).with_context(|| format!("tensor {key}"))?;
        if view.dtype() != Dtype::F32 || view.shape().len() != 1 {
            bail!(
                "tensor {key} is {:?} of shape {:?}; the sync's state must be one-dimensional F32",
                view.dtype(),
                view.shape()
            );
        }
        let mut values = vec![0f32; view.shape()[0]];
        decode_into(&view, key, &mut values)?;
        state.insert(name.to_string(), values);
    }
    Ok(state)
}
