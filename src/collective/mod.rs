//! Collectives: deterministic ring reduce-scatter / all-gather / AllReduce, sans-IO core and transports.
//!
//! - [`ring`]: the sans-IO engines (no sockets, clocks or threads); the reduction order is documented there.
//! - [`mem`]: N ranks in one process over channels, with fault injection (tests, simulator).
//! - [`frame`]: the bounded, versioned wire format.
//! - [`quic`]: the QUIC transport (quinn), rendezvous and control plane included; [`buffer_pool`] recycles
//!   its message buffers.
//! - [`shm`]: ring links through shared memory between ranks of one host (the QUIC transport's data path
//!   for such links).
//! - [`comm_thread`]: a rank's collectives on their own thread, behind handles (overlap with backward).
//! - [`bench`](mod@bench): the all-reduce benchmark behind `ringtrain bench allreduce`.
//!
//! The layer knows no backend: it works on f32 and byte slices. Every transport implements [`Collective`]
//! by providing [`Collective::run_engine`]; the collectives themselves are provided methods, so they behave
//! identically over every transport.

pub mod bench;
pub mod buffer_pool;
pub mod comm_thread;
pub mod frame;
pub mod le_pieces;
pub mod mem;
pub mod quic;
pub mod rank_runtime;
pub mod ring;
pub mod shm;
pub mod two_level;
pub mod wire;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use ring::{chunk_range, Engine, GatherEngine, Reduce, RingEngine, RingError, RingOp};
pub use two_level::{CollectiveChoice, Owner, SubRing, TwoLevel};
pub use wire::Wire;

/// Why a collective failed. Every variant that involves a peer names its rank.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CollectiveError {
    /// A peer disappeared (process exit, connection loss, keep-alive timeout).
    #[error("rank {rank} is dead: {reason}")]
    PeerDead { rank: usize, reason: String },
    /// A peer reported a failure and aborted the job.
    #[error("rank {rank} aborted the job: {reason}")]
    Aborted { rank: usize, reason: String },
    /// Nothing arrived from `waiting_on` before the per-collective deadline.
    #[error("collective #{seq} timed out after {secs:.1}s waiting for data from rank {waiting_on}")]
    Timeout { seq: u64, waiting_on: usize, secs: f64 },
    /// A peer sent something the protocol does not allow.
    #[error("protocol error from rank {rank}: {msg}")]
    Protocol { rank: usize, msg: String },
    /// Local failure (configuration, I/O setup, earlier abort).
    #[error("{0}")]
    Local(String),
    /// An elastic re-form's ring did not form: these ranks of the membership it was forming did not reach
    /// its rendezvous in time (rank 0: could not be reached). Every rank that took part hears the same list
    /// from rank 0, so the survivors agree on whom to leave out of the next attempt.
    #[error("the re-formed ring did not form: rank(s) {missing:?} did not reach its rendezvous")]
    Unformed { missing: Vec<usize> },
}

impl CollectiveError {
    /// The rank this error blames, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            CollectiveError::PeerDead { rank, .. }
            | CollectiveError::Aborted { rank, .. }
            | CollectiveError::Protocol { rank, .. } => Some(*rank),
            CollectiveError::Timeout { waiting_on, .. } => Some(*waiting_on),
            CollectiveError::Local(_) | CollectiveError::Unformed { .. } => None,
        }
    }
}

pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// A group of `world()` ranks joined in a ring. Calls are collective: every rank must make the same calls,
/// in the same order, with the same buffer lengths.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Drives one engine to completion over this transport: send its messages to the right neighbour,
    /// feed it messages from the left, within the per-collective deadline.
    fn run_engine(&mut self, engine: &mut dyn Engine) -> Result<()>;

    /// Drives `engine` on one ring of a two-level layout ([`two_level`]); `SubRing::All` is
    /// [`run_engine`](Collective::run_engine). Transports without two-level rings refuse the others.
    fn run_engine_on(&mut self, ring: SubRing, engine: &mut dyn Engine) -> Result<()> {
        match ring {
            SubRing::All => self.run_engine(engine),
            other => Err(CollectiveError::Local(format!(
                "this transport has no {other:?} ring (it runs the flat ring only)"
            ))),
        }
    }

    /// This rank's place in the two-level layout the job runs, or `None` for the flat ring.
    fn two_level(&self) -> Option<&TwoLevel> {
        None
    }

    /// The ownership map: which elements each rank ends a reduce-scatter with, and contributes to an
    /// all-gather.
    fn owner(&self) -> Owner {
        match self.two_level() {
            Some(t) => Owner::TwoLevel(t.clone()),
            None => Owner::flat(self.world(), self.rank()),
        }
    }

    /// This rank's part of a `len`-element buffer under [`owner`](Collective::owner):
    /// `chunk_range(len, world, rank)` on the flat ring, [`TwoLevel::owned_range`] on two levels.
    fn owned_range(&self, len: usize) -> Range<usize> {
        self.owner().range(len)
    }

    /// Tells every other rank that this one failed; later collectives on any rank then fail, naming it.
    fn abort(&mut self, reason: &str);

    /// Where each rank listens, for a transport over the network (an elastic re-form dials the new rank 0
    /// at its address); `None` for transports within one process.
    fn ring_addrs(&self) -> Option<Vec<std::net::SocketAddr>> {
        None
    }

    /// Rank 0 of an elastic job over the network: the member (its first rank) that has asked to join and
    /// waits to be admitted, if any.
    fn pending_join(&self) -> Option<u32> {
        None
    }

    /// Rank 0 of an elastic job: tells the waiting `member` it is admitted into membership `epoch`
    /// (`members` in rank order, itself included). Nothing where no member waits.
    fn admit_join(&mut self, _member: u32, _epoch: u64, _members: &[u32]) -> Result<()> {
        Ok(())
    }

    /// Rank 0 of an elastic job: turns the waiting `member` away, telling it `reason`. Nothing where no
    /// member waits.
    fn refuse_join(&mut self, _member: u32, _reason: &str) -> Result<()> {
        Ok(())
    }

    /// The count of bytes this rank has sent to its neighbours (collective payloads, with their frame
    /// headers where the transport has frames; not the control plane), readable from any thread, for the
    /// metrics' `sent_bytes`. A count that stays at zero for transports that do not count.
    fn sent_bytes(&self) -> SentBytes {
        SentBytes::default()
    }

    /// Records the training step, stamped into frames (and checked) by transports that have frames.
    fn set_step(&mut self, _step: u64) {}

    /// The format reducing collectives send their values in ([`Wire`]; f32 unless set).
    fn wire(&self) -> Wire;

    /// Sends the values of every later reducing collective in `wire` (gathers, broadcasts and shifts stay
    /// f32). Every rank of the job must set the same (`--wire` is in the job hash).
    fn set_wire(&mut self, wire: Wire);

    /// Runs one f32 ring collective. How the buffer is cut into messages and where their storage comes from
    /// are the transport's own business: [`run_ring`] runs it with the defaults.
    fn run_f32(&mut self, op: RingOp, buf: &mut [f32]) -> Result<()>;

    /// Where this rank's ring data travels, `[from the left, to the right]` ("shm", "quic"), for transports
    /// that choose per link.
    fn ring_links(&self) -> Option<[&'static str; 2]> {
        None
    }

    /// The flag through which the caller says its compute runs while collectives do ("the caller is
    /// computing"), for transports that trade latency for fewer wake-ups of busy cores then.
    fn compute_busy(&self) -> Option<ComputeBusy> {
        None
    }

    /// Every rank ends with the element-wise mean of all ranks' `buf` (identical bits on every rank).
    fn all_reduce_mean(&mut self, buf: &mut [f32]) -> Result<()> {
        self.run_f32(RingOp::AllReduce(Reduce::Mean), buf)
    }

    /// Every rank ends with the element-wise sum.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        self.run_f32(RingOp::AllReduce(Reduce::Sum), buf)
    }

    /// Each rank ends with the mean of its [`owned_range`](Collective::owned_range), which is returned; the
    /// rest of its buffer holds partial sums and must be treated as garbage.
    fn reduce_scatter_mean(&mut self, buf: &mut [f32]) -> Result<Range<usize>> {
        self.run_f32(RingOp::ReduceScatter(Reduce::Mean), buf)?;
        Ok(self.owned_range(buf.len()))
    }

    /// Each rank ends with the sum of its [`owned_range`](Collective::owned_range), which is returned; the
    /// rest of its buffer holds partial sums and must be treated as garbage.
    fn reduce_scatter_sum(&mut self, buf: &mut [f32]) -> Result<Range<usize>> {
        self.run_f32(RingOp::ReduceScatter(Reduce::Sum), buf)?;
        Ok(self.owned_range(buf.len()))
    }

    /// Each rank contributes its [`owned_range`](Collective::owned_range) of `buf`; every rank ends with all
    /// of them.
    fn all_gather(&mut self, buf: &mut [f32]) -> Result<()> {
        self.run_f32(RingOp::AllGather, buf)
    }

    /// Sends this rank's [`owned_range`](Collective::owned_range) of `buf` to its right neighbour, which
    /// stores it in place: every rank ends also holding its left neighbour's part. Flat ring only.
    fn shift_right(&mut self, buf: &mut [f32]) -> Result<()> {
        self.run_f32(RingOp::Shift, buf)
    }

    /// Copies rank `root`'s buffer to every rank.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.run_f32(RingOp::Broadcast { root }, buf)
    }

    /// Element-wise sum of a few f64 scalars (loss, squared grad norm, non-finite counts...). Summed in rank
    /// order 0..N on every rank, so every rank gets identical bits.
    fn all_reduce_scalars(&mut self, vals: &mut [f64]) -> Result<()> {
        let blobs = self.gather_bytes(ring::scalars_to_bytes(vals))?;
        ring::sum_scalar_blobs(&blobs, vals);
        Ok(())
    }

    /// Element-wise maximum of a few f64 scalars (NaN wins, so a non-finite value anywhere is seen everywhere).
    fn all_reduce_scalars_max(&mut self, vals: &mut [f64]) -> Result<()> {
        let blobs = self.gather_bytes(ring::scalars_to_bytes(vals))?;
        for (i, v) in vals.iter_mut().enumerate() {
            let mut acc = f64::NEG_INFINITY;
            for b in &blobs {
                let x = f64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("length checked by the engine"));
                acc = if x.is_nan() || acc.is_nan() {
                    f64::NAN
                } else {
                    acc.max(x)
                };
            }
            *v = acc;
        }
        Ok(())
    }

    /// Every rank gets every rank's 32-byte hash, in rank order.
    fn gather_hashes(&mut self, hash: [u8; 32]) -> Result<Vec<[u8; 32]>> {
        let blobs = self.gather_bytes(hash.to_vec())?;
        Ok(blobs
            .into_iter()
            .map(|b| b.try_into().expect("length checked by the engine"))
            .collect())
    }

    /// Every rank gets every rank's blob (all blobs must have the same length; at most
    /// [`quic::MAX_GATHER_BLOB`] bytes over QUIC).
    fn gather_bytes(&mut self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let mut e =
            GatherEngine::new(self.rank(), self.world(), mine).map_err(|e| CollectiveError::Local(e.to_string()))?;
        self.run_engine(&mut e)?;
        Ok(e.into_blobs())
    }
}

/// A transport's running count of bytes sent, shared with whoever reads it (the trainer, between steps,
/// without queueing behind the collectives in flight).
#[derive(Clone, Debug, Default)]
pub struct SentBytes(Arc<std::sync::atomic::AtomicU64>);

impl SentBytes {
    pub fn add(&self, bytes: u64) {
        self.0.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Runs the f32 collective `op` over `buf` on `comm` with the ring engine, in sub-chunks of `sub_chunk`
/// elements: on the flat ring, or with the two-level schedule when the job runs one.
pub fn run_ring(comm: &mut (impl Collective + ?Sized), op: RingOp, buf: &mut [f32], sub_chunk: usize) -> Result<()> {
    if let Some(t) = comm.two_level().cloned() {
        return two_level::run_two_level(comm, &t, op, buf, sub_chunk);
    }
    let (rank, world) = (comm.rank(), comm.world());
    let mut e = RingEngine::new(op, rank, world, buf, sub_chunk)
        .map_err(|e| CollectiveError::Local(e.to_string()))?
        .with_wire(comm.wire());
    comm.run_engine(&mut e)
}

/// Set while the rank's compute runs beside its collectives (the trainer sets it for backward with overlap
/// on). A transport then reads a streaming link in batches rather than as each datagram arrives, so it
/// interrupts the compute less often (`quic::coalesce`); while the rank waits for a collective, it reads
/// at once.
#[derive(Clone, Debug, Default)]
pub struct ComputeBusy(Arc<AtomicBool>);

impl ComputeBusy {
    pub fn set(&self, busy: bool) {
        self.0.store(busy, Ordering::Relaxed);
    }

    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Ranks whose hash differs from the majority (ties broken towards rank 0's hash); empty when all agree.
pub fn diverged_ranks(hashes: &[[u8; 32]]) -> Vec<usize> {
    if hashes.is_empty() {
        return Vec::new();
    }
    let count = |h: &[u8; 32]| hashes.iter().filter(|x| *x == h).count();
    let mut best = hashes[0];
    for h in hashes {
        if count(h) > count(&best) {
            best = *h;
        }
    }
    (0..hashes.len()).filter(|&r| hashes[r] != best).collect()
}
