//! In-memory transport: N ranks in one process (one thread each), linked in a ring by channels.
//!
//! It drives the same sans-IO engines as QUIC, so it is the reference transport for tests and the
//! simulator. It applies the message kinds of a [`FaultPlan`]:
//! - `delay`: every message becomes deliverable only `delay` after it was sent;
//! - `reorder`: the receiver picks uniformly (seeded) among all deliverable messages of the current
//!   collective instead of the oldest, so independent messages (different phase/chunk/sub tags) arrive out
//!   of order; engines reassemble them by tag;
//! - `slow`: that rank sleeps before handling each message;
//! - `drop`: that rank "dies" after sending the given number of messages (counted over its lifetime): its
//!   call fails and every other rank fails with [`CollectiveError::PeerDead`] naming it, within the
//!   deadline, never hanging;
//! - `kill`: that rank dies when its step reaches the given one, before sending anything of that step,
//!   with the same outcome for the others as `drop`;
//! - `split`: every f32 payload is delivered as little-endian byte pieces cut at seeded offsets, the form
//!   in which the QUIC transport hands received data to the engines (values split across pieces).
//!
//! `duplicate` is QUIC's (the in-memory ring has no replay check to exercise), and the rest of the plan
//! is the trainer's.
//!
//! Dropping a [`MemCollective`] between collectives is a clean exit; dropping it during one (a panicking
//! thread) counts as death.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::le_pieces::{le_bytes, LePieces};
use super::ring::{Allocate, Engine, Msg, Payload, RingOp};
use super::{run_ring, Collective, CollectiveError, Result};
use crate::fault_plan::FaultPlan;

/// Options for [`mem_cluster`].
#[derive(Clone, Debug)]
pub struct MemOptions {
    /// Per-collective deadline.
    pub deadline: Duration,
    /// Pipelining granularity in f32 elements.
    pub sub_chunk: usize,
    /// The faults to inject (the kinds this transport applies; see the module documentation).
    pub faults: FaultPlan,
}

impl Default for MemOptions {
    fn default() -> Self {
        MemOptions {
            deadline: Duration::from_secs(30),
            sub_chunk: super::ring::DEFAULT_SUB_CHUNK,
            faults: FaultPlan::default(),
        }
    }
}

const RUNNING: u8 = 0;
const EXITED: u8 = 1;
const DEAD: u8 = 2;

struct Shared {
    state: Vec<AtomicU8>,
    abort: Mutex<Option<(usize, String)>>,
}

struct Envelope {
    seq: u64,
    deliver_at: Instant,
    msg: Msg,
}

/// One rank of an in-memory cluster. Move each into its own thread.
pub struct MemCollective {
    rank: usize,
    world: usize,
    opts: MemOptions,
    tx: Option<Sender<Envelope>>,
    rx: Receiver<Envelope>,
    pending: Vec<Envelope>,
    shared: Arc<Shared>,
    rng: Option<ChaCha8Rng>,
    split_rng: Option<ChaCha8Rng>,
    seq: u64,
    sent: usize,
    /// Payload bytes sent so far.
    sent_bytes: super::SentBytes,
    in_collective: bool,
    failed: Option<CollectiveError>,
    wire: super::Wire,
}

/// Builds `world` connected ranks.
pub fn mem_cluster(world: usize, opts: MemOptions) -> Vec<MemCollective> {
    assert!(world > 0, "world must be at least 1");
    let shared = Arc::new(Shared {
        state: (0..world).map(|_| AtomicU8::new(RUNNING)).collect(),
        abort: Mutex::new(None),
    });
    // Channel i carries rank i-1 → rank i.
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..world).map(|_| mpsc::channel::<Envelope>()).unzip();
    let mut rxs: Vec<Option<Receiver<Envelope>>> = rxs.into_iter().map(Some).collect();
    (0..world)
        .map(|r| MemCollective {
            rank: r,
            world,
            tx: Some(txs[(r + 1) % world].clone()),
            rx: rxs[r].take().expect("each receiver taken once"),
            pending: Vec::new(),
            shared: shared.clone(),
            rng: opts
                .faults
                .reorder_seed()
                .map(|s| ChaCha8Rng::seed_from_u64(s ^ (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))),
            split_rng: opts
                .faults
                .split_seed()
                .map(|s| ChaCha8Rng::seed_from_u64(s ^ (r as u64).wrapping_mul(0x51_7CC1_B727_220A))),
            opts: opts.clone(),
            seq: 0,
            sent: 0,
            sent_bytes: Default::default(),
            in_collective: false,
            failed: None,
            wire: Default::default(),
        })
        .collect()
}

/// The collective of a single process: one rank, so no collective ever sends or waits for anything.
pub fn single_rank() -> Box<dyn Collective> {
    Box::new(
        mem_cluster(1, MemOptions::default())
            .pop()
            .expect("a one-rank cluster has one rank"),
    )
}

impl MemCollective {
    fn left(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    fn die(&mut self) {
        self.shared.state[self.rank].store(DEAD, Ordering::SeqCst);
        self.tx = None;
    }

    fn check_peers(&self) -> Result<()> {
        if let Some((rank, reason)) = self.shared.abort.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            if rank != self.rank {
                return Err(CollectiveError::Aborted { rank, reason });
            }
        }
        for (r, s) in self.shared.state.iter().enumerate() {
            if r != self.rank && s.load(Ordering::SeqCst) == DEAD {
                return Err(CollectiveError::PeerDead {
                    rank: r,
                    reason: "process died".into(),
                });
            }
        }
        Ok(())
    }

    /// With `split`, an f32 payload as byte pieces of 0 to 40 bytes (mostly cutting values apart).
    fn maybe_split(&mut self, mut msg: Msg) -> Msg {
        let Some(rng) = &mut self.split_rng else { return msg };
        let bytes = match &msg.payload {
            Payload::F32(v) => le_bytes(v),
            Payload::F32Le(p) => le_bytes(&p.to_f32()),
            Payload::Bytes(_) | Payload::Compact { .. } => return msg,
        };
        let mut pieces = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let end = (at + rng.random_range(0..=40)).min(bytes.len());
            pieces.push(bytes.slice(at..end));
            at = end;
        }
        msg.payload = Payload::F32Le(LePieces {
            pieces,
            pool: None,
            lent: false,
        });
        msg
    }

    fn send(&mut self, msg: Msg) -> Result<()> {
        let msg = self.maybe_split(msg);
        if let Some(n) = self.opts.faults.dies_after_messages(self.rank) {
            if self.sent >= n {
                self.die();
                return Err(CollectiveError::Local(format!(
                    "rank {}: injected failure after {n} messages",
                    self.rank
                )));
            }
        }
        self.sent += 1;
        self.sent_bytes.add(msg.payload.len_bytes() as u64);
        let deliver_at = Instant::now() + self.opts.faults.message_delay().unwrap_or_default();
        let right = (self.rank + 1) % self.world;
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| CollectiveError::Local("this rank has failed".into()))?;
        tx.send(Envelope {
            seq: self.seq,
            deliver_at,
            msg,
        })
        .map_err(|_| {
            // The neighbour may have left after seeing a failure first: name the dead rank if there is one.
            self.check_peers().err().unwrap_or(CollectiveError::PeerDead {
                rank: right,
                reason: "channel closed".into(),
            })
        })
    }

    /// Next message of the current collective from the left neighbour.
    fn recv(&mut self, deadline: Instant) -> Result<Msg> {
        let left = self.left();
        let mut disconnected = false;
        loop {
            loop {
                match self.rx.try_recv() {
                    Ok(e) => self.pending.push(e),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            let now = Instant::now();
            if let Some(e) = self.pending.iter().find(|e| e.seq < self.seq) {
                return Err(CollectiveError::Protocol {
                    rank: left,
                    msg: format!("stale message of collective #{} during #{}", e.seq, self.seq),
                });
            }
            let ready: Vec<usize> = (0..self.pending.len())
                .filter(|&i| self.pending[i].seq == self.seq && self.pending[i].deliver_at <= now)
                .collect();
            if !ready.is_empty() {
                let pick = match &mut self.rng {
                    Some(rng) => ready[rng.random_range(0..ready.len())],
                    None => ready[0],
                };
                return Ok(self.pending.remove(pick).msg);
            }
            self.check_peers()?;
            if disconnected && self.pending.iter().all(|e| e.seq != self.seq) {
                return Err(CollectiveError::PeerDead {
                    rank: left,
                    reason: "disconnected".into(),
                });
            }
            if now >= deadline {
                return Err(CollectiveError::Timeout {
                    seq: self.seq,
                    waiting_on: left,
                    secs: self.opts.deadline.as_secs_f64(),
                });
            }
            let next_due = self
                .pending
                .iter()
                .filter(|e| e.seq == self.seq)
                .map(|e| e.deliver_at)
                .min();
            let mut wait = (deadline - now).min(Duration::from_millis(5));
            if let Some(t) = next_due {
                wait = wait.min(t.saturating_duration_since(now));
            }
            if disconnected {
                std::thread::sleep(wait);
                continue;
            }
            match self.rx.recv_timeout(wait) {
                Ok(e) => self.pending.push(e),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => disconnected = true,
            }
        }
    }

    fn run_inner(&mut self, engine: &mut dyn Engine) -> Result<()> {
        let deadline = Instant::now() + self.opts.deadline;
        self.check_peers()?;
        let left = self.left();
        loop {
            let mut burst = Vec::new();
            while let Some(m) = engine.poll_transmit(&Allocate) {
                burst.push(m);
            }
            if let Some(rng) = &mut self.rng {
                // Seeded shuffle of independent messages (Fisher-Yates).
                for i in (1..burst.len()).rev() {
                    let j = rng.random_range(0..=i);
                    burst.swap(i, j);
                }
            }
            for m in burst {
                self.send(m)?;
            }
            if engine.is_done() {
                return Ok(());
            }
            let msg = self.recv(deadline)?;
            if let Some(d) = self.opts.faults.message_handling_delay(self.rank) {
                std::thread::sleep(d);
            }
            engine.handle(msg).map_err(|e| CollectiveError::Protocol {
                rank: left,
                msg: e.to_string(),
            })?;
        }
    }
}

impl Collective for MemCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn sent_bytes(&self) -> crate::collective::SentBytes {
        self.sent_bytes.clone()
    }

    fn world(&self) -> usize {
        self.world
    }

    fn wire(&self) -> super::Wire {
        self.wire
    }

    fn set_wire(&mut self, wire: super::Wire) {
        self.wire = wire;
    }

    fn run_f32(&mut self, op: RingOp, buf: &mut [f32]) -> Result<()> {
        let sub_chunk = self.opts.sub_chunk;
        run_ring(self, op, buf, sub_chunk)
    }

    fn run_engine(&mut self, engine: &mut dyn Engine) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        self.in_collective = true;
        let res = self.run_inner(engine);
        self.in_collective = false;
        self.seq += 1;
        if let Err(e) = &res {
            self.failed = Some(e.clone());
        }
        res
    }

    fn set_step(&mut self, step: u64) {
        if self.opts.faults.dies_at_step_index(self.rank) == Some(step) && self.failed.is_none() {
            self.die();
            self.failed = Some(CollectiveError::Local(format!(
                "rank {}: injected removal at step {}",
                self.rank,
                step + 1
            )));
        }
    }

    fn abort(&mut self, reason: &str) {
        // A dead rank (an injected death) tells nobody anything, as a killed process cannot.
        if self.shared.state[self.rank].load(Ordering::SeqCst) == DEAD {
            return;
        }
        let mut a = self.shared.abort.lock().unwrap_or_else(|e| e.into_inner());
        if a.is_none() {
            *a = Some((self.rank, reason.to_string()));
        }
    }
}

impl Drop for MemCollective {
    fn drop(&mut self) {
        let s = &self.shared.state[self.rank];
        if self.in_collective || std::thread::panicking() {
            s.store(DEAD, Ordering::SeqCst);
        } else {
            let _ = s.compare_exchange(RUNNING, EXITED, Ordering::SeqCst, Ordering::SeqCst);
        }
    }
}

/// Runs `f` on every rank of a fresh in-memory cluster, one thread per rank, and returns each rank's result.
pub fn run_cluster<T: Send>(world: usize, opts: MemOptions, f: impl Fn(&mut MemCollective) -> T + Sync) -> Vec<T> {
    let ranks = mem_cluster(world, opts);
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut c| {
                let f = &f;
                s.spawn(move || f(&mut c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}
