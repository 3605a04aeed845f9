//! The two-level ring: ranks of one host reduce among themselves, then each host's `l`-th rank runs the
//! inter-host ring with its counterparts, then the hosts' ranks gather again.
//!
//! With `H` hosts of `L` ranks each (`N = H·L`), an all-reduce of `S` bytes runs
//! 1. a reduce-scatter (sum) on the host ring: local rank `l` ends with its host's sum of host chunk `l`
//!    (`chunk_range(len, L, l)`);
//! 2. an all-reduce of that chunk on the cross ring of the `H` ranks with local index `l`, whose mean
//!    divides the finished sum once, by `N`;
//! 3. an all-gather on the host ring.
//!
//! The `L` cross rings run at once, each over `S/L` bytes, so a host's network link carries
//! `2(H-1)/H · S` instead of the flat ring's `2(N-1)/N · S` through one neighbour, and most bytes stay on
//! the host (shared memory). Every step is a ring collective with its own fixed reduction order, so the
//! result is deterministic and bit-identical on every rank; but the sum is grouped differently from the
//! flat ring's, so the bits differ from a flat ring's. That is why the layout is fixed at rendezvous (rank 0
//! resolves `--collective` from the hosts the ranks reported) and every rank runs the one rank 0 chose.
//!
//! The ZeRO-1 owner of an element is the rank that ends a reduce-scatter with it: host chunk `l`, then
//! cross chunk `h` of that ([`TwoLevel::owned_range`]).
//!
//! A compact `--wire` format ([`super::wire`]) applies to the cross ring only: the host ring's sums and
//! gathers stay f32 (shared memory is not the slow link), so a value is rounded at `H` points, not `N`.

use std::fmt;
use std::ops::Range;

use super::ring::{chunk_range, Reduce, RingEngine, RingOp};
use super::{Collective, CollectiveError, Result, Wire};

/// Which reduction schedule a job asks for (`--collective`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CollectiveChoice {
    /// One ring over every rank.
    Flat,
    /// The two-level ring; the start fails when the ranks' hosts cannot form one.
    Hierarchical,
    /// The two-level ring when every host holds the same number (at least 2) of ranks and there are at
    /// least 2 hosts; else the flat ring, with a line saying why.
    #[default]
    Auto,
}

impl CollectiveChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            CollectiveChoice::Flat => "flat",
            CollectiveChoice::Hierarchical => "hierarchical",
            CollectiveChoice::Auto => "auto",
        }
    }
}

impl fmt::Display for CollectiveChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The rings a collective's engines run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubRing {
    /// Every rank, in rank order.
    All,
    /// The ranks of this rank's host.
    Host,
    /// The ranks with this rank's local index, one per host.
    Cross,
}

/// One rank's place in a two-level layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TwoLevel {
    /// Global ranks of this rank's host in ring order (ascending).
    pub host: Vec<usize>,
    /// Global ranks with this rank's local index, one per host, hosts in order of their lowest rank.
    pub cross: Vec<usize>,
    /// This rank's position in `host` (its local index) and in `cross` (its host's index).
    pub host_pos: usize,
    pub cross_pos: usize,
    /// Every rank of the job.
    pub world: usize,
}

impl TwoLevel {
    /// The layout of `rank` when rank `r` is on host `host_of[r]` (any labels). Every host must hold the
    /// same number of ranks, at least 2, and there must be at least 2 hosts; otherwise the reason.
    pub fn new(host_of: &[usize], rank: usize) -> std::result::Result<TwoLevel, String> {
        let groups = host_groups(host_of);
        let world = host_of.len();
        if rank >= world {
            return Err(format!("rank {rank} is out of range for world size {world}"));
        }
        if groups.len() < 2 {
            return Err(format!("all {world} ranks share one host"));
        }
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        if sizes.iter().any(|&s| s != sizes[0]) {
            return Err(format!("the hosts hold unequal numbers of ranks {sizes:?}"));
        }
        if sizes[0] < 2 {
            return Err("every host holds a single rank".into());
        }
        let h = groups
            .iter()
            .position(|g| g.contains(&rank))
            .expect("every rank is in a group");
        let host = groups[h].clone();
        let l = host.iter().position(|&r| r == rank).expect("rank is in its group");
        let cross = groups.iter().map(|g| g[l]).collect();
        Ok(TwoLevel {
            host,
            cross,
            host_pos: l,
            cross_pos: h,
            world,
        })
    }

    /// The elements of a `len`-element buffer this rank ends a reduce-scatter with: cross chunk
    /// `cross_pos` of host chunk `host_pos`.
    pub fn owned_range(&self, len: usize) -> Range<usize> {
        let host_chunk = chunk_range(len, self.host.len(), self.host_pos);
        let part = chunk_range(host_chunk.len(), self.cross.len(), self.cross_pos);
        host_chunk.start + part.start..host_chunk.start + part.end
    }

    /// The members of `ring` in ring order, and this rank's position among them.
    pub fn ring(&self, ring: SubRing) -> Option<(&[usize], usize)> {
        match ring {
            SubRing::All => None,
            SubRing::Host => Some((&self.host, self.host_pos)),
            SubRing::Cross => Some((&self.cross, self.cross_pos)),
        }
    }
}

impl fmt::Display for TwoLevel {
    /// `two-level ring (2 hosts x 4 ranks)`, as the start line and the benchmark's title say it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "two-level ring ({} hosts x {} ranks)",
            self.cross.len(),
            self.host.len()
        )
    }
}

/// Which part of a reduce-scattered buffer each rank ends with, and contributes to an all-gather: the
/// collective's ownership map ([`Collective::owner`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// The flat ring: rank `rank` owns `chunk_range(len, world, rank)`.
    Flat { world: usize, rank: usize },
    /// The two-level ring: [`TwoLevel::owned_range`].
    TwoLevel(TwoLevel),
}

impl Owner {
    pub fn flat(world: usize, rank: usize) -> Owner {
        Owner::Flat { world, rank }
    }

    /// This rank's part of a `len`-element buffer.
    pub fn range(&self, len: usize) -> Range<usize> {
        match self {
            Owner::Flat { world, rank } => chunk_range(len, *world, *rank),
            Owner::TwoLevel(t) => t.owned_range(len),
        }
    }

    /// The rank this map is for.
    pub fn rank(&self) -> usize {
        match self {
            Owner::Flat { rank, .. } => *rank,
            Owner::TwoLevel(t) => t.host[t.host_pos],
        }
    }

    /// Every rank of the job.
    pub fn world(&self) -> usize {
        match self {
            Owner::Flat { world, .. } => *world,
            Owner::TwoLevel(t) => t.world,
        }
    }
}

/// The ranks of each host in ascending order, hosts in order of their lowest rank.
pub fn host_groups(host_of: &[usize]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for (rank, &h) in host_of.iter().enumerate() {
        match groups.iter_mut().find(|(label, _)| *label == h) {
            Some((_, g)) => g.push(rank),
            None => groups.push((h, vec![rank])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// Host labels from per-rank host identities: equal identities share a label, numbered in order of
/// first appearance. A rank without an identity is a host of its own.
pub fn host_labels(ids: &[Option<String>]) -> Vec<usize> {
    let mut seen: Vec<&str> = Vec::new();
    let mut next_alone = ids.len();
    ids.iter()
        .map(|id| match id {
            Some(id) => match seen.iter().position(|s| s == id) {
                Some(i) => i,
                None => {
                    seen.push(id);
                    seen.len() - 1
                }
            },
            None => {
                next_alone += 1;
                next_alone
            }
        })
        .collect()
}

/// What rank 0 decides for `choice` given the ranks' host labels: `Ok(Some(labels))` for the two-level
/// ring, `Ok(None)` for the flat one (under `auto`, after a line saying why), or the start's error when
/// `hierarchical` cannot be had.
pub fn resolve(choice: CollectiveChoice, host_of: &[usize]) -> std::result::Result<Option<Vec<usize>>, String> {
    match choice {
        CollectiveChoice::Flat => Ok(None),
        CollectiveChoice::Hierarchical => match TwoLevel::new(host_of, 0) {
            Ok(_) => Ok(Some(host_of.to_vec())),
            Err(why) => Err(format!(
                "--collective hierarchical needs several hosts of equal size: {why}"
            )),
        },
        CollectiveChoice::Auto => match TwoLevel::new(host_of, 0) {
            Ok(_) => Ok(Some(host_of.to_vec())),
            Err(why) => {
                if host_of.len() > 1 {
                    tracing::info!("--collective auto: the flat ring ({why})");
                }
                Ok(None)
            }
        },
    }
}

/// Runs the f32 collective `op` over `buf` with the two-level schedule of `t` (see the module
/// documentation); broadcasts run on the flat ring, whose result is the same bits.
pub fn run_two_level(
    comm: &mut (impl Collective + ?Sized),
    t: &TwoLevel,
    op: RingOp,
    buf: &mut [f32],
    sub_chunk: usize,
) -> Result<()> {
    let host_chunk = chunk_range(buf.len(), t.host.len(), t.host_pos);
    match op {
        RingOp::AllReduce(reduce) | RingOp::ReduceScatter(reduce) => {
            let sum = RingOp::ReduceScatter(Reduce::Sum);
            run_on(comm, t, SubRing::Host, sum, buf, sub_chunk)?;
            let all = matches!(op, RingOp::AllReduce(_));
            let cross = if all {
                RingOp::AllReduce(reduce)
            } else {
                RingOp::ReduceScatter(reduce)
            };
            run_on(comm, t, SubRing::Cross, cross, &mut buf[host_chunk], sub_chunk)?;
            if all {
                run_on(comm, t, SubRing::Host, RingOp::AllGather, buf, sub_chunk)?;
            }
            Ok(())
        }
        RingOp::AllGather => {
            run_on(
                comm,
                t,
                SubRing::Cross,
                RingOp::AllGather,
                &mut buf[host_chunk],
                sub_chunk,
            )?;
            run_on(comm, t, SubRing::Host, RingOp::AllGather, buf, sub_chunk)
        }
        RingOp::Broadcast { .. } => run_on(comm, t, SubRing::All, op, buf, sub_chunk),
        // Ownership on two levels is not the flat ring's chunk order, so a neighbour's chunk is not its part.
        RingOp::Shift => Err(CollectiveError::Local(
            "the two-level ring has no shift to the right neighbour (the buddy copy of an elastic run)".into(),
        )),
    }
}

/// One level: the ring engine for this rank's place on `ring` of `t`, a mean dividing by every rank.
fn run_on(
    comm: &mut (impl Collective + ?Sized),
    t: &TwoLevel,
    ring: SubRing,
    op: RingOp,
    buf: &mut [f32],
    sub_chunk: usize,
) -> Result<()> {
    let (rank, world) = match t.ring(ring) {
        Some((members, pos)) => (pos, members.len()),
        None => (comm.rank(), comm.world()),
    };
    let wire = match ring {
        SubRing::Cross => comm.wire(),
        SubRing::Host | SubRing::All => Wire::F32,
    };
    let mut e = RingEngine::new(op, rank, world, buf, sub_chunk)
        .map_err(|e| CollectiveError::Local(e.to_string()))?
        .mean_over(t.world)
        .with_wire(wire);
    comm.run_engine_on(ring, &mut e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_grouped_by_their_lowest_rank_and_must_be_equal() {
        // Hosts interleaved in rank order: host A holds 0 and 2, host B holds 1 and 3.
        let t = TwoLevel::new(&[7, 9, 7, 9], 3).unwrap();
        assert_eq!((t.host.as_slice(), t.host_pos), (&[1, 3][..], 1));
        assert_eq!((t.cross.as_slice(), t.cross_pos), (&[2, 3][..], 1));
        assert!(TwoLevel::new(&[0, 0, 1], 0).unwrap_err().contains("unequal"));
        assert!(TwoLevel::new(&[0, 0, 0], 0).unwrap_err().contains("one host"));
        assert!(TwoLevel::new(&[0, 1, 2], 0).unwrap_err().contains("single rank"));
        assert_eq!(
            resolve(CollectiveChoice::Auto, &[0, 0, 1]).unwrap(),
            None,
            "auto falls back to the flat ring"
        );
        assert!(resolve(CollectiveChoice::Hierarchical, &[0, 0, 1]).is_err());
        assert_eq!(resolve(CollectiveChoice::Flat, &[0, 0, 1, 1]).unwrap(), None);
    }

    #[test]
    fn owned_ranges_tile_the_buffer_once() {
        for (hosts, len) in [
            (vec![0, 0, 1, 1], 10),
            (vec![0, 1, 0, 1, 0, 1], 7),
            (vec![0, 0, 0, 1, 1, 1], 100),
        ] {
            let mut covered = vec![0u32; len];
            for rank in 0..hosts.len() {
                for i in TwoLevel::new(&hosts, rank).unwrap().owned_range(len) {
                    covered[i] += 1;
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{hosts:?} {len}: {covered:?}");
        }
    }

    #[test]
    fn host_labels_follow_identities_and_a_missing_one_is_alone() {
        let ids = [Some("a".to_string()), Some("b".into()), None, Some("a".into()), None];
        let labels = host_labels(&ids);
        assert_eq!(labels[0], labels[3]);
        assert_ne!(labels[0], labels[1]);
        assert_ne!(labels[2], labels[4]);
        assert!(!labels[..2].contains(&labels[2]));
    }
}
