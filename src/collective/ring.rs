//! Sans-IO ring collectives: no sockets, no clocks, no threads.
//!
//! Each rank owns one engine per collective. The caller drives it:
//!
//! 1. `poll_transmit()` until `None`, sending every message to the **right** neighbour (`rank + 1 mod N`);
//! 2. if `is_done()`, stop;
//! 3. otherwise receive one message from the **left** neighbour (`rank - 1 mod N`) and pass it to
//!    `handle()`; go to 1.
//!
//! The same engines therefore run over the in-memory transport ([`super::mem`]), QUIC ([`super::quic`]) and
//! the simulator. Every message is tagged with `(phase, chunk, sub)` and may arrive in any order that
//! respects causality; tags are checked, so a duplicated, misplaced or wrongly sized message is an error.
//!
//! # Chunking
//! A buffer of `len` elements is split into `N` contiguous chunks: chunk `c` has `len / N` elements, plus one
//! for the first `len % N` chunks ([`chunk_range`]). Each chunk is split again into sub-chunks of at most
//! `sub_chunk` elements; sub-chunks travel independently, so the ring is pipelined.
//!
//! # Reduction order (determinism)
//! Reduce-scatter leaves chunk `c` fully reduced on rank `c`. Its sum is a left fold around the ring that
//! starts at rank `c+1`: `((x[c+1] + x[c+2]) + x[c+3]) + ... + x[c]` (indices mod N). The order depends only
//! on `(c, N)`, never on timing, and the owner's result is then copied byte-for-byte by the all-gather, so
//! every rank ends with identical bits.
//!
//! Averaging (`Reduce::Mean`) divides the finished sum once, on the owner, by `N` (an IEEE division, which is
//! correctly rounded). Pre-scaling each contribution by `1/N` would round N times and lose exactness for
//! integer-valued data; dividing the sum equals multiplying by `1/N` exactly when N is a power of two.
//!
//! # Phases
//! A reduce-scatter has `N-1` phases, an all-gather `N-1`, an all-reduce `2(N-1)` (reduce-scatter phases
//! `0..N-1`, then all-gather phases `N-1..2N-2`). In reduce-scatter phase `p` rank `r` sends chunk
//! `r-1-p`; in all-gather phase `q` it sends chunk `r-q`. A sub-chunk moves to the next phase as soon as
//! it has arrived, independently of the other sub-chunks.
//!
//! # Compact wire formats
//! A reducing collective may send its values rounded to a compact [`Wire`] format (bf16, blockwise int8;
//! [`RingEngine::with_wire`]). Sums stay f32: a received partial is decoded, this rank's f32 contribution
//! added, and the result rounded again only to be sent, so a partial is re-rounded at each of the `N-1`
//! hops. The owner's finished sum (divided, for a mean) is the reduce-scatter's result as it is, in f32;
//! in an all-reduce the owner rounds it once more, **keeps exactly the decoded rounded value**, and sends
//! those bytes, which the all-gather forwards untouched: every rank, the owner too, ends with the same
//! bits. Rounding is a pure function of the values, so the order of the module's fold still decides
//! every bit. Non-reducing collectives (gathers, broadcasts, shifts) always send f32. The error bound is
//! stated in [`super::wire`].

use super::le_pieces::LePieces;
use super::wire::Wire;
use std::fmt;

/// Default sub-chunk size in f32 elements (256 KiB per message).
pub const DEFAULT_SUB_CHUNK: usize = 64 * 1024;

/// Range of chunk `rank` when `len` elements are split over `n` ranks: the first `len % n` chunks get one
/// extra element. Chunks are contiguous and cover `0..len` in rank order.
pub fn chunk_range(len: usize, n: usize, rank: usize) -> std::ops::Range<usize> {
    assert!(n > 0 && rank < n, "chunk_range: rank {rank} out of world {n}");
    let base = len / n;
    let extra = len % n;
    let start = rank * base + rank.min(extra);
    let size = base + usize::from(rank < extra);
    start..start + size
}

/// How contributions are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// Sum, then one division by the world size on the chunk owner.
    Mean,
}

/// Which f32 collective an engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingOp {
    /// Every rank ends with the reduced buffer.
    AllReduce(Reduce),
    /// Rank `r` ends with the reduced `chunk_range(len, N, r)`; the rest of its buffer holds partial sums.
    ReduceScatter(Reduce),
    /// Rank `r` contributes `chunk_range(len, N, r)`; every rank ends with all chunks.
    AllGather,
    /// Rank `root`'s buffer is copied to every rank (a pipelined chain around the ring).
    Broadcast { root: usize },
    /// Rank `r` sends `chunk_range(len, N, r)` to its right neighbour, which stores it in place: one hop of
    /// an all-gather. Each rank ends holding its left neighbour's chunk too (the buddy copy of an elastic
    /// sharded run); the rest of the buffer is untouched.
    Shift,
}

/// Payload of a ring message.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    F32(Vec<f32>),
    /// f32 values as a transport received them (see [`LePieces`]); engines take them like `F32`.
    F32Le(LePieces),
    Bytes(Vec<u8>),
    /// f32 values rounded to a compact format ([`Wire`]) by a reducing collective that uses one.
    Compact {
        wire: Wire,
        bytes: Vec<u8>,
    },
}

impl Payload {
    pub fn len_bytes(&self) -> usize {
        match self {
            Payload::F32(v) => v.len() * 4,
            Payload::F32Le(p) => p.len_bytes(),
            Payload::Bytes(v) => v.len(),
            Payload::Compact { bytes, .. } => bytes.len(),
        }
    }
}

/// `values` encoded in the compact format `wire`, as a message payload.
fn compact_payload(wire: Wire, values: &[f32]) -> Payload {
    let mut bytes = Vec::new();
    wire.encode(values, &mut bytes);
    Payload::Compact { wire, bytes }
}

/// A received f32 payload, owned or in pieces.
enum Incoming {
    Owned(Vec<f32>),
    Pieces(LePieces),
}

impl Incoming {
    fn len(&self) -> usize {
        match self {
            Incoming::Owned(v) => v.len(),
            Incoming::Pieces(p) => p.len_bytes() / 4,
        }
    }

    /// `dst = values`.
    fn store_into(&self, dst: &mut [f32]) {
        match self {
            Incoming::Owned(v) => dst.copy_from_slice(v),
            Incoming::Pieces(p) => p.store_into(dst),
        }
    }

    /// `values + own`, in the received allocation when there is one.
    fn plus(self, own: &[f32]) -> Vec<f32> {
        match self {
            Incoming::Owned(mut v) => {
                for (s, d) in v.iter_mut().zip(own) {
                    *s += *d;
                }
                v
            }
            Incoming::Pieces(p) => {
                let mut out = p.scratch(own.len());
                p.sum_into(own, &mut out);
                out
            }
        }
    }

    /// The last step of a sum, stored: `own = (values + own) / divisor` (no division for `None`).
    fn finish_in_place(self, own: &mut [f32], divisor: Option<f32>) {
        match self {
            Incoming::Owned(v) => {
                for (s, d) in v.iter().zip(own.iter_mut()) {
                    let sum = *s + *d;
                    *d = divisor.map_or(sum, |k| sum / k);
                }
            }
            Incoming::Pieces(p) => p.finish_in_place(own, divisor),
        }
    }

    fn into_payload(self) -> Payload {
        match self {
            Incoming::Owned(v) => Payload::F32(v),
            Incoming::Pieces(p) => Payload::F32Le(p),
        }
    }
}

/// One message between ring neighbours. `(phase, chunk, sub)` identify it uniquely within a collective.
#[derive(Clone, Debug, PartialEq)]
pub struct Msg {
    pub phase: u32,
    pub chunk: u32,
    pub sub: u32,
    pub payload: Payload,
}

/// A protocol violation seen by an engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RingError {
    /// Constructor arguments are inconsistent.
    Config(String),
    /// A message that the protocol does not allow at this point.
    Unexpected {
        phase: u32,
        chunk: u32,
        sub: u32,
        why: String,
    },
    /// A message arrived twice.
    Duplicate { phase: u32, chunk: u32, sub: u32 },
}

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RingError::Config(s) => write!(f, "ring configuration error: {s}"),
            RingError::Unexpected { phase, chunk, sub, why } => {
                write!(
                    f,
                    "unexpected ring message (phase {phase}, chunk {chunk}, sub {sub}): {why}"
                )
            }
            RingError::Duplicate { phase, chunk, sub } => {
                write!(f, "duplicate ring message (phase {phase}, chunk {chunk}, sub {sub})")
            }
        }
    }
}

impl std::error::Error for RingError {}

/// Where an engine gets the storage of the payloads it builds. The transport hands it in at each
/// `poll_transmit` (as a sans-IO protocol takes the caller's buffer), so whether storage is recycled (QUIC
/// returns each sent payload's storage to its pool) or freshly allocated is the transport's business.
pub trait PayloadStorage {
    /// `len` elements, with unspecified contents, for the engine to overwrite in full.
    fn take(&self, len: usize) -> Vec<f32>;
}

/// Fresh zeroed allocations: the storage of transports that do not recycle.
pub struct Allocate;

impl PayloadStorage for Allocate {
    fn take(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
}

/// The next message when it is a stretch of the caller's buffer: its tags and `[len]` values.
pub struct InBuffer<'a> {
    pub phase: u32,
    pub chunk: u32,
    pub sub: u32,
    pub values: &'a [f32],
}

/// The interface every transport drives. See the module docs for the loop.
pub trait Engine {
    /// Next message to send to the right neighbour, if any, its payload built in `storage`.
    fn poll_transmit(&mut self, storage: &dyn PayloadStorage) -> Option<Msg>;
    /// The next message, borrowed from the caller's buffer, when it is one: a transport that can write it
    /// out before the engine is used again (a shared-memory ring with room for it) saves
    /// [`Engine::poll_transmit`]'s copy, then calls [`Engine::pop_peeked`].
    fn peek_in_buffer(&self) -> Option<InBuffer<'_>> {
        None
    }
    /// Drops the message [`Engine::peek_in_buffer`] showed, which the transport has sent.
    fn pop_peeked(&mut self) {}
    /// Feed one message received from the left neighbour.
    fn handle(&mut self, msg: Msg) -> Result<(), RingError>;
    /// All expected messages have arrived and every output has been queued.
    fn is_done(&self) -> bool;
    /// Some expected message has not arrived yet (a transport may feed messages while it is still sending;
    /// once this is false, what the left neighbour sends next belongs to the next collective).
    fn wants_input(&self) -> bool;
    /// Largest payload, in bytes, that this engine may receive (for bounding frame decoding).
    fn max_payload_bytes(&self) -> usize;
}

fn modn(x: i64, n: usize) -> usize {
    x.rem_euclid(n as i64) as usize
}

/// Engine for the f32 collectives ([`RingOp`]). Borrows the caller's buffer for its lifetime.
pub struct RingEngine<'a> {
    op: RingOp,
    rank: usize,
    world: usize,
    sub_chunk: usize,
    buf: &'a mut [f32],
    /// Received flags per `(phase, sub)`; the chunk of a phase is implied.
    seen: Vec<Vec<bool>>,
    remaining: usize,
    outbox: std::collections::VecDeque<Outgoing>,
    /// What `Reduce::Mean` divides the finished sum by: `world`, unless this ring is one level of a larger
    /// collective ([`RingEngine::mean_over`]).
    mean_divisor: usize,
    /// What this engine's messages carry: f32, unless a reducing collective was given a compact format.
    wire: Wire,
}

/// A message waiting to be sent.
enum Outgoing {
    Ready(Msg),
    /// Sub-chunk `sub` of `phase`'s send chunk, copied out of the caller's buffer only when the transport
    /// takes it: the copy is then still in cache when the transport reads it, and a large phase 0 does not
    /// hold a second copy of the whole chunk before its first byte leaves. The region is not written before
    /// that. In phase 0: the chunk a rank sends in phase 0 is never one it receives in the reduce-scatter,
    /// and the finished sum of a sub-chunk it gets back in the all-gather includes this very contribution,
    /// so it can only arrive after the copy was sent. In a later gather or broadcast phase (forwarding
    /// lent pieces, [`RingEngine::queue_forward`]): the region was just stored from the received message,
    /// and each region is received once. After a sum finished in place (the reduce-scatter's last phase,
    /// and every phase of a reduce-scatter, which keeps its partials): the region was just written with
    /// what is sent, and each chunk is received once in a reduce-scatter (the all-gather's chunks are the
    /// other ranks').
    FromBuffer {
        phase: usize,
        sub: usize,
    },
}

impl<'a> RingEngine<'a> {
    /// Creates the engine for rank `rank` of `world`, queueing its first messages.
    /// `sub_chunk` is the pipelining granularity in elements (≥ 1).
    pub fn new(op: RingOp, rank: usize, world: usize, buf: &'a mut [f32], sub_chunk: usize) -> Result<Self, RingError> {
        if world == 0 || rank >= world {
            return Err(RingError::Config(format!("rank {rank} not in world of {world}")));
        }
        if sub_chunk == 0 {
            return Err(RingError::Config("sub_chunk must be at least 1".into()));
        }
        if let RingOp::Broadcast { root } = op {
            if root >= world {
                return Err(RingError::Config(format!(
                    "broadcast root {root} not in world of {world}"
                )));
            }
        }
        let mut e = RingEngine {
            op,
            rank,
            world,
            sub_chunk,
            buf,
            seen: Vec::new(),
            remaining: 0,
            outbox: Default::default(),
            mean_divisor: world,
            wire: Wire::F32,
        };
        let phases = e.num_phases();
        e.seen = (0..phases).map(|p| vec![false; e.subs_of(e.recv_chunk(p))]).collect();
        e.remaining = e.seen.iter().map(|v| v.len()).sum();
        e.start();
        Ok(e)
    }

    /// Makes a mean divide by `ranks` instead of this ring's world: the two-level ring sums within hosts
    /// first, so its second ring's finished sums hold every rank's contribution.
    pub fn mean_over(mut self, ranks: usize) -> Self {
        self.mean_divisor = ranks.max(1);
        self
    }

    /// Sends the values of a reducing collective in `wire` (module docs, "Compact wire formats"); other
    /// collectives keep f32 whatever is asked, so a transport can pass its one setting to every engine.
    pub fn with_wire(mut self, wire: Wire) -> Self {
        if self.reduce_mode().is_some() {
            self.wire = wire;
        }
        self
    }

    fn num_phases(&self) -> usize {
        let n = self.world;
        match self.op {
            RingOp::AllReduce(_) => 2 * (n - 1),
            RingOp::ReduceScatter(_) | RingOp::AllGather => n - 1,
            RingOp::Shift => usize::from(n > 1),
            RingOp::Broadcast { root } => {
                // One phase; only ranks other than root receive.
                usize::from(self.rank != root && n > 1)
            }
        }
    }

    fn is_ag_phase(&self, phase: usize) -> bool {
        match self.op {
            RingOp::AllReduce(_) => phase >= self.world - 1,
            RingOp::AllGather | RingOp::Shift => true,
            _ => false,
        }
    }

    /// Chunk this rank sends in `phase`.
    fn send_chunk(&self, phase: usize) -> usize {
        let (r, n) = (self.rank as i64, self.world);
        match self.op {
            RingOp::Broadcast { .. } => 0,
            RingOp::AllReduce(_) if phase >= n - 1 => modn(r - (phase - (n - 1)) as i64, n),
            RingOp::AllGather | RingOp::Shift => modn(r - phase as i64, n),
            _ => modn(r - 1 - phase as i64, n),
        }
    }

    /// Chunk this rank receives in `phase` (= what the left neighbour sends in that phase).
    fn recv_chunk(&self, phase: usize) -> usize {
        let n = self.world;
        match self.op {
            RingOp::Broadcast { .. } => 0,
            RingOp::AllReduce(_) if phase >= n - 1 => modn(self.rank as i64 - 1 - (phase - (n - 1)) as i64, n),
            RingOp::AllGather | RingOp::Shift => modn(self.rank as i64 - 1 - phase as i64, n),
            _ => modn(self.rank as i64 - 2 - phase as i64, n),
        }
    }

    /// Element range of chunk `c` (the whole buffer for broadcast).
    fn chunk(&self, c: usize) -> std::ops::Range<usize> {
        match self.op {
            RingOp::Broadcast { .. } => 0..self.buf.len(),
            _ => chunk_range(self.buf.len(), self.world, c),
        }
    }

    fn subs_of(&self, c: usize) -> usize {
        self.chunk(c).len().div_ceil(self.sub_chunk)
    }

    fn sub_range(&self, c: usize, sub: usize) -> std::ops::Range<usize> {
        let r = self.chunk(c);
        let s = r.start + sub * self.sub_chunk;
        s..(s + self.sub_chunk).min(r.end)
    }

    /// Queues sub-chunk `sub` of this phase's send chunk, to be copied from the buffer when it is sent.
    fn queue(&mut self, phase: usize, sub: usize) {
        self.outbox.push_back(Outgoing::FromBuffer { phase, sub });
    }

    /// Queues sub-chunk `sub` of this phase's send chunk with `data` as its payload.
    fn queue_owned(&mut self, phase: usize, sub: usize, data: Vec<f32>) {
        self.queue_payload(phase, sub, Payload::F32(data));
    }

    /// Queues sub-chunk `sub` of this phase's send chunk. Forwarding reuses what a message arrived in (its
    /// allocation, or its received pieces), so no payload is copied or allocated again for it.
    fn queue_payload(&mut self, phase: usize, sub: usize, payload: Payload) {
        let msg = self.msg(phase, sub, payload);
        self.outbox.push_back(Outgoing::Ready(msg));
    }

    /// Queues the forward of received data just stored in sub-chunk `sub` of this phase's send chunk: as
    /// received, unless the transport lent the pieces, which go back to it now; then the bytes are copied
    /// out of the buffer when the transport takes the message (the same bits: the region holds exactly
    /// what arrived, and nothing writes it again in this collective).
    fn queue_forward(&mut self, phase: usize, sub: usize, incoming: Incoming) {
        match incoming {
            Incoming::Pieces(p) if p.lent => self.outbox.push_back(Outgoing::FromBuffer { phase, sub }),
            other => self.queue_payload(phase, sub, other.into_payload()),
        }
    }

    fn msg(&self, phase: usize, sub: usize, payload: Payload) -> Msg {
        let c = self.send_chunk(phase);
        debug_assert_eq!(payload.len_bytes(), self.wire.encoded_len(self.sub_range(c, sub).len()));
        Msg {
            phase: phase as u32,
            chunk: c as u32,
            sub: sub as u32,
            payload,
        }
    }

    fn start(&mut self) {
        let n = self.world;
        if n == 1 {
            return; // Nothing to exchange; the mean over one rank is the value itself.
        }
        match self.op {
            RingOp::Broadcast { root } => {
                if self.rank == root {
                    for s in 0..self.subs_of(0) {
                        self.queue(0, s);
                    }
                }
            }
            _ => {
                for s in 0..self.subs_of(self.send_chunk(0)) {
                    self.queue(0, s);
                }
            }
        }
    }

    fn reduce_mode(&self) -> Option<Reduce> {
        match self.op {
            RingOp::AllReduce(m) | RingOp::ReduceScatter(m) => Some(m),
            _ => None,
        }
    }
}

impl Engine for RingEngine<'_> {
    fn peek_in_buffer(&self) -> Option<InBuffer<'_>> {
        if self.wire.is_compact() {
            return None; // The buffer holds f32; what is sent must be encoded first.
        }
        match self.outbox.front()? {
            Outgoing::FromBuffer { phase, sub } => {
                let c = self.send_chunk(*phase);
                Some(InBuffer {
                    phase: *phase as u32,
                    chunk: c as u32,
                    sub: *sub as u32,
                    values: &self.buf[self.sub_range(c, *sub)],
                })
            }
            Outgoing::Ready(_) => None,
        }
    }

    fn pop_peeked(&mut self) {
        debug_assert!(matches!(self.outbox.front(), Some(Outgoing::FromBuffer { .. })));
        self.outbox.pop_front();
    }

    fn poll_transmit(&mut self, storage: &dyn PayloadStorage) -> Option<Msg> {
        match self.outbox.pop_front()? {
            Outgoing::Ready(m) => Some(m),
            Outgoing::FromBuffer { phase, sub } if self.wire.is_compact() => {
                let payload = compact_payload(self.wire, &self.buf[self.sub_range(self.send_chunk(phase), sub)]);
                Some(self.msg(phase, sub, payload))
            }
            Outgoing::FromBuffer { phase, sub } => {
                let src = &self.buf[self.sub_range(self.send_chunk(phase), sub)];
                let mut data = storage.take(src.len());
                data.copy_from_slice(src);
                Some(self.msg(phase, sub, Payload::F32(data)))
            }
        }
    }

    fn handle(&mut self, msg: Msg) -> Result<(), RingError> {
        let (phase, chunk, sub) = (msg.phase as usize, msg.chunk as usize, msg.sub as usize);
        let bad = |why: String| RingError::Unexpected {
            phase: msg.phase,
            chunk: msg.chunk,
            sub: msg.sub,
            why,
        };
        if phase >= self.seen.len() {
            return Err(bad(format!(
                "phase out of range (this collective has {} here)",
                self.seen.len()
            )));
        }
        let want = self.recv_chunk(phase);
        if chunk != want {
            return Err(bad(format!("expected chunk {want} in this phase")));
        }
        if sub >= self.seen[phase].len() {
            return Err(bad(format!("chunk has {} sub-chunks", self.seen[phase].len())));
        }
        let range = self.sub_range(chunk, sub);
        // A compact payload is decoded here; its bytes are kept for an all-gather to forward untouched.
        let mut compact = None;
        let incoming = match msg.payload {
            Payload::F32(_) | Payload::F32Le(_) if self.wire.is_compact() => {
                return Err(bad(format!("f32 payload in a collective sent as {}", self.wire)))
            }
            Payload::F32(d) => Incoming::Owned(d),
            Payload::F32Le(p) if p.len_bytes() % 4 == 0 => Incoming::Pieces(p),
            Payload::F32Le(p) => return Err(bad(format!("{} bytes is not a whole number of f32", p.len_bytes()))),
            Payload::Bytes(_) => return Err(bad("byte payload in an f32 collective".into())),
            Payload::Compact { wire, .. } if wire != self.wire => {
                return Err(bad(format!("{wire} payload in a collective sent as {}", self.wire)))
            }
            Payload::Compact { wire, bytes } => {
                let mut values = vec![0.0; range.len()];
                wire.decode(&bytes, &mut values).map_err(|e| bad(e.to_string()))?;
                compact = Some(bytes);
                Incoming::Owned(values)
            }
        };
        if incoming.len() != range.len() {
            return Err(bad(format!(
                "payload has {} elements, expected {}",
                incoming.len(),
                range.len()
            )));
        }
        if self.seen[phase][sub] {
            return Err(RingError::Duplicate {
                phase: msg.phase,
                chunk: msg.chunk,
                sub: msg.sub,
            });
        }
        self.seen[phase][sub] = true;
        self.remaining -= 1;

        let n = self.world;
        let is_ag = self.is_ag_phase(phase);
        let mean = self.reduce_mode() == Some(Reduce::Mean);
        let next = phase + 1;
        let forward = next < self.num_phases();
        let wire = self.wire;
        let dst = &mut self.buf[range];
        if let RingOp::Broadcast { root } = self.op {
            incoming.store_into(dst);
            if (self.rank + 1) % n != root {
                self.queue_forward(0, sub, incoming);
            }
            return Ok(());
        }
        if is_ag {
            // Gathered bytes are the owner's finished sum: stored, and passed on as received.
            incoming.store_into(dst);
            if forward {
                debug_assert_eq!(self.send_chunk(next), chunk);
                match compact {
                    Some(bytes) => self.queue_payload(next, sub, Payload::Compact { wire, bytes }),
                    None => self.queue_forward(next, sub, incoming),
                }
            }
            return Ok(());
        }
        // Received partial (ranks c+1 .. r-1 folded left to right) plus our own contribution. IEEE addition
        // is commutative, so `partial + own` and `own + partial` give the same bits.
        // In reduce-scatter phase N-2 the received chunk is this rank's own: the sum completes here, and a
        // mean divides it by N once, on the owner only. The finished sum is stored; in an all-reduce a
        // partial sum is not, since the all-gather overwrites it later (a reduce-scatter keeps its partials,
        // documented).
        // The chunk we send in phase p+1 is the one we just received in phase p; the payload is what this
        // rank computed for it. A stored sum is sent from the buffer (see `Outgoing::FromBuffer`).
        let last_rs = phase == n - 2;
        if last_rs || !matches!(self.op, RingOp::AllReduce(_)) {
            incoming.finish_in_place(dst, (last_rs && mean).then_some(self.mean_divisor as f32));
            // The all-reduce's finished sum in a compact format: the owner keeps the rounded value it sends.
            let rounded = (last_rs && forward && wire.is_compact()).then(|| wire.round_in_place(dst));
            if forward {
                debug_assert_eq!(self.send_chunk(next), chunk);
                match rounded {
                    Some(bytes) => self.queue_payload(next, sub, Payload::Compact { wire, bytes }),
                    None => self.outbox.push_back(Outgoing::FromBuffer { phase: next, sub }),
                }
            }
        } else {
            let data = incoming.plus(dst);
            if forward {
                debug_assert_eq!(self.send_chunk(next), chunk);
                match wire {
                    Wire::F32 => self.queue_owned(next, sub, data),
                    wire => self.queue_payload(next, sub, compact_payload(wire, &data)),
                }
            }
        }
        Ok(())
    }

    fn is_done(&self) -> bool {
        self.remaining == 0 && self.outbox.is_empty()
    }

    fn wants_input(&self) -> bool {
        self.remaining > 0
    }

    fn max_payload_bytes(&self) -> usize {
        let max_chunk = match self.op {
            RingOp::Broadcast { .. } => self.buf.len(),
            _ => self.buf.len().div_ceil(self.world),
        };
        self.wire.encoded_len(self.sub_chunk.min(max_chunk))
    }
}

/// Ring all-gather of equal-sized byte blobs: rank `r` contributes `blobs[r]`; every rank ends with all
/// of them. Used for hash comparison and for scalar all-reduce (gather, then a fixed-order sum).
pub struct GatherEngine {
    rank: usize,
    world: usize,
    blob_len: usize,
    blobs: Vec<Option<Vec<u8>>>,
    remaining: usize,
    outbox: std::collections::VecDeque<Msg>,
}

impl GatherEngine {
    pub fn new(rank: usize, world: usize, mine: Vec<u8>) -> Result<Self, RingError> {
        if world == 0 || rank >= world {
            return Err(RingError::Config(format!("rank {rank} not in world of {world}")));
        }
        let blob_len = mine.len();
        let mut blobs = vec![None; world];
        let mut outbox = std::collections::VecDeque::new();
        if world > 1 {
            outbox.push_back(Msg {
                phase: 0,
                chunk: rank as u32,
                sub: 0,
                payload: Payload::Bytes(mine.clone()),
            });
        }
        blobs[rank] = Some(mine);
        Ok(GatherEngine {
            rank,
            world,
            blob_len,
            blobs,
            remaining: world - 1,
            outbox,
        })
    }

    /// All blobs in rank order. Panics if called before `is_done()`.
    pub fn into_blobs(self) -> Vec<Vec<u8>> {
        self.blobs
            .into_iter()
            .map(|b| b.expect("gather not finished"))
            .collect()
    }
}

impl Engine for GatherEngine {
    fn poll_transmit(&mut self, _storage: &dyn PayloadStorage) -> Option<Msg> {
        self.outbox.pop_front()
    }

    fn handle(&mut self, msg: Msg) -> Result<(), RingError> {
        let bad = |why: String| RingError::Unexpected {
            phase: msg.phase,
            chunk: msg.chunk,
            sub: msg.sub,
            why,
        };
        let n = self.world;
        let phase = msg.phase as usize;
        if n < 2 || phase >= n - 1 {
            return Err(bad("phase out of range".into()));
        }
        let want = modn(self.rank as i64 - 1 - phase as i64, n);
        if msg.chunk as usize != want || msg.sub != 0 {
            return Err(bad(format!("expected blob of rank {want}")));
        }
        let data = match msg.payload {
            Payload::Bytes(d) => d,
            Payload::F32(_) | Payload::F32Le(_) | Payload::Compact { .. } => {
                return Err(bad("f32 payload in a byte gather".into()))
            }
        };
        if data.len() != self.blob_len {
            return Err(bad(format!(
                "blob has {} bytes, expected {}",
                data.len(),
                self.blob_len
            )));
        }
        if self.blobs[want].is_some() {
            return Err(RingError::Duplicate {
                phase: msg.phase,
                chunk: msg.chunk,
                sub: msg.sub,
            });
        }
        if phase + 1 < n - 1 {
            self.outbox.push_back(Msg {
                phase: msg.phase + 1,
                chunk: msg.chunk,
                sub: 0,
                payload: Payload::Bytes(data.clone()),
            });
        }
        self.blobs[want] = Some(data);
        self.remaining -= 1;
        Ok(())
    }

    fn is_done(&self) -> bool {
        self.remaining == 0 && self.outbox.is_empty()
    }

    fn wants_input(&self) -> bool {
        self.remaining > 0
    }

    fn max_payload_bytes(&self) -> usize {
        self.blob_len
    }
}

/// Encodes f64 scalars as little-endian bytes for a [`GatherEngine`].
pub fn scalars_to_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Sums gathered scalar blobs in rank order 0..N (a fixed order, so every rank gets identical bits).
pub fn sum_scalar_blobs(blobs: &[Vec<u8>], out: &mut [f64]) {
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f64;
        for b in blobs {
            let bytes: [u8; 8] = b[i * 8..i * 8 + 8]
                .try_into()
                .expect("blob length checked by the engine");
            acc += f64::from_le_bytes(bytes);
        }
        *o = acc;
    }
}

/// Runs a set of engines, one per rank, to completion in a single thread, delivering messages in FIFO
/// order. A reference driver for tests and for the simulator; real transports have their own loops.
pub fn run_local<E: Engine>(engines: &mut [E]) -> Result<(), RingError> {
    run_local_with(engines, |_, _| {})
}

/// [`run_local`], handing every message to `on_send(sender, message)` on its way (tests inspect or
/// reshape messages there).
pub fn run_local_with<E: Engine>(engines: &mut [E], mut on_send: impl FnMut(usize, &mut Msg)) -> Result<(), RingError> {
    let n = engines.len();
    let mut queues: Vec<std::collections::VecDeque<Msg>> = vec![Default::default(); n];
    loop {
        let mut progressed = false;
        for r in 0..n {
            while let Some(mut m) = engines[r].poll_transmit(&Allocate) {
                on_send(r, &mut m);
                queues[(r + 1) % n].push_back(m);
                progressed = true;
            }
        }
        for r in 0..n {
            if let Some(m) = queues[r].pop_front() {
                engines[r].handle(m)?;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    if let Some(r) = engines.iter().position(|e| !e.is_done()) {
        return Err(RingError::Config(format!("rank {r} did not finish (protocol stalled)")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::buffer_pool::BufferPool;

    #[test]
    fn chunk_ranges_cover() {
        for len in [0usize, 1, 2, 7, 13, 100] {
            for n in 1..=8 {
                let mut next = 0;
                for r in 0..n {
                    let c = chunk_range(len, n, r);
                    assert_eq!(c.start, next);
                    next = c.end;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(chunk_range(7, 3, 0), 0..3);
        assert_eq!(chunk_range(7, 3, 1), 3..5);
        assert_eq!(chunk_range(7, 3, 2), 5..7);
    }

    fn all_reduce_local(n: usize, len: usize, sub: usize, mode: Reduce) -> Vec<Vec<f32>> {
        let mut bufs: Vec<Vec<f32>> = (0..n)
            .map(|r| (0..len).map(|i| ((i * 7 + r * 3) % 11) as f32).collect())
            .collect();
        {
            let mut engines: Vec<RingEngine> = bufs
                .iter_mut()
                .enumerate()
                .map(|(r, b)| RingEngine::new(RingOp::AllReduce(mode), r, n, b, sub).unwrap())
                .collect();
            run_local(&mut engines).unwrap();
        }
        bufs
    }

    #[test]
    fn local_all_reduce_sums() {
        for n in 1..=5 {
            for len in [0, 1, 2, 7, 13, 97] {
                for sub in [1, 3, 1000] {
                    let out = all_reduce_local(n, len, sub, Reduce::Sum);
                    for (i, v) in out[0].iter().enumerate() {
                        let want: f32 = (0..n).map(|r| ((i * 7 + r * 3) % 11) as f32).sum();
                        assert_eq!(*v, want, "n={n} len={len} sub={sub} i={i}");
                    }
                    for b in &out {
                        assert_eq!(b, &out[0]);
                    }
                }
            }
        }
    }

    #[test]
    fn local_broadcast_and_gather() {
        for n in 1..=4 {
            for root in 0..n {
                let mut bufs: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32; 10]).collect();
                {
                    let mut engines: Vec<RingEngine> = bufs
                        .iter_mut()
                        .enumerate()
                        .map(|(r, b)| RingEngine::new(RingOp::Broadcast { root }, r, n, b, 3).unwrap())
                        .collect();
                    run_local(&mut engines).unwrap();
                }
                assert!(bufs.iter().all(|b| b.iter().all(|&x| x == root as f32)));
            }
            let mut gs: Vec<GatherEngine> = (0..n)
                .map(|r| GatherEngine::new(r, n, vec![r as u8; 4]).unwrap())
                .collect();
            run_local(&mut gs).unwrap();
            for g in gs {
                let blobs = g.into_blobs();
                assert_eq!(blobs, (0..n).map(|r| vec![r as u8; 4]).collect::<Vec<_>>());
            }
        }
    }

    /// A shift leaves each rank its own chunk and its left neighbour's, with the rest of the buffer as it
    /// was; a lone rank keeps its buffer.
    #[test]
    fn local_shift_hands_each_chunk_to_the_right_neighbour() {
        for n in 1..=5 {
            for len in [0, 1, 7, 13, 97] {
                for sub in [1, 4, 1000] {
                    let value = |r: usize, i: usize| (r * 1000 + i) as f32;
                    let mut bufs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|i| value(r, i)).collect()).collect();
                    {
                        let mut engines: Vec<RingEngine> = bufs
                            .iter_mut()
                            .enumerate()
                            .map(|(r, b)| RingEngine::new(RingOp::Shift, r, n, b, sub).unwrap())
                            .collect();
                        run_local(&mut engines).unwrap();
                    }
                    for (r, buf) in bufs.iter().enumerate() {
                        let left = (r + n - 1) % n;
                        let from_left = chunk_range(len, n, left);
                        for (i, x) in buf.iter().enumerate() {
                            let want = if n > 1 && from_left.contains(&i) {
                                value(left, i)
                            } else {
                                value(r, i)
                            };
                            assert_eq!(*x, want, "n={n} len={len} sub={sub} rank {r} element {i}");
                        }
                    }
                }
            }
        }
    }

    /// Every message becomes received pieces, `lent` or not, on its way; returns the buffers and whether
    /// any message sent on had kept lent pieces.
    fn run_as_pieces(n: usize, op: RingOp, lent: bool) -> (Vec<Vec<f32>>, bool) {
        let mut bufs: Vec<Vec<f32>> = (0..n)
            .map(|r| (0..23).map(|i| (i * 5 + r * 7) as f32 * 0.3).collect())
            .collect();
        let mut kept_lent = false;
        {
            let mut engines: Vec<RingEngine> = bufs
                .iter_mut()
                .enumerate()
                .map(|(r, b)| RingEngine::new(op, r, n, b, 4).unwrap())
                .collect();
            run_local_with(&mut engines, |_, m| {
                if let Payload::F32Le(p) = &m.payload {
                    kept_lent |= p.lent;
                }
                let values = match &m.payload {
                    Payload::F32(v) => v.clone(),
                    Payload::F32Le(p) => p.to_f32(),
                    Payload::Bytes(_) | Payload::Compact { .. } => unreachable!("an f32 collective"),
                };
                m.payload = Payload::F32Le(LePieces {
                    lent,
                    ..LePieces::from_f32(&values)
                });
            })
            .unwrap();
        }
        (bufs, kept_lent)
    }

    #[test]
    fn lent_pieces_are_forwarded_from_the_buffer_with_the_same_bits() {
        for n in [2, 3, 4] {
            for op in [
                RingOp::AllReduce(Reduce::Mean),
                RingOp::AllGather,
                RingOp::Broadcast { root: 1 },
            ] {
                let (owned, _) = run_as_pieces(n, op, false);
                let (lent, kept) = run_as_pieces(n, op, true);
                assert!(!kept, "n={n} {op:?}: lent pieces were sent on");
                let bits = |b: &Vec<Vec<f32>>| {
                    b.iter()
                        .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                        .collect::<Vec<_>>()
                };
                assert_eq!(bits(&owned), bits(&lent), "n={n} {op:?}");
            }
        }
    }

    #[test]
    fn phase_zero_copies_come_from_the_pool() {
        let pool = BufferPool::new(1 << 20);
        let idle = vec![0.0f32; 64];
        let recycled = idle.as_ptr();
        pool.give(idle);
        let mut a: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let mut e = RingEngine::new(RingOp::AllReduce(Reduce::Sum), 0, 2, &mut a, 8).unwrap();
        // Rank 0 sends chunk 1 (5..10) first, copied out of its buffer into storage from the pool.
        let m = e.poll_transmit(&*pool).expect("phase 0 sends at once");
        assert_eq!(pool.idle(), 0, "the copy took the idle buffer");
        match m.payload {
            Payload::F32(v) => {
                assert_eq!(v, vec![5.0, 6.0, 7.0, 8.0, 9.0]);
                assert_eq!(v.as_ptr(), recycled);
            }
            _ => panic!("phase 0 sends f32"),
        }
    }

    #[test]
    fn rejects_duplicates_and_bad_tags() {
        let mut a = vec![1.0f32; 10];
        let mut e = RingEngine::new(RingOp::AllReduce(Reduce::Sum), 1, 3, &mut a, 2).unwrap();
        // Rank 1 receives chunk (1-2-0) mod 3 = 2 in phase 0; chunk 2 is 7..10 → subs [7, 9) and [9, 10).
        let m = Msg {
            phase: 0,
            chunk: 2,
            sub: 0,
            payload: Payload::F32(vec![1.0, 1.0]),
        };
        e.handle(m.clone()).unwrap();
        assert!(matches!(e.handle(m), Err(RingError::Duplicate { .. })));
        let wrong_chunk = Msg {
            phase: 0,
            chunk: 0,
            sub: 0,
            payload: Payload::F32(vec![1.0, 1.0]),
        };
        assert!(e.handle(wrong_chunk).is_err());
        let wrong_len = Msg {
            phase: 0,
            chunk: 2,
            sub: 1,
            payload: Payload::F32(vec![1.0, 2.0]),
        };
        assert!(e.handle(wrong_len).is_err());
        let wrong_sub = Msg {
            phase: 0,
            chunk: 2,
            sub: 2,
            payload: Payload::F32(vec![1.0]),
        };
        assert!(e.handle(wrong_sub).is_err());
        let bytes = Msg {
            phase: 0,
            chunk: 2,
            sub: 1,
            payload: Payload::Bytes(vec![0; 4]),
        };
        assert!(e.handle(bytes).is_err());
        let wrong_len = Msg {
            phase: 0,
            chunk: 2,
            sub: 1,
            payload: Payload::F32(vec![]),
        };
        assert!(e.handle(wrong_len).is_err());
        let wrong_phase = Msg {
            phase: 9,
            chunk: 2,
            sub: 0,
            payload: Payload::F32(vec![1.0, 1.0]),
        };
        assert!(e.handle(wrong_phase).is_err());
        // Byte pieces (as QUIC delivers them): a count that is not whole f32 values, and a wrong total.
        let ragged = LePieces {
            pieces: vec![
                bytes::Bytes::from_static(&[0, 0, 128]),
                bytes::Bytes::from_static(&[63]),
            ],
            pool: None,
            lent: false,
        };
        let mut ragged_short = ragged.clone();
        ragged_short.pieces[1] = bytes::Bytes::new();
        let short_msg = Msg {
            phase: 0,
            chunk: 2,
            sub: 1,
            payload: Payload::F32Le(ragged_short),
        };
        assert!(e.handle(short_msg).is_err(), "3 bytes are not an f32");
        let mut two = ragged.clone();
        two.pieces.push(bytes::Bytes::from_static(&[0, 0, 0, 0]));
        let too_long = Msg {
            phase: 0,
            chunk: 2,
            sub: 1,
            payload: Payload::F32Le(two),
        };
        assert!(e.handle(too_long).is_err(), "sub 1 holds one value, not two");
        let right = Msg {
            phase: 0,
            chunk: 2,
            sub: 1,
            payload: Payload::F32Le(ragged),
        };
        e.handle(right).unwrap();
    }

    /// A compact collective takes only its own format, at the length its values need, and an f32
    /// collective takes no compact payload.
    #[test]
    fn compact_payloads_must_match_the_format_and_the_values() {
        let mut a = vec![1.0f32; 10];
        let mut e = RingEngine::new(RingOp::AllReduce(Reduce::Sum), 1, 3, &mut a, 2)
            .unwrap()
            .with_wire(Wire::Int8);
        // Phase 0 brings chunk 2's sub 0: two values, one int8 block (a 4-byte scale, then 2 bytes).
        let at = |payload| Msg {
            phase: 0,
            chunk: 2,
            sub: 0,
            payload,
        };
        let compact = |wire, bytes| Payload::Compact { wire, bytes };
        assert!(
            e.handle(at(Payload::F32(vec![1.0, 1.0]))).is_err(),
            "f32 in an int8 collective"
        );
        assert!(
            e.handle(at(compact(Wire::Bf16, vec![0; 4]))).is_err(),
            "bf16 in an int8 collective"
        );
        assert!(e.handle(at(compact(Wire::Int8, vec![0; 5]))).is_err(), "one byte short");
        assert!(e.handle(at(compact(Wire::Int8, vec![0; 7]))).is_err(), "one byte over");
        e.handle(at(compact(Wire::Int8, vec![0; 6]))).unwrap();
        assert!(matches!(
            e.handle(at(compact(Wire::Int8, vec![0; 6]))),
            Err(RingError::Duplicate { .. })
        ));
        let mut b = vec![1.0f32; 10];
        let mut plain = RingEngine::new(RingOp::AllReduce(Reduce::Sum), 1, 3, &mut b, 2).unwrap();
        let bf16 = Msg {
            phase: 0,
            chunk: 2,
            sub: 0,
            payload: compact(Wire::Bf16, vec![0; 4]),
        };
        assert!(plain.handle(bf16).is_err(), "bf16 in an f32 collective");
        // A gather ignores the wire: it sends f32.
        let mut c = vec![1.0f32; 10];
        let mut gather = RingEngine::new(RingOp::AllGather, 0, 3, &mut c, 4)
            .unwrap()
            .with_wire(Wire::Bf16);
        assert!(matches!(
            gather.poll_transmit(&Allocate).unwrap().payload,
            Payload::F32(_)
        ));
    }
}
