//! Checkpoints of a run: the model and the trainer state, with the sharded moments gathered from their
//! owners; rank 0 writes ([`crate::model::checkpoint`] makes the write atomic).

use super::Trainer;
use crate::backend::Backend;
use crate::model::checkpoint::{self, TrainerState};
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// The sync-tensor names of the other ranks' inner moments in a `--sync outer` checkpoint.
pub(super) const INNER_M: &str = "inner_exp_avg";
pub(super) const INNER_V: &str = "inner_exp_avg_sq";
/// Each rank's own parameters in a `--sync outer` checkpoint saved between outer steps.
pub(super) const INNER_P: &str = "inner_params";
/// A u64's bits as two f32s (low half first), stored exactly in an F32 tensor.
pub(super) fn u64_as_f32_pair(n: u64) -> [f32; 2] {
    [f32::from_bits(n as u32), f32::from_bits((n >> 32) as u32)]
}

/// The u64 [`u64_as_f32_pair`] stored.
pub(super) fn u64_from_f32_pair(pair: [f32; 2]) -> u64 {
    u64::from(pair[0].to_bits()) | (u64::from(pair[1].to_bits()) << 32)
}

/// Each rank's outer round under way (its own inner losses, then its inner optimizer step as an f32 pair)
/// in a `--sync outer` checkpoint.
pub(super) const INNER_ROUND: &str = "inner_round";
/// Each rank's own round start in a `--sync outer --outer-overlap on` checkpoint.
pub(super) const INNER_ROUND_START: &str = "inner_round_start";
/// What every per-rank tensor name starts with.
pub(super) const INNER_PREFIX: &str = "inner_";

impl<B: Backend> Trainer<B> {
    /// Writes a checkpoint (model + trainer state) atomically to `dir`. Collective: every rank must call
    /// it (sharded moments are gathered first); rank 0 writes.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        self.settle_params()?;
        let mut params = self.model.download_params(&mut self.be)?;
        let (m, v) = self.full_moments()?;
        // A resumed run that saves before its first step still holds the state it read.
        let mut sync = match self.resumed_sync_state.clone() {
            Some(state) => state,
            None => self.sync.checkpoint_state(&mut self.be, &self.comm)?,
        };
        if let Some(outer) = self.opts.sync.outer() {
            // Between outer steps every rank's parameters are its own: each is kept (with --outer-overlap on,
            // each rank's round start too), and the model files hold the newest shared parameters (what
            // `sample` and `--init` read).
            let mid_round = self.step % outer.every != 0;
            let local = mid_round.then_some(params.as_slice());
            let mut round = sync
                .remove(super::outer_sync::ROUND)
                .context("the outer sync kept no round")?;
            // With this rank's inner optimizer step: each rank skips its own non-finite steps.
            round.extend(u64_as_f32_pair(self.opt.step));
            let round_start = sync.remove(super::outer_sync::ROUND_START);
            sync.extend(self.gather_inner_state(&m, &v, &round, local, round_start.as_deref())?);
            let shared = match self.sync.shared_params() {
                Some(shared) => Some(shared.to_vec()),
                // Resumed between outer steps and saved before its first step: the device holds this rank's
                // own parameters, and the state read names the shared ones.
                None if mid_round && self.resumed_sync_state.is_some() => Some(
                    super::outer_sync::newest_shared(&sync)
                        .context("the outer sync kept no anchor")?
                        .to_vec(),
                ),
                None => None,
            };
            if let Some(shared) = shared {
                params = shared;
            }
        }
        if self.rank != 0 {
            return Ok(());
        }
        let mut extra = BTreeMap::new();
        extra.insert("optimizer_step".to_string(), self.opt.step.to_string());
        extra.insert("train_args".to_string(), self.opts.args_json.clone());
        extra.insert("update".to_string(), self.opts.update.as_str().to_string());
        extra.insert("global_batch".to_string(), self.batch.global.to_string());
        let shares: Vec<String> = self.batch.shares.iter().map(|n| n.to_string()).collect();
        extra.insert("batch_shares".to_string(), shares.join(","));
        if let Some(auto) = &self.auto_split {
            auto.checkpoint_extra(&mut extra);
        }
        extra.insert(
            "sampler".to_string(),
            "order is a pure function of (seed, epoch); no RNG state to save".into(),
        );
        let state = TrainerState {
            step: self.step,
            tokens_seen: self.tokens_seen,
            data_cursor: self.step * self.sampler.global_batch() as u64,
            world_size: self.world,
            config_hash: self.model.config.hash_hex(),
            seed: self.opts.seed,
            m,
            v,
            extra,
            sync,
        };
        checkpoint::save_checkpoint(dir, &self.model.config, &self.model.layout, &params, Some(&state))
    }

    /// `--sync outer`: every other rank's inner moments (`m`, `v` are this rank's), which differ from rank
    /// 0's by design, as sync tensors `inner_exp_avg.rank<R>` and `inner_exp_avg_sq.rank<R>`, every rank's
    /// outer round under way (`round`, its own inner losses) as `inner_round.rank<R>`, and between
    /// outer steps every rank's own parameters (`local`) as `inner_params.rank<R>` (rank 0's too), and with
    /// `--outer-overlap on` every rank's round start as `inner_round_start.rank<R>`, for rank 0 to write, so
    /// that a resume continues each rank with its own bits. Collective: each rank broadcasts
    /// its tensors in turn (one `[P]` buffer at a time on every rank); the others' state is empty.
    fn gather_inner_state(
        &mut self,
        m: &[f32],
        v: &[f32],
        round: &[f32],
        local: Option<&[f32]>,
        round_start: Option<&[f32]>,
    ) -> Result<super::sync::SyncState> {
        let mut state = super::sync::SyncState::new();
        for root in 0..self.world {
            let mut tensors: Vec<(&str, &[f32])> = vec![(INNER_ROUND, round)];
            if root > 0 {
                tensors.extend([(INNER_M, m), (INNER_V, v)]);
            }
            tensors.extend(local.map(|p| (INNER_P, p)));
            tensors.extend(round_start.map(|p| (INNER_ROUND_START, p)));
            for (name, mine) in tensors {
                let mut buf = if self.rank == root {
                    mine.to_vec()
                } else {
                    vec![0f32; mine.len()]
                };
                if root > 0 {
                    buf = self.comm.run(move |c| c.broadcast(&mut buf, root).map(|()| buf))?;
                }
                if self.rank == 0 {
                    state.insert(format!("{name}.rank{root}"), buf);
                }
            }
        }
        Ok(state)
    }

    /// Both AdamW moments as full flat tensors on every rank. Collective when they are sharded: each rank
    /// holds its chunk of every bucket, and the chunks are all-gathered.
    pub(super) fn full_moments(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        let total = self.model.layout.total;
        let (mut m, mut v) = (vec![0f32; total], vec![0f32; total]);
        for (moment, view) in [(&mut m, self.opt.m), (&mut v, self.opt.v)] {
            let mut owned = vec![0f32; view.len];
            self.be.download(view, &mut owned)?;
            self.opt.place(&owned, moment);
            if !self.moments_are_replicated() {
                self.gather_moment(moment)?;
            }
        }
        Ok((m, v))
    }

    /// All-gathers a sharded moment, bucket by bucket (rank r holds chunk r of each).
    fn gather_moment(&mut self, moment: &mut [f32]) -> Result<()> {
        for range in self.plan.buckets.clone() {
            let part = moment[range.clone()].to_vec();
            let part = self.comm.run(move |c| {
                let mut part = part;
                c.all_gather(&mut part).map(|()| part)
            })?;
            moment[range].copy_from_slice(&part);
        }
        Ok(())
    }
}
