//! A re-formed group between steps: the collective replaced, the optimizer state re-cut for this rank's
//! chunks, and the sync told of the new ownership ([`GradientSync::membership_changed`](super::sync)).

use super::auto_split::AutoSplit;
use super::grad_sync::Reduction;
use super::shard_guard::ShardGuard;
use super::Trainer;
use crate::backend::Backend;
use crate::collective::comm_thread::CommThread;
use crate::collective::{Collective, Owner};
use crate::data::{BatchPlan, BatchSplit};
use crate::elastic::{Membership, MembershipChange};
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
        let (world, owner) = (comm.world(), comm.owner());
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
            self.recut_optimizer(&owner, &m, &v)?;
            self.layout.owner = owner.clone();
        }
        self.install_group(comm, owner)
    }

    /// Cuts the optimizer state for the rank of `owner` from the full moments `m` and `v` (`[P]` each): its
    /// own chunks, and the mirror of its left neighbour's when the run keeps one. The step count is kept.
    pub(super) fn recut_optimizer(&mut self, owner: &Owner, m: &[f32], v: &[f32]) -> Result<()> {
        let owned = self.plan.owned(self.opts.update, owner);
        let mut opt = AdamW::for_ranges(&mut self.be, self.opt.config, owned)?;
        let mut mirror = super::buddy::mirror_for(&mut self.be, &self.opts, &self.plan, owner)?;
        for new in std::iter::once(&mut opt).chain(mirror.as_mut()) {
            new.step = self.opt.step;
            self.be.upload(new.m, &new.cut(m))?;
            self.be.upload(new.v, &new.cut(v))?;
        }
        let old = std::mem::replace(&mut self.opt, opt);
        for old in std::iter::once(old).chain(std::mem::replace(&mut self.mirror, mirror)) {
            self.be.free(old.m);
            self.be.free(old.v);
        }
        Ok(())
    }

    /// Puts `comm` (whose ownership map is `owner`) on a new communication thread in place of the old
    /// group's, takes its world and rank, and tells the sync of the new ownership and of how the current
    /// batch plan reduces. The shard checksum was of the old chunk; it starts again with the next update.
    fn install_group(&mut self, comm: Box<dyn Collective>, owner: Owner) -> Result<()> {
        (self.world, self.rank) = (comm.world(), comm.rank());
        self.comm = super::comm_thread(comm, self.opts.wire)?;
        self.sent_mark = 0;
        let reduction = Reduction::of(&self.batch, self.opts.seq_len);
        self.sync
            .membership_changed(&mut self.be, &self.plan, &owner, reduction)?;
        self.owner = owner;
        self.guard = ShardGuard::for_run(&self.opts, self.world);
        Ok(())
    }
}

/// What each survivor tells the others when a group is re-formed after a loss: the last step it committed
/// (parameters updated), its optimizer's step count, its token count and the fingerprint of its
/// replicated state. 56 bytes, little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SurvivorState {
    committed: u64,
    optimizer_step: u64,
    tokens_seen: u64,
    hash: [u8; 32],
}

impl SurvivorState {
    const BYTES: usize = 56;

    fn to_bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::BYTES);
        for n in [self.committed, self.optimizer_step, self.tokens_seen] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&self.hash);
        out
    }

    fn from_bytes(rank: usize, bytes: &[u8]) -> Result<Self> {
        ensure!(
            bytes.len() == Self::BYTES,
            "rank {rank} sent a {}-byte survivor state, not {}",
            bytes.len(),
            Self::BYTES
        );
        let word = |i: usize| u64::from_le_bytes(bytes[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        Ok(SurvivorState {
            committed: word(0),
            optimizer_step: word(1),
            tokens_seen: word(2),
            hash: bytes[24..].try_into().expect("32 bytes"),
        })
    }
}

impl<B: Backend> Trainer<B> {
    /// Continues on `comm`, the group of the survivors of a loss (`membership`, already agreed), of any
    /// size. Collective over the new group: every survivor calls it.
    ///
    /// The survivors exchange the last step each committed; all continue from the highest (a loss during a
    /// step's last collective can leave some survivors one step ahead: catching up needs no copy kept for a
    /// rollback). Replicated, those behind take the whole state of the lowest-numbered rank that committed
    /// it; sharded, they apply the step from the gradient still on their device, and the state is rebuilt
    /// from the chunks' owners and buddies ([`super::buddy`]).
    /// The global batch stays the same and is re-split evenly over the new group (`auto` starts measuring
    /// afresh), so a step's data does not depend on who is left. Returns the step the group continues from.
    pub fn reform(&mut self, comm: Box<dyn Collective>, membership: Membership) -> Result<u64> {
        self.reform_as(comm, membership, false)
    }

    /// [`Trainer::reform`]; `joining`: this trainer is a new member, holding none of the job's state.
    fn reform_as(&mut self, comm: Box<dyn Collective>, membership: Membership, joining: bool) -> Result<u64> {
        let sharded = self.opts.update == super::UpdateMode::Sharded;
        ensure!(
            sharded || self.moments_are_replicated(),
            "an elastic re-form of the replicated update needs every survivor to hold the whole optimizer state"
        );
        let world = comm.world();
        ensure!(
            world == membership.world() && world >= 1,
            "the re-formed group has {world} ranks, its membership {}",
            membership.world()
        );
        let owner = comm.owner();
        let global = self.batch.global;
        let split = match self.opts.batch_split {
            BatchSplit::Auto => BatchSplit::Even,
            ref other => other.clone(),
        };
        self.batch = BatchPlan::new(global, world, &split, self.opts.batch_size, self.opts.grad_accum)?;
        self.auto_split = (self.opts.batch_split == BatchSplit::Auto && world > 1).then(AutoSplit::default);
        // The sync forgets the failed step; a gradient it had reduced stays on the device for a roll-forward.
        if let Some(step) = self.sync.reduced_step().filter(|&s| s == self.step) {
            self.reduced_step = Some(step);
        }
        // The old thread holds a failed collective; whatever it still had queued fails with it.
        self.install_group(comm, owner)?;
        self.faults = self.armed_faults.for_members(&membership.members);
        self.membership = membership;
        let resumed = match sharded {
            true => self.rebuild_sharded(joining)?,
            false => self.catch_up()?,
        };
        // The catch-up's transfers are the re-form's, not the next step's traffic.
        self.sent_mark = self.comm.sent_bytes();
        Ok(resumed)
    }

    /// A new member takes its place in a running elastic job: `comm` is the group that admitted it (with
    /// `membership`, which it is part of), and this trainer, built over a one-rank collective with the
    /// job's global batch, receives the parameters, moments and step through [`Trainer::reform`]'s
    /// catch-up. Collective: the running members re-form at the same time. Returns the step the group
    /// continues from.
    pub fn join_running(&mut self, comm: Box<dyn Collective>, membership: Membership) -> Result<u64> {
        ensure!(
            self.world == 1,
            "only a trainer of its own (a one-rank group) can join a running job"
        );
        let since = std::time::Instant::now();
        let (epoch, members) = (membership.epoch, membership.members.clone());
        let me = *members
            .get(comm.rank())
            .context("the admitting group has no place for this rank")?;
        let resumed = self.reform_as(comm, membership, true)?;
        let change = MembershipChange {
            epoch,
            lost: Vec::new(),
            joined: vec![me],
            members,
            resumed_from_step: resumed,
            recovery_ms: 0.0,
        };
        self.pending_change = Some((change, since));
        Ok(resumed)
    }

    /// Drops the failed group's collective (and its thread), so that its sockets and ports are free before
    /// the next group forms; a one-rank placeholder stands in until [`Trainer::reform`].
    pub(super) fn release_collective(&mut self) -> Result<()> {
        self.comm =
            CommThread::spawn(crate::collective::mem::single_rank()).context("starting the communication thread")?;
        self.sent_mark = 0;
        Ok(())
    }

    /// Brings every survivor to the highest committed step among them (see [`Trainer::reform`]).
    fn catch_up(&mut self) -> Result<u64> {
        let mine = SurvivorState {
            committed: self.step,
            optimizer_step: self.opt.step,
            tokens_seen: self.tokens_seen,
            hash: self.state_hash(true)?,
        };
        let all = self.comm.run(move |c| c.gather_bytes(mine.to_bytes()))?;
        let states = all
            .iter()
            .enumerate()
            .map(|(r, b)| SurvivorState::from_bytes(r, b))
            .collect::<Result<Vec<_>>>()?;
        let newest = states.iter().map(|s| s.committed).max().unwrap_or(self.step);
        let source = states.iter().position(|s| s.committed == newest).unwrap_or(0);
        let reference = states[source];
        if states.iter().any(|s| s.hash != reference.hash) {
            self.broadcast_state_from(source)?;
            let hash = self.state_hash(true)?;
            ensure!(
                hash == reference.hash,
                "rank {}: after taking rank {source}'s state at step {newest} its fingerprint still differs",
                self.rank
            );
        }
        self.step = reference.committed;
        self.opt.step = reference.optimizer_step;
        self.tokens_seen = reference.tokens_seen;
        Ok(newest)
    }
}
