//! A re-formed group between steps: the collective replaced, the optimizer state re-cut for this rank's
//! chunks, and the sync told of the new ownership ([`GradientSync::membership_changed`](super::sync)).

use super::shard_guard::ShardGuard;
use super::Trainer;
use crate::backend::Backend;
use crate::collective::comm_thread::CommThread;
use crate::collective::Collective;
use crate::optim::AdamW;
use anyhow::{ensure, Context, Result};

impl<B: Backend> Trainer<B> {
    /// Replaces the collective between steps with `comm`, a re-formed group of the same size: the same
    /// members connected again, possibly numbered differently. Collective over the old group and the new
    /// one alike: every rank calls it between the same two steps. When this rank's number changes and the
    /// moments are sharded, they are gathered over the old group and re-cut for the chunks the new number
    /// owns; the rank then computes the share of each global batch its new number gives it, so the run
    /// continues with the bits it would have had without the change. A group of another size is refused:
    /// its global batch and shards would have to be re-split, which this build does not do.
    pub fn replace_collective(&mut self, comm: Box<dyn Collective>) -> Result<()> {
        let (world, rank, owner) = (comm.world(), comm.rank(), comm.owner());
        ensure!(
            world == self.world,
            "the re-formed group has {world} ranks, this run {}: a change of size needs the global batch and the \
             optimizer's shards re-split, which this build does not do",
            self.world
        );
        self.settle_params()?;
        // Every rank gathers (a rank cannot know whether the others' parts change); one whose part
        // changed (a new number or a new layout) then keeps the chunks of its new one.
        let sharded = !self.moments_are_replicated();
        let full = if sharded { Some(self.full_moments()?) } else { None };
        if let (Some((m, v)), true) = (full, owner != self.owner) {
            let owned = self.plan.owned(self.opts.update, &owner);
            let mut opt = AdamW::for_ranges(&mut self.be, self.opt.config, owned)?;
            opt.step = self.opt.step;
            self.be.upload(opt.m, &opt.cut(&m))?;
            self.be.upload(opt.v, &opt.cut(&v))?;
            let old = std::mem::replace(&mut self.opt, opt);
            self.be.free(old.m);
            self.be.free(old.v);
        }
        self.comm = CommThread::spawn(comm).context("starting the communication thread")?;
        self.rank = rank;
        self.sync.membership_changed(&self.plan, &owner)?;
        self.owner = owner;
        // The shard checksum was of the old chunk; it starts again with the next update.
        self.guard = ShardGuard::for_run(&self.opts, world);
        Ok(())
    }
}
