//! Nothing lost in an elastic sharded run: the buddy mirrors, and the re-form that rebuilds the state from
//! them after a loss.
//!
//! Under `--update sharded` (ZeRO-1) a rank keeps the moments of its own chunk of every bucket, and between
//! its update and the next forward the newest values of its parameter chunk exist only on it and in the
//! all-gathers in flight. With `--elastic` each rank is the buddy of its left neighbour: the reduce-scatter
//! of each bucket is followed by a shift of the reduced chunk to the right neighbour
//! ([`Collective::shift_right`](crate::collective::Collective::shift_right), P/N floats per rank and step),
//! and the buddy runs the same AdamW update over its mirror (moments of the neighbour's chunk, and that chunk
//! of its own parameter buffer, which the all-gather then overwrites with the owner's bits). On one backend
//! the mirror equals the owner's chunk bit for bit (the same kernel over the same tensor pieces and inputs).
//!
//! After a loss the survivors first agree on the last committed step: a survivor whose agreement on the
//! scalars of a step failed while another's completed rolls that step forward from the gradient still on
//! its device and the scalars the other tells it (completing the agreement needs every rank's contribution,
//! which each sends only after its reduce-scatter and shift, so every survivor holds its reduced chunks).
//! Then every chunk of the old layout is taken from its owner, or from its buddy when the owner was lost;
//! the survivors all-gather those pieces into the full moments (and the full parameters, unless every
//! member's already match: no gather was cut short and nobody joined), and each keeps the chunk and the
//! mirror of its place in the new group. Losing an owner and its buddy at once leaves a chunk nobody
//! holds: the job stops naming both, and continues from its last checkpoint.

use super::options::UpdateMode;
use super::sync::AgreedStep;
use super::{BucketPlan, TrainOptions, Trainer};
use crate::backend::Backend;
use crate::collective::Owner;
use crate::elastic::MemberId;
use crate::optim::AdamW;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// The ownership map of `owner`'s left neighbour on the flat ring, whose chunk `owner`'s rank mirrors; none
/// for a lone rank or two levels.
pub fn left_of(owner: &Owner) -> Option<Owner> {
    match owner {
        Owner::Flat { world, rank } if *world > 1 => Some(Owner::flat(*world, (rank + world - 1) % world)),
        _ => None,
    }
}

/// Whether a run keeps buddy mirrors whenever its group has several ranks: elastic and sharded.
pub fn mirrors_wanted(opts: &TrainOptions) -> bool {
    opts.elastic.is_some() && opts.update == UpdateMode::Sharded
}

/// The mirror optimizer of `owner`'s left neighbour's chunks, when the run keeps mirrors and the group has
/// one; its moments start at zero (callers upload what they restore).
pub fn mirror_for<B: Backend>(
    be: &mut B,
    opts: &TrainOptions,
    plan: &BucketPlan,
    owner: &Owner,
) -> Result<Option<AdamW>> {
    match left_of(owner).filter(|_| mirrors_wanted(opts)) {
        Some(left) => Ok(Some(AdamW::for_ranges(
            be,
            opts.adamw,
            plan.owned(UpdateMode::Sharded, &left),
        )?)),
        None => Ok(None),
    }
}

/// The group whose chunks a trainer's optimizer state is cut by: its members in rank order and this rank's
/// ownership map in it.
#[derive(Clone, Debug)]
pub struct StateLayout {
    pub members: Vec<MemberId>,
    pub owner: Owner,
}

impl StateLayout {
    /// The first group of a run: members named by their first ranks.
    pub fn first(world: usize, owner: Owner) -> Self {
        StateLayout {
            members: (0..world as MemberId).collect(),
            owner,
        }
    }
}

/// What each member of a re-formed sharded group tells the others (JSON, padded to a common length for the
/// byte gather).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct ShardedSurvivor {
    /// Steps committed (parameters updated).
    committed: u64,
    optimizer_step: u64,
    tokens_seen: u64,
    /// The last step whose scalars this rank agreed on: 0-based index, loss, squared gradient norm.
    agreed: Option<(u64, f64, f64)>,
    /// The 0-based index of a step whose reduced gradient is still on this rank's device.
    reduced: Option<u64>,
    /// A new member, which holds nothing of the job's state.
    joining: bool,
    /// Why the state cannot be rebuilt, when this member found that part of it is on no survivor.
    lost: Option<String>,
    /// The flat ranges whose parameters and moments this rank contributes, as (start, length), in the
    /// order of its contribution.
    ranges: Vec<(usize, usize)>,
}

/// Who holds every chunk of `layout`'s group after the loss of everyone not in `members` (the new group):
/// (chunk's old rank, the old rank of its holder), or why the state is lost.
fn holders(layout: &StateLayout, members: &[MemberId]) -> Result<Vec<(usize, usize)>> {
    let world = layout.members.len();
    let alive = |rank: usize| members.contains(&layout.members[rank]);
    let mut held = Vec::with_capacity(world);
    for rank in 0..world {
        let buddy = (rank + 1) % world;
        let holder = match (alive(rank), world > 1 && alive(buddy)) {
            (true, _) => rank,
            (false, true) => buddy,
            (false, false) => bail!(
                "member {} and member {}, its buddy, were lost at once: the optimizer chunk and newest parameters \
                 member {0} owned are on no survivor, so the job cannot continue from live state; restart it from \
                 its last checkpoint (--resume)",
                layout.members[rank],
                layout.members[buddy]
            ),
        };
        held.push((rank, holder));
    }
    Ok(held)
}

/// Whether every survivor behind the newest committed step can roll it forward: one step behind, with that
/// step's reduced gradient on its device and the scalars a survivor that committed it agreed on.
fn catch_up_possible(states: &[ShardedSurvivor], newest: u64) -> Result<()> {
    for (rank, s) in states
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.joining && s.committed < newest)
    {
        ensure!(
            s.committed + 1 == newest,
            "rank {rank} committed {} steps and another survivor {newest}: too far behind to catch up",
            s.committed
        );
        ensure!(
            s.reduced == Some(s.committed),
            "rank {rank} must apply step {newest}, which another survivor committed, but its reduced gradient of \
             that step is not on its device"
        );
        ensure!(
            states.iter().any(|o| o.agreed.is_some_and(|a| a.0 == s.committed)),
            "no survivor that committed step {newest} says what its ranks agreed on"
        );
    }
    Ok(())
}

/// Checks that `ranges` cover `0..total` exactly once and returns them sorted with their contributor and
/// offset in the contributor's piece.
fn cover(ranges: &[Vec<(usize, usize)>], total: usize) -> Result<Vec<(usize, usize, Range<usize>)>> {
    let mut all = Vec::new();
    for (rank, list) in ranges.iter().enumerate() {
        let mut at = 0;
        for &(start, len) in list {
            ensure!(
                start.checked_add(len).is_some_and(|end| end <= total),
                "rank {rank} offers elements {start}+{len} of a {total}-element model"
            );
            all.push((rank, at, start..start + len));
            at += len;
        }
    }
    all.sort_by_key(|(_, _, r)| r.start);
    let mut next = 0;
    for (rank, _, r) in &all {
        ensure!(
            r.start == next,
            "the survivors' pieces of the state do not tie up at element {next} (rank {rank} offers {r:?})"
        );
        next = r.end;
    }
    ensure!(
        next == total,
        "the survivors hold the state up to element {next} of {total}"
    );
    Ok(all)
}

impl<B: Backend> Trainer<B> {
    /// [`Trainer::reform`]'s catch-up for the sharded update (see the module documentation): the survivors
    /// agree on the last committed step, roll a step forward where one is half done, and rebuild the
    /// parameters and moments from the owners and buddies of the old layout. `joining`: this trainer is a
    /// new member, holding nothing. Returns the step the group continues from.
    pub(super) fn rebuild_sharded(&mut self, joining: bool) -> Result<u64> {
        let members = self.membership.members.clone();
        // A state nobody holds whole (an owner and its buddy lost together) is found by the members that held
        // it; they say so in the exchange, so that every rank, a joiner too, refuses alike.
        let (contributions, lost) = match joining {
            true => (Vec::new(), None),
            false => match self.contributions(&members) {
                Ok(pieces) => (pieces, None),
                Err(e) => (Vec::new(), Some(format!("{e:#}"))),
            },
        };
        let mine = ShardedSurvivor {
            lost,
            committed: self.step,
            optimizer_step: self.opt.step,
            tokens_seen: self.tokens_seen,
            agreed: self.last_agreed.map(|(step, a)| (step, a.loss, a.grad_sq)),
            reduced: self.reduced_step,
            joining,
            ranges: contributions.iter().map(|(r, _)| (r.start, r.len())).collect(),
        };
        let states = self.exchange_states(&mine)?;
        if let Some(why) = states.iter().find_map(|s| s.lost.clone()) {
            bail!("{why}");
        }
        let holders: Vec<&ShardedSurvivor> = states.iter().filter(|s| !s.joining).collect();
        ensure!(
            !holders.is_empty(),
            "the re-formed group has only new members: nobody holds the job's state"
        );
        let newest = holders.iter().map(|s| s.committed).max().expect("non-empty");
        let reference = (*holders
            .iter()
            .find(|s| s.committed == newest)
            .expect("the newest is someone's"))
        .clone();
        // Every rank checks every survivor's catch-up, so all refuse alike rather than one leaving the others
        // waiting in the rebuild's collectives.
        catch_up_possible(&states, newest)?;
        if !joining && self.step < newest {
            self.roll_forward(newest, &states)?;
        }
        self.opt.step = reference.optimizer_step;
        self.take_rebuilt_state(&states, contributions)?;
        // A roll-forward recorded the old chunk's checksum; the next update starts the new chunk's.
        self.guard = super::shard_guard::ShardGuard::for_run(&self.opts, self.world);
        self.step = newest;
        self.tokens_seen = reference.tokens_seen;
        self.layout = StateLayout {
            members,
            owner: self.owner.clone(),
        };
        Ok(newest)
    }

    /// The pieces of the state this rank holds for the new group `members`: its own chunks (it is alive),
    /// and its left neighbour's from the mirror when that neighbour was lost. Each with the optimizer that
    /// holds its moments (`true`: the mirror).
    fn contributions(&self, members: &[MemberId]) -> Result<Vec<(Range<usize>, bool)>> {
        let held = holders(&self.layout, members)?;
        let me = self.layout.owner.rank();
        let mut out: Vec<(Range<usize>, bool)> = self.opt.owned.iter().map(|r| (r.clone(), false)).collect();
        if let Some(mirror) = &self.mirror {
            let left = (me + self.layout.members.len() - 1) % self.layout.members.len();
            if held[left].1 == me && left != me {
                out.extend(mirror.owned.iter().map(|r| (r.clone(), true)));
            }
        }
        Ok(out)
    }

    /// Every member's [`ShardedSurvivor`], in the new group's rank order.
    fn exchange_states(&mut self, mine: &ShardedSurvivor) -> Result<Vec<ShardedSurvivor>> {
        let text = serde_json::to_vec(mine).context("encoding this rank's survivor state")?;
        let len = text.len() as f64;
        let longest = self.comm.run(move |c| {
            let mut v = [len];
            c.all_reduce_scalars_max(&mut v)?;
            Ok(v[0] as usize)
        })?;
        let mut padded = text;
        padded.resize(longest, b' ');
        let all = self.comm.run(move |c| c.gather_bytes(padded))?;
        all.iter()
            .enumerate()
            .map(|(rank, bytes)| {
                serde_json::from_slice(bytes).with_context(|| format!("rank {rank} sent an unreadable survivor state"))
            })
            .collect()
    }

    /// Applies step `newest - 1`, which this rank began and another survivor completed: the reduced gradient
    /// is still on the device, the other tells the agreed scalars.
    /// [`catch_up_possible`] has checked, on every rank, that it can.
    fn roll_forward(&mut self, newest: u64, states: &[ShardedSurvivor]) -> Result<()> {
        let step = self.step;
        let (_, loss, grad_sq) = states
            .iter()
            .find_map(|s| s.agreed.filter(|a| a.0 == step))
            .with_context(|| format!("no survivor that committed step {newest} says what its ranks agreed on"))?;
        self.commit(AgreedStep { loss, grad_sq })?;
        self.reduced_step = None;
        Ok(())
    }

    /// All-gathers every member's pieces of the parameters and both moments, checks that they cover the model
    /// exactly once, and installs them: the full parameters, and the chunk and mirror of this rank's place.
    fn take_rebuilt_state(&mut self, states: &[ShardedSurvivor], mine: Vec<(Range<usize>, bool)>) -> Result<()> {
        let total = self.model.layout.total;
        let ranges: Vec<Vec<(usize, usize)>> = states.iter().map(|s| s.ranges.clone()).collect();
        let pieces = cover(&ranges, total)?;
        let widest = ranges
            .iter()
            .map(|l| l.iter().map(|r| r.1).sum::<usize>())
            .max()
            .unwrap_or(0);
        let with_mirror = mine.iter().any(|(_, from_mirror)| *from_mirror);
        // Survivors whose parameters are all alike (every gather had landed) hold every chunk already: only
        // the moments travel.
        let fingerprint = self.state_hash(false)?;
        let fingerprints = self.comm.run(move |c| c.gather_hashes(fingerprint))?;
        let params_alike = fingerprints.iter().all(|f| *f == fingerprints[0]);
        // `[P]` each: the parameters (left empty when they do not travel) and the two moments.
        let params_len = if params_alike { 0 } else { total };
        let mut full = [vec![0f32; params_len], vec![0f32; total], vec![0f32; total]];
        for (kind, out) in full.iter_mut().enumerate() {
            if kind == 0 && params_alike {
                continue;
            }
            // `[world * widest]`: rank k's pieces at `k * widest`, back to back, zero-padded.
            let mut packed = vec![0f32; widest * states.len()];
            let mut slot = &mut packed[self.rank * widest..(self.rank + 1) * widest];
            if kind == 0 {
                for (range, _) in &mine {
                    let (here, rest) = slot.split_at_mut(range.len());
                    self.be
                        .download(self.model.params.sub(range.start, range.len()), here)?;
                    slot = rest;
                }
            } else {
                // The pieces are the optimizer's ranges, then the mirror's: its moments, laid range after range.
                let own = Some(&self.opt).filter(|_| mine.iter().any(|(_, from_mirror)| !from_mirror));
                let mirror = self.mirror.as_ref().filter(|_| with_mirror);
                for opt in own.into_iter().chain(mirror) {
                    let view = if kind == 1 { opt.m } else { opt.v };
                    let (here, rest) = slot.split_at_mut(view.len);
                    self.be.download(view, here)?;
                    slot = rest;
                }
            }
            let gathered = self.comm.run(move |c| {
                let mut packed = packed;
                c.all_gather(&mut packed).map(|()| packed)
            })?;
            for (rank, offset, range) in &pieces {
                let from = rank * widest + offset;
                out[range.clone()].copy_from_slice(&gathered[from..from + range.len()]);
            }
        }
        let [params, m, v] = full;
        if !params_alike {
            self.be.upload(self.model.params, &params)?;
        }
        drop(params);
        let owner = self.owner.clone();
        self.recut_optimizer(&owner, &m, &v)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::factory::{self, BackendChoice};
    use crate::collective::mem::{mem_cluster, MemOptions};
    use crate::data::{load_splits, TokenizerKind};
    use crate::elastic::{ElasticRules, Membership};
    use crate::model::ModelConfig;
    use crate::trainer::{ModelSource, Quiet};

    fn options() -> TrainOptions {
        let cfg = ModelConfig::tiny();
        let mut opts = TrainOptions::for_model(&cfg).with_steps(5);
        (opts.batch_size, opts.seq_len, opts.eval_batches) = (2, 32, 0);
        opts.update = UpdateMode::Sharded;
        opts.bucket_elems = 30_000;
        opts.elastic = Some(ElasticRules::default());
        opts
    }

    /// Three members train two steps; in the third, all reduce and agree, and then member 0 applies the
    /// update and member 1 does not (as when its agreement fails while member 0's completes: `roll` true),
    /// or both apply it. Member 2 is lost; 0 and 1 re-form and finish. Returns their final parameter hashes.
    fn third_step_then_lose_member_2(roll: bool) -> Vec<String> {
        let membership = Membership {
            epoch: 1,
            members: vec![0, 1],
        };
        let mut next = mem_cluster(2, MemOptions::default()).into_iter();
        std::thread::scope(|s| {
            let handles: Vec<_> = mem_cluster(3, MemOptions::default())
                .into_iter()
                .map(|comm| {
                    let (membership, survivor) = (membership.clone(), next.next());
                    s.spawn(move || {
                        let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                        let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                        let source = ModelSource::Fresh(ModelConfig::tiny());
                        let mut t = Trainer::new(be, source, data, options(), Box::new(comm)).unwrap();
                        while t.step() < 2 {
                            t.train_step().unwrap();
                        }
                        if roll {
                            let local = t.local_compute().unwrap();
                            let agreed = t.sync.synchronise(&mut t.be, &t.comm, t.model.grads, local).unwrap();
                            if t.rank == 0 {
                                t.last_agreed = Some((t.step, agreed));
                                t.update(agreed).unwrap();
                                t.step += 1;
                                t.tokens_seen += t.tokens_per_step();
                            }
                        } else {
                            t.train_step().unwrap();
                        }
                        let comm = survivor?;
                        t.release_collective().unwrap();
                        assert_eq!(t.reform(Box::new(comm), membership).unwrap(), 3);
                        t.run(&mut Quiet).unwrap();
                        assert_eq!(t.step(), 5);
                        Some(t.param_hash().unwrap())
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().unwrap()).collect()
        })
    }

    /// A survivor one step behind applies that step from the gradient it reduced and the scalars another
    /// agreed on: the run ends with the bits of one where both had applied it.
    #[test]
    fn a_survivor_whose_agreement_failed_rolls_the_step_forward() {
        let rolled = third_step_then_lose_member_2(true);
        assert_eq!(rolled[0], rolled[1]);
        assert_eq!(rolled, third_step_then_lose_member_2(false));
    }

    fn layout(members: &[MemberId], rank: usize) -> StateLayout {
        StateLayout {
            members: members.to_vec(),
            owner: Owner::flat(members.len(), rank),
        }
    }

    #[test]
    fn a_lost_chunk_is_held_by_its_right_neighbour() {
        let l = layout(&[0, 1, 2, 3], 0);
        assert_eq!(
            holders(&l, &[0, 1, 2, 3]).unwrap(),
            vec![(0, 0), (1, 1), (2, 2), (3, 3)]
        );
        assert_eq!(holders(&l, &[0, 2, 3]).unwrap(), vec![(0, 0), (1, 2), (2, 2), (3, 3)]);
        // The last rank's buddy is rank 0: the ring wraps.
        assert_eq!(holders(&l, &[0, 1, 2]).unwrap(), vec![(0, 0), (1, 1), (2, 2), (3, 0)]);
        let err = holders(&l, &[1, 2]).unwrap_err().to_string();
        assert!(err.contains("member 3 and member 0, its buddy"), "{err}");
    }

    #[test]
    fn an_owner_and_its_buddy_lost_at_once_are_named() {
        let l = layout(&[0, 1, 2, 3, 4], 0);
        let err = holders(&l, &[0, 3, 4]).unwrap_err().to_string();
        assert!(err.contains("member 1 and member 2, its buddy"), "{err}");
        // Not neighbours: each lost chunk has its buddy.
        assert_eq!(
            holders(&l, &[0, 2, 4]).unwrap(),
            vec![(0, 0), (1, 2), (2, 2), (3, 4), (4, 4)]
        );
    }

    #[test]
    fn pieces_must_cover_the_model_once() {
        let ok = cover(&[vec![(0, 3), (7, 3)], vec![(3, 4)], vec![]], 10).unwrap();
        assert_eq!(
            ok.iter().map(|p| (p.0, p.1, p.2.clone())).collect::<Vec<_>>(),
            vec![(0, 0, 0..3), (1, 0, 3..7), (0, 3, 7..10)]
        );
        assert!(cover(&[vec![(0, 3)], vec![(4, 6)]], 10)
            .unwrap_err()
            .to_string()
            .contains("element 3"));
        assert!(cover(&[vec![(0, 5)], vec![(4, 6)]], 10).is_err());
        assert!(cover(&[vec![(0, 9)]], 10)
            .unwrap_err()
            .to_string()
            .contains("up to element 9"));
        assert!(cover(&[vec![(5, usize::MAX)]], 10).is_err());
    }
}
