//! Atomic checkpoint replacement.
//!
//! A save of `<parent>/<name>` writes the whole new checkpoint into the sibling `<name>.ringtrain-tmp` and
//! fsyncs every file and that directory. Linux cannot rename a directory over a non-empty one, so the swap is
//! three renames, each followed by an fsync of `<parent>`:
//! 1. `<name>` → `<name>.ringtrain-old` (skipped when there is no previous checkpoint);
//! 2. `<name>.ringtrain-tmp` → `<name>`;
//! 3. `<name>.ringtrain-old` is deleted.
//!
//! Whatever moment a crash hits, one whole checkpoint survives: before step 1 it is `<name>`; between steps 1
//! and 2 `<name>` is missing and the previous checkpoint is whole at `<name>.ringtrain-old`, which
//! [`resolve_checkpoint_dir`] (and so every `load_*`) falls back to; after step 2 the new one is `<name>`.
//! The next save finishes the recovery: it renames a lone `.ringtrain-old` back to `<name>` and deletes
//! stale `-old`/`-tmp` siblings.
//!
//! Safety for the user's files: a directory is only ever replaced or deleted when it holds nothing but
//! checkpoint files (`config.json`, `model.safetensors`, `trainer_state.safetensors`), removal goes file by
//! file and ends with `rmdir` (never a recursive delete), and symbolic links are refused. Two processes must
//! not save to the same directory at once (in a run, rank 0 saves).

use std::ffi::OsString;
use std::fs::{self, FileType};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::model_files::{check_params, write_config, write_model};
use super::tensor_io::fsync_dir;
use super::trainer_state::{check_state, save_trainer_state};
use super::{TrainerState, CHECKPOINT_FILES, CONFIG_FILE, MODEL_FILE};
use crate::model::{ModelConfig, ParamLayout};

const TMP_SUFFIX: &str = ".ringtrain-tmp";
const OLD_SUFFIX: &str = ".ringtrain-old";

/// The points of a save at which [`save_checkpoint_with_hook`] calls its hook, in order. A hook that fails
/// (or panics) there leaves the file system exactly as a crash at that point would.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SaveStage {
    /// Leftovers of an interrupted save were recovered or removed; nothing new is written yet.
    Prepared,
    /// The empty temporary directory exists.
    CreatedTemp,
    WroteConfig,
    WroteModel,
    /// Only reached when a trainer state is saved.
    WroteTrainerState,
    /// The temporary directory is fsynced: the new checkpoint is complete under its temporary name.
    SyncedTemp,
    /// The previous checkpoint was renamed aside and the target is missing. Only reached when there was one.
    MovedPreviousAside,
    /// The new checkpoint is in place.
    Installed,
    /// The previous checkpoint is deleted: the save is complete.
    RemovedPrevious,
}

impl SaveStage {
    pub const ALL: [SaveStage; 9] = [
        SaveStage::Prepared,
        SaveStage::CreatedTemp,
        SaveStage::WroteConfig,
        SaveStage::WroteModel,
        SaveStage::WroteTrainerState,
        SaveStage::SyncedTemp,
        SaveStage::MovedPreviousAside,
        SaveStage::Installed,
        SaveStage::RemovedPrevious,
    ];
}

/// Saves a checkpoint (model, and the trainer state when given) to `dir`, atomically replacing the
/// checkpoint already there. See the module documentation for the scheme.
pub fn save_checkpoint(
    dir: &Path,
    cfg: &ModelConfig,
    layout: &ParamLayout,
    params: &[f32],
    state: Option<&TrainerState>,
) -> Result<()> {
    save_checkpoint_with_hook(dir, cfg, layout, params, state, &mut |_| Ok(()))
}

/// [`save_checkpoint`] with a fault-injection seam: `hook` runs after each [`SaveStage`]. When it returns an
/// error the save stops right there without any cleanup, as a crash would; other errors (a full disk) clean
/// up the temporary directory and put the previous checkpoint back where they can.
pub fn save_checkpoint_with_hook(
    dir: &Path,
    cfg: &ModelConfig,
    layout: &ParamLayout,
    params: &[f32],
    state: Option<&TrainerState>,
    hook: &mut dyn FnMut(SaveStage) -> Result<()>,
) -> Result<()> {
    check_params(cfg, layout, params)?;
    if let Some(state) = state {
        check_state(layout, state)?;
    }
    let paths = Siblings::of(dir)?;
    let mut hook_failed = false;
    let mut stage = |s: SaveStage| hook(s).inspect_err(|_| hook_failed = true);
    let result = (|| {
        paths.prepare()?;
        stage(SaveStage::Prepared)?;
        write_temp(&paths.tmp, cfg, layout, params, state, &mut stage)?;
        paths.install(&mut stage)
    })();
    if result.is_err() && !hook_failed {
        paths.undo_after_error();
    }
    result.with_context(|| format!("saving checkpoint to {}", dir.display()))
}

/// Checks, before a run trains, that a save to `dir` can succeed: its parent directory exists or can be
/// created, a file can be written there, and `dir` is absent, empty or a checkpoint that may be replaced
/// (see the module documentation). Creates the parent directories; writes and removes one probe file.
pub fn check_save_target(dir: &Path) -> Result<()> {
    let paths = Siblings::of(dir)?;
    fs::create_dir_all(&paths.parent).with_context(|| {
        format!(
            "cannot create {}, the directory the checkpoint goes in",
            paths.parent.display()
        )
    })?;
    check_replaceable(dir)?;
    let mut name = OsString::from(dir.file_name().expect("Siblings::of checked the name"));
    name.push(format!(".ringtrain-probe-{}", std::process::id()));
    let probe = paths.parent.join(name);
    fs::write(&probe, b"probe").with_context(|| format!("cannot write in {}", paths.parent.display()))?;
    fs::remove_file(&probe).with_context(|| format!("removing {}", probe.display()))
}

/// Where a checkpoint may live: at `dir`, or at the last moment of a save interrupted between the two
/// renames, at its `.ringtrain-old` sibling (whole, fsynced). Loaders call this so that such a crash never
/// loses the checkpoint.
pub fn resolve_checkpoint_dir(dir: &Path) -> Result<PathBuf> {
    if dir.exists() {
        return Ok(dir.to_path_buf());
    }
    let paths = Siblings::of(dir)?;
    if paths.old.join(CONFIG_FILE).is_file() {
        tracing::warn!(
            "checkpoint {} is missing; using {} left by an interrupted save",
            dir.display(),
            paths.old.display()
        );
        return Ok(paths.old);
    }
    bail!("checkpoint directory {} does not exist", dir.display())
}

fn write_temp(
    tmp: &Path,
    cfg: &ModelConfig,
    layout: &ParamLayout,
    params: &[f32],
    state: Option<&TrainerState>,
    stage: &mut dyn FnMut(SaveStage) -> Result<()>,
) -> Result<()> {
    fs::create_dir(tmp).with_context(|| format!("creating {}", tmp.display()))?;
    stage(SaveStage::CreatedTemp)?;
    write_config(tmp, cfg)?;
    stage(SaveStage::WroteConfig)?;
    write_model(tmp, layout, params)?;
    stage(SaveStage::WroteModel)?;
    if let Some(state) = state {
        save_trainer_state(tmp, layout, state)?;
        stage(SaveStage::WroteTrainerState)?;
    }
    fsync_dir(tmp)?;
    stage(SaveStage::SyncedTemp)
}

/// The target directory and its two siblings used by a save.
struct Siblings {
    dir: PathBuf,
    parent: PathBuf,
    tmp: PathBuf,
    old: PathBuf,
}

impl Siblings {
    fn of(dir: &Path) -> Result<Self> {
        let Some(name) = dir.file_name() else {
            bail!("checkpoint path {} does not name a directory", dir.display());
        };
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let sibling = |suffix: &str| {
            let mut n = OsString::from(name);
            n.push(suffix);
            parent.join(n)
        };
        Ok(Siblings {
            dir: dir.to_path_buf(),
            tmp: sibling(TMP_SUFFIX),
            old: sibling(OLD_SUFFIX),
            parent,
        })
    }

    /// Finishes the recovery of an interrupted save and checks that `dir` may be replaced.
    fn prepare(&self) -> Result<()> {
        fs::create_dir_all(&self.parent).with_context(|| format!("creating {}", self.parent.display()))?;
        if exists(&self.dir)? {
            check_replaceable(&self.dir)?;
            if exists(&self.old)? {
                remove_checkpoint_dir(&self.old)?;
            }
        } else if exists(&self.old)? {
            self.recover_old()?;
        }
        if exists(&self.tmp)? {
            remove_checkpoint_dir(&self.tmp)?;
        }
        fsync_dir(&self.parent)
    }

    /// `dir` is missing and the previous checkpoint sits aside: put it back when whole, else drop the
    /// remains (a save interrupted while deleting it, after which `dir` was removed by hand).
    fn recover_old(&self) -> Result<()> {
        check_ours(&self.old, "recover")?;
        if self.old.join(CONFIG_FILE).is_file() && self.old.join(MODEL_FILE).is_file() {
            rename(&self.old, &self.dir)
        } else {
            remove_checkpoint_dir(&self.old)
        }
    }

    /// The renames that publish the new checkpoint (module documentation, steps 1-3).
    fn install(&self, stage: &mut dyn FnMut(SaveStage) -> Result<()>) -> Result<()> {
        if exists(&self.dir)? {
            check_replaceable(&self.dir)?;
            rename(&self.dir, &self.old)?;
            fsync_dir(&self.parent)?;
            stage(SaveStage::MovedPreviousAside)?;
        }
        rename(&self.tmp, &self.dir)?;
        fsync_dir(&self.parent)?;
        stage(SaveStage::Installed)?;
        if exists(&self.old)? {
            // The new checkpoint is durable in place: a failure here only leaves a stale sibling that the
            // next save removes, so it is not a failed save.
            if let Err(e) = remove_checkpoint_dir(&self.old).and_then(|()| fsync_dir(&self.parent)) {
                tracing::warn!("could not remove the previous checkpoint {}: {e:#}", self.old.display());
            }
        }
        stage(SaveStage::RemovedPrevious)
    }

    /// After a real error (not an injected crash): put the previous checkpoint back if it was moved aside,
    /// and drop the temporary directory. Best effort; the next save recovers whatever is left.
    fn undo_after_error(&self) {
        if !self.dir.exists() && self.old.exists() {
            if let Err(e) = rename(&self.old, &self.dir) {
                tracing::warn!("could not restore the previous checkpoint: {e:#}");
            }
        }
        if self.tmp.exists() {
            if let Err(e) = remove_checkpoint_dir(&self.tmp) {
                tracing::warn!("could not remove {}: {e:#}", self.tmp.display());
            }
        }
    }
}

/// Whether `path` exists, without following a symbolic link (a dangling link exists too).
fn exists(path: &Path) -> Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("inspecting {}", path.display())),
    }
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))
}

/// The names and types of a directory's entries.
fn entries(dir: &Path) -> Result<Vec<(OsString, FileType)>> {
    let read = fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))?;
    read.map(|e| {
        let e = e.with_context(|| format!("listing {}", dir.display()))?;
        let kind = e
            .file_type()
            .with_context(|| format!("inspecting {}", e.path().display()))?;
        Ok((e.file_name(), kind))
    })
    .collect()
}

/// Entries that a checkpoint we write never contains.
fn foreign_entries(dir: &Path) -> Result<Vec<String>> {
    let mut foreign: Vec<String> = entries(dir)?
        .into_iter()
        .filter(|(name, kind)| !(kind.is_file() && name.to_str().is_some_and(|n| CHECKPOINT_FILES.contains(&n))))
        .map(|(name, _)| name.to_string_lossy().into_owned())
        .collect();
    foreign.sort();
    Ok(foreign)
}

/// A real directory (not a link) holding only checkpoint files, possibly none.
fn check_ours(dir: &Path, action: &str) -> Result<()> {
    let meta = fs::symlink_metadata(dir).with_context(|| format!("inspecting {}", dir.display()))?;
    if !meta.is_dir() {
        bail!("refusing to {action} {}: it is not a directory", dir.display());
    }
    let foreign = foreign_entries(dir)?;
    if !foreign.is_empty() {
        bail!(
            "refusing to {action} {}: it holds {}, which a ringtrain checkpoint never contains",
            dir.display(),
            foreign.join(", ")
        );
    }
    Ok(())
}

/// Deletes a directory of checkpoint files, file by file, so that nothing else can ever be deleted.
fn remove_checkpoint_dir(dir: &Path) -> Result<()> {
    check_ours(dir, "delete")?;
    for name in CHECKPOINT_FILES {
        let path = dir.join(name);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", path.display()));
            }
            _ => {}
        }
    }
    fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))
}

/// `dir` may be replaced when it is absent, an empty directory, or a checkpoint with nothing else in it.
fn check_replaceable(dir: &Path) -> Result<()> {
    let meta = match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        other => other.with_context(|| format!("inspecting {}", dir.display()))?,
    };
    if meta.file_type().is_symlink() {
        bail!(
            "refusing to replace {}: it is a symbolic link; save to the directory it points to",
            dir.display()
        );
    }
    if !meta.is_dir() {
        bail!(
            "refusing to save a checkpoint to {}: it exists and is not a directory",
            dir.display()
        );
    }
    let names: Vec<OsString> = entries(dir)?.into_iter().map(|(n, _)| n).collect();
    if names.is_empty() {
        return Ok(());
    }
    let has = |f: &str| names.iter().any(|n| n == f);
    if !has(CONFIG_FILE) || !has(MODEL_FILE) {
        bail!(
            "refusing to overwrite {}: it is not empty and is not a checkpoint (no {CONFIG_FILE} and {MODEL_FILE})",
            dir.display()
        );
    }
    let foreign = foreign_entries(dir)?;
    if !foreign.is_empty() {
        bail!(
            "refusing to overwrite {}: besides a checkpoint it holds {}, which ringtrain did not write; \
             move them away or save elsewhere",
            dir.display(),
            foreign.join(", ")
        );
    }
    Ok(())
}
