//! Which windows form each global batch, and how a global batch is cut among ranks and micro-steps.
//!
//! The data contract (ARCHITECTURE.md): window j is tokens `[j·T, j·T + T + 1)`; global step s uses windows
//! `[s·G, (s+1)·G)` of the epoch's order, where the order is the identity (`--shuffle off`) or a permutation
//! seeded by (seed, epoch). The set of windows in a global batch depends only on (step, G, seed, shuffle),
//! never on the world size, so the loss at step s does not depend on how many ranks share the work.

use std::sync::{Arc, Mutex};

use super::error::{DataError, Result};
use super::rng::{keyed_rng, shuffle};
use super::stream::TokenStream;

const SHUFFLE_TAG: &[u8] = b"ringtrain/shufl";

/// Chooses the G windows of every global step. Cheap to share: the current epoch's permutation is cached.
#[derive(Debug)]
pub struct WindowSampler {
    n_windows: u64,
    global_batch: u64,
    shuffle: bool,
    seed: u64,
    /// (epoch, permutation) of the most recently used epoch when shuffling.
    cache: Mutex<Option<(u64, Arc<Vec<u64>>)>>,
}

impl WindowSampler {
    /// A sampler over `n_windows` windows with `global_batch` windows per step. Fails if one global batch
    /// does not fit in the data.
    pub fn new(n_windows: u64, global_batch: usize, shuffle: bool, seed: u64) -> Result<Self> {
        Self::build(n_windows, global_batch, shuffle, seed, None)
    }

    /// Like [`WindowSampler::new`] for a stream of `n_tokens` tokens and sequence length `t`; the error
    /// says how many tokens are needed.
    pub fn for_tokens(n_tokens: u64, t: usize, global_batch: usize, shuffle: bool, seed: u64) -> Result<Self> {
        if t == 0 {
            return Err(DataError::InvalidArgument("sequence length must be at least 1".into()));
        }
        let needed = (global_batch as u64).saturating_mul(t as u64).saturating_add(1);
        Self::build(
            super::stream::n_windows(n_tokens, t),
            global_batch,
            shuffle,
            seed,
            Some(needed),
        )
    }

    fn build(n_windows: u64, global_batch: usize, shuffle: bool, seed: u64, needed: Option<u64>) -> Result<Self> {
        if global_batch == 0 {
            return Err(DataError::InvalidArgument("global batch must be at least 1".into()));
        }
        let g = global_batch as u64;
        if n_windows < g {
            return Err(DataError::TooFewWindows {
                n_windows,
                global_batch: g,
                needed_tokens: needed,
            });
        }
        if shuffle && usize::try_from(n_windows).is_err() {
            return Err(DataError::InvalidArgument(format!(
                "{n_windows} windows are too many to shuffle"
            )));
        }
        Ok(WindowSampler {
            n_windows,
            global_batch: g,
            shuffle,
            seed,
            cache: Mutex::new(None),
        })
    }

    pub fn n_windows(&self) -> u64 {
        self.n_windows
    }

    pub fn global_batch(&self) -> usize {
        self.global_batch as usize
    }

    /// Whole global batches per epoch; the `n_windows % G` windows left over are skipped in that epoch.
    pub fn steps_per_epoch(&self) -> u64 {
        self.n_windows / self.global_batch
    }

    /// The epoch that global step `step` belongs to.
    pub fn epoch_of(&self, step: u64) -> u64 {
        step / self.steps_per_epoch()
    }

    /// The window order of an epoch: identity without shuffle, else Fisher–Yates over ChaCha8 keyed by
    /// (seed, epoch).
    pub fn epoch_order(&self, epoch: u64) -> Arc<Vec<u64>> {
        if !self.shuffle {
            return Arc::new((0..self.n_windows).collect());
        }
        let mut cache = self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((e, perm)) = cache.as_ref() {
            if *e == epoch {
                return perm.clone();
            }
        }
        let mut perm: Vec<u64> = (0..self.n_windows).collect();
        shuffle(&mut keyed_rng(SHUFFLE_TAG, self.seed, epoch), &mut perm);
        let perm = Arc::new(perm);
        *cache = Some((epoch, perm.clone()));
        perm
    }

    /// The G window indices of global step `step`, in the order that `split_for_rank` cuts.
    pub fn windows_for_step(&self, step: u64) -> Vec<u64> {
        let spe = self.steps_per_epoch();
        let (epoch, pos) = (step / spe, step % spe);
        let start = pos * self.global_batch;
        if !self.shuffle {
            return (start..start + self.global_batch).collect();
        }
        let order = self.epoch_order(epoch);
        order[start as usize..(start + self.global_batch) as usize].to_vec()
    }
}

/// The micro-batches of one rank: `grad_accum` lists of `batch` window indices.
///
/// The global batch of `world × batch × grad_accum` windows is laid out micro-step-major: micro-step k of
/// rank r is the contiguous slice starting at `(k·world + r)·batch`. So all ranks' k-th micro-steps together
/// are the contiguous block k, each rank's micro-batch is contiguous, and the union over ranks and
/// micro-steps is exactly the global batch for any factorisation of G.
pub fn split_for_rank(
    windows: &[u64],
    rank: usize,
    world: usize,
    batch: usize,
    grad_accum: usize,
) -> Result<Vec<Vec<u64>>> {
    if world == 0 || batch == 0 || grad_accum == 0 {
        return Err(DataError::InvalidArgument(format!(
            "world ({world}), batch ({batch}) and grad_accum ({grad_accum}) must all be at least 1"
        )));
    }
    if rank >= world {
        return Err(DataError::InvalidArgument(format!(
            "rank {rank} is out of range for world size {world}"
        )));
    }
    let expected = world.checked_mul(batch).and_then(|x| x.checked_mul(grad_accum));
    if expected != Some(windows.len()) {
        return Err(DataError::InvalidArgument(format!(
            "a global batch of {} windows cannot be split as world {world} × batch {batch} × grad_accum {grad_accum}",
            windows.len()
        )));
    }
    Ok((0..grad_accum)
        .map(|k| {
            let start = (k * world + rank) * batch;
            windows[start..start + batch].to_vec()
        })
        .collect())
}

/// Fills `inputs` and `targets` (each `windows.len() × t`, row-major) from the given windows: row i holds
/// tokens `[w·t, w·t + t)` and targets `[w·t + 1, w·t + t + 1)` for `w = windows[i]`.
pub fn fill_batch(
    stream: &TokenStream,
    windows: &[u64],
    t: usize,
    inputs: &mut [u32],
    targets: &mut [u32],
) -> Result<()> {
    let need = windows.len().checked_mul(t);
    if t == 0 || need != Some(inputs.len()) || need != Some(targets.len()) {
        return Err(DataError::InvalidArgument(format!(
            "batch buffers hold {} inputs and {} targets, expected {} windows × {t} tokens",
            inputs.len(),
            targets.len(),
            windows.len()
        )));
    }
    let n_windows = stream.n_windows(t);
    let mut row = vec![0u32; t + 1];
    for (i, &w) in windows.iter().enumerate() {
        if w >= n_windows {
            return Err(DataError::InvalidArgument(format!(
                "window {w} is out of range: {} has {n_windows} windows of {t} tokens",
                stream.name()
            )));
        }
        stream.copy_range(w * t as u64, &mut row)?;
        inputs[i * t..(i + 1) * t].copy_from_slice(&row[..t]);
        targets[i * t..(i + 1) * t].copy_from_slice(&row[1..]);
    }
    Ok(())
}

/// Deterministic evaluation batches: the first `min(n_windows, max_batches × batch)` windows in order, cut
/// into batches of `batch` (only whole batches, so every eval step has the same shape). Empty if the
/// validation data has fewer than `batch` windows or `batch == 0`.
pub fn eval_windows(n_windows: u64, max_batches: usize, batch: usize) -> Vec<Vec<u64>> {
    if batch == 0 {
        return Vec::new();
    }
    let n_batches = (n_windows / batch as u64).min(max_batches as u64);
    (0..n_batches)
        .map(|b| (b * batch as u64..(b + 1) * batch as u64).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_few_windows_says_how_many_tokens() {
        let err = WindowSampler::for_tokens(100, 16, 8, true, 0).unwrap_err().to_string();
        assert!(
            err.contains("6 windows") && err.contains("needs 8") && err.contains("129 tokens"),
            "{err}"
        );
        assert!(WindowSampler::new(3, 4, false, 0).is_err());
        assert!(WindowSampler::new(4, 0, false, 0).is_err());
    }

    #[test]
    fn tail_is_dropped_each_epoch() {
        let s = WindowSampler::new(10, 4, false, 0).unwrap();
        assert_eq!(s.steps_per_epoch(), 2);
        assert_eq!(s.windows_for_step(0), vec![0, 1, 2, 3]);
        assert_eq!(s.windows_for_step(1), vec![4, 5, 6, 7]);
        assert_eq!(s.windows_for_step(2), vec![0, 1, 2, 3]);
        assert_eq!(s.epoch_of(5), 2);
    }

    #[test]
    fn split_layout_is_micro_step_major() {
        let w: Vec<u64> = (0..8).collect();
        assert_eq!(split_for_rank(&w, 1, 2, 2, 2).unwrap(), vec![vec![2, 3], vec![6, 7]]);
        assert!(split_for_rank(&w, 2, 2, 2, 2).is_err());
        assert!(split_for_rank(&w, 0, 2, 3, 1).is_err());
    }

    #[test]
    fn eval_windows_whole_batches() {
        assert_eq!(eval_windows(7, 10, 3), vec![vec![0, 1, 2], vec![3, 4, 5]]);
        assert_eq!(eval_windows(100, 1, 2), vec![vec![0, 1]]);
        assert!(eval_windows(1, 4, 2).is_empty());
    }
}
