//! Replicas that agree: the start of a run (every rank takes rank 0's state when they differ), the
//! fingerprints `--verify-every` compares, and the resync that `--on-divergence resync` asks for.

use super::{OnDivergence, Trainer, UpdateMode};
use crate::backend::{Backend, View};
use crate::collective::diverged_ranks;
use anyhow::{bail, Result};

impl<B: Backend> Trainer<B> {
    /// Stage 1: every rank must start from the same parameters (and moments). Hashes are compared; on a
    /// mismatch rank 0's state is broadcast. Returns whether a broadcast happened.
    pub fn replicate(&mut self) -> Result<bool> {
        // A --sync outer run resumed between outer steps, or after the first with --outer-overlap on:
        // each rank's parameters are its own.
        let own = self
            .opts
            .sync
            .outer()
            .is_some_and(|o| self.step % o.every != 0 || (o.overlap && self.step >= o.every));
        if self.world == 1 || own {
            return Ok(false);
        }
        let hash = self.state_hash(self.moments_are_replicated() && self.opts.sync.outer().is_none())?;
        let hashes = self.comm.run(move |c| c.gather_hashes(hash))?;
        if diverged_ranks(&hashes).is_empty() {
            return Ok(false);
        }
        self.broadcast_state()?;
        Ok(true)
    }

    /// Whether every rank holds the whole optimizer state (replicated update, or one rank), so that the
    /// moments are part of what replicas must agree on.
    pub(super) fn moments_are_replicated(&self) -> bool {
        self.opt.owned_len() == self.model.layout.total
    }

    /// The views every replica must hold bit for bit: the parameters (unless the sync says the device holds
    /// this rank's own, [`super::sync::GradientSync::shared_params`]), plus the moments when replicated.
    fn replicated_views(&self, with_moments: bool) -> Vec<View> {
        let mut views = Vec::new();
        if self.sync.shared_params().is_none() {
            views.push(self.model.params);
        }
        if with_moments {
            views.extend([self.opt.m, self.opt.v]);
        }
        views
    }

    /// blake3 over the parameters (and, when asked, both moments): the replica fingerprint.
    pub(super) fn state_hash(&mut self, with_moments: bool) -> Result<[u8; 32]> {
        self.settle_params()?;
        let mut hasher = blake3::Hasher::new();
        for view in self.replicated_views(with_moments) {
            let mut host = vec![0f32; view.len];
            self.be.download(view, &mut host)?;
            hash_into(&mut hasher, &host);
        }
        for values in self.sync.replicated_state() {
            hash_into(&mut hasher, values);
        }
        Ok(*hasher.finalize().as_bytes())
    }

    /// Copies rank 0's replicated state (parameters, and moments when every rank holds them all) to every
    /// rank.
    fn broadcast_state(&mut self) -> Result<()> {
        self.broadcast_state_from(0)
    }

    /// Copies rank `root`'s replicated state to every rank.
    pub(super) fn broadcast_state_from(&mut self, root: usize) -> Result<()> {
        self.settle_params()?;
        // With --sync outer each rank's inner moments are its own.
        let with_moments = self.moments_are_replicated() && self.opts.sync.outer().is_none();
        for view in self.replicated_views(with_moments) {
            let mut host = vec![0f32; view.len];
            self.be.download(view, &mut host)?;
            let host = self.comm.run(move |c| c.broadcast(&mut host, root).map(|()| host))?;
            self.be.upload(view, &host)?;
        }
        for values in self.sync.replicated_state() {
            let mut host = values.to_vec();
            let host = self.comm.run(move |c| c.broadcast(&mut host, root).map(|()| host))?;
            values.copy_from_slice(&host);
        }
        Ok(())
    }

    /// Compares replica fingerprints (parameters; plus moments in replicated mode, where each rank keeps
    /// the whole optimizer state; plus the sync's replicated state, such as `--sync outer`'s anchor and
    /// momentum), after the step's update has counted it. On a mismatch: abort naming the ranks, or resync from rank 0.
    pub(super) fn verify_replicas(&mut self) -> Result<String> {
        // With --sync outer each rank's inner moments are its own by design: only the parameters agree.
        let with_moments = self.opts.update == UpdateMode::Replicated && self.opts.sync.outer().is_none();
        let hash = self.state_hash(with_moments)?;
        if self.world > 1 {
            let hashes = self.comm.run(move |c| c.gather_hashes(hash))?;
            let diverged = diverged_ranks(&hashes);
            if !diverged.is_empty() {
                match self.opts.on_divergence {
                    OnDivergence::Abort => bail!(
                        "step {}: replicas diverged: rank(s) {diverged:?} differ from the others \
                         (--on-divergence resync would copy rank 0's state)",
                        self.step
                    ),
                    OnDivergence::Resync => {
                        tracing::warn!(
                            "step {}: rank(s) {diverged:?} diverged; resyncing from rank 0",
                            self.step
                        );
                        // Sharded moments belong to their rank; only what is replicated is copied.
                        self.broadcast_state()?;
                        // The copy rewrote this rank's parameter chunks too.
                        self.guard
                            .record(&mut self.be, self.model.params, &self.opt, self.step)?;
                        return Ok(blake3::Hash::from(self.state_hash(with_moments)?).to_hex().to_string());
                    }
                }
            }
        }
        Ok(blake3::Hash::from(hash).to_hex().to_string())
    }

    /// blake3 of the parameter bytes (little-endian f32), hex.
    pub fn param_hash(&mut self) -> Result<String> {
        self.settle_params()?;
        let params = self.model.download_params(&mut self.be)?;
        Ok(hash_f32(&params))
    }

    /// Whether the device holds this rank's own parameters rather than the ones every replica shares.
    pub fn holds_own_params(&self) -> bool {
        self.sync.shared_params().is_some()
    }

    /// The parameters every replica holds alike, in the flat layout: the device's, or the sync's shared ones
    /// when the device holds this rank's own (`--sync outer` between outer steps, and after them with
    /// `--outer-overlap on`).
    pub fn shared_params(&mut self) -> Result<Vec<f32>> {
        self.settle_params()?;
        match self.sync.shared_params() {
            Some(shared) => Ok(shared.to_vec()),
            None => self.model.download_params(&mut self.be),
        }
    }

    /// blake3 of [`Trainer::shared_params`], hex.
    pub fn shared_param_hash(&mut self) -> Result<String> {
        Ok(hash_f32(&self.shared_params()?))
    }
}

pub(super) fn hash_into(hasher: &mut blake3::Hasher, values: &[f32]) {
    for chunk in values.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
        hasher.update(&bytes);
    }
}

/// blake3 of f32s as little-endian bytes, hex: the replica fingerprint.
pub fn hash_f32(values: &[f32]) -> String {
    let mut hasher = blake3::Hasher::new();
    hash_into(&mut hasher, values);
    hasher.finalize().to_hex().to_string()
}
