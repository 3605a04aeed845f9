//! The collective loop: drives one sans-IO engine ([`Engine`]) over the ring links. The engine's messages
//! go to the right neighbour as data frames, frames from the left neighbour go to the engine after their
//! tags and size are checked, and the per-collective deadline and the control plane's verdicts bound the
//! wait. When a link breaks, [`QuicCollective::blame`] works out which rank to name.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;

use super::framing::{data_frame_chunks, LinkEvent};
use super::{local, QuicCollective, Shared};
use crate::collective::buffer_pool::BufferPool;
use crate::collective::frame::{self, Header, SequenceGuard};
use crate::collective::le_pieces::LePieces;
use crate::collective::ring::{Engine, Msg, Payload};
use crate::collective::{CollectiveError, Result};

/// One collective's place in the ring and its deadline.
struct Round {
    seq: u64,
    left_rank: usize,
    right_rank: usize,
    deadline: Instant,
    /// The per-collective timeout in seconds, for the error message.
    secs: f64,
}

impl QuicCollective {
    /// Runs `engine` to completion: sends what it has to send, then waits for the left neighbour's next
    /// frame, until it is done.
    /// `left_rank` and `right_rank` are the engine's ring neighbours (global ranks).
    pub(super) async fn drive(&mut self, engine: &mut dyn Engine, left_rank: usize, right_rank: usize) -> Result<()> {
        let round = Round {
            seq: self.seq,
            left_rank,
            right_rank,
            deadline: Instant::now() + self.cfg.timeout,
            secs: self.cfg.timeout.as_secs_f64(),
        };
        self.guard.begin(round.seq, self.step);
        let mut poison_rx = self.poison_rx.clone();
        loop {
            if let Some(e) = self.current_poison() {
                return Err(e);
            }
            loop {
                match self.send_in_place(engine, &round) {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(reason) => return Err(self.blame(round.right_rank, &reason, round.deadline).await),
                }
                match engine.poll_transmit(&*self.shared.pool) {
                    Some(m) => self.transmit(m, engine, &round, &mut poison_rx).await?,
                    None => break,
                }
            }
            if engine.is_done() {
                return Ok(());
            }
            let rx = &mut self
                .lefts
                .get_mut(&round.left_rank)
                .ok_or_else(|| local(format!("no link from rank {}", round.left_rank)))?
                .rx;
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = tokio::time::sleep_until(round.deadline) =>
                    return Err(CollectiveError::Timeout { seq: round.seq, waiting_on: round.left_rank, secs: round.secs }),
                r = poison_rx.changed() => {
                    if let Some(e) = self.current_poison() { return Err(e); }
                    if r.is_err() { return Err(local("control plane stopped")); }
                    continue;
                }
            };
            match apply_event(ev, engine, &mut self.guard, &self.shared.pool, round.left_rank) {
                Ok(()) => {}
                Err(EventError::Fatal(e)) => return Err(e),
                Err(EventError::LinkLost(reason)) => {
                    return Err(self.blame(round.left_rank, &reason, round.deadline).await)
                }
            }
        }
    }

    /// Writes the engine's next message straight from the caller's buffer into a shared-memory right link,
    /// when it is one ([`Engine::peek_in_buffer`]) and the link's ring has room for the whole frame now:
    /// no copy into a message buffer first. Returns whether it did. Off while data faults are injected
    /// (they count and repeat messages on the other path) and on big-endian machines (the wire is
    /// little-endian).
    fn send_in_place(&mut self, engine: &mut dyn Engine, round: &Round) -> std::result::Result<bool, String> {
        if cfg!(target_endian = "big") || self.faults.crash_after_msgs.is_some() || self.faults.duplicate_msg.is_some()
        {
            return Ok(false);
        }
        let Some(right) = self.rights.get_mut(&round.right_rank) else {
            return Ok(false);
        };
        let Some(m) = engine.peek_in_buffer() else {
            return Ok(false);
        };
        let header = Header {
            kind: frame::Kind::F32,
            job: self.cfg.job_id,
            step: self.step,
            seq: round.seq,
            phase: m.phase,
            chunk: m.chunk,
            sub: m.sub,
            len: u32::try_from(m.values.len() * 4).expect("a sub-chunk fits in u32"),
        };
        let mut hb = Vec::with_capacity(frame::HEADER_LEN);
        header.encode(&mut hb);
        if !right.data.try_write_now(&[&hb, bytemuck::cast_slice(m.values)])? {
            return Ok(false);
        }
        self.sent_msgs += 1;
        self.sent_bytes.add((hb.len() + m.values.len() * 4) as u64);
        engine.pop_peeked();
        Ok(true)
    }

    /// Sends one engine message to the right neighbour (with the injected faults, [`QuicCollective::inject_faults`]).
    /// While the write waits for flow-control credit, it keeps taking what the left neighbour sends: the
    /// neighbour may itself be waiting on this rank, and the reader's queue is bounded.
    async fn transmit(
        &mut self,
        m: Msg,
        engine: &mut dyn Engine,
        round: &Round,
        poison_rx: &mut watch::Receiver<Option<CollectiveError>>,
    ) -> Result<()> {
        if let Some(k) = self.faults.crash_after_msgs {
            if self.sent_msgs >= k {
                self.crash();
                return Err(local(format!(
                    "rank {}: injected crash after {k} messages",
                    self.cfg.rank
                )));
            }
        }
        let mut chunks = data_frame_chunks(self.cfg.job_id, self.step, round.seq, m, &self.shared.pool);
        if self.faults.duplicate_msg == Some(self.sent_msgs) {
            chunks.extend_from_within(..);
        }
        self.sent_msgs += 1;
        self.sent_bytes.add(chunks.iter().map(|c| c.len() as u64).sum::<u64>());
        let lost = {
            let send = &mut self
                .rights
                .get_mut(&round.right_rank)
                .ok_or_else(|| local(format!("no link to rank {}", round.right_rank)))?
                .data;
            let rx = &mut self
                .lefts
                .get_mut(&round.left_rank)
                .ok_or_else(|| local(format!("no link from rank {}", round.left_rank)))?
                .rx;
            let (guard, pool) = (&mut self.guard, &self.shared.pool);
            let mut write = std::pin::pin!(send.write_all_chunks(&mut chunks));
            loop {
                tokio::select! {
                    r = &mut write => match r {
                        Ok(()) => break None,
                        Err(e) => break Some((round.right_rank, e)),
                    },
                    ev = rx.recv(), if engine.wants_input() => {
                        match apply_event(ev, engine, guard, pool, round.left_rank) {
                            Ok(()) => {}
                            Err(EventError::Fatal(e)) => return Err(e),
                            Err(EventError::LinkLost(reason)) => break Some((round.left_rank, reason)),
                        }
                    }
                    _ = tokio::time::sleep_until(round.deadline) =>
                        return Err(CollectiveError::Timeout {
                            seq: round.seq,
                            waiting_on: round.right_rank,
                            secs: round.secs,
                        }),
                    _ = poison_rx.changed() =>
                        break Some((round.right_rank, "control plane reported a failure".to_string())),
                }
            }
        };
        match lost {
            Some((peer, reason)) => Err(self.blame(peer, &reason, round.deadline).await),
            None => Ok(()),
        }
    }

    /// A link broke: give rank 0's verdict time to arrive, so the error names the rank that really died
    /// (the neighbour may just have left after seeing the failure first); otherwise blame the neighbour.
    async fn blame(&self, peer: usize, reason: &str, deadline: Instant) -> CollectiveError {
        let fallback = CollectiveError::PeerDead {
            rank: peer,
            reason: format!("link lost: {reason}"),
        };
        let grace = (Instant::now() + Shared::verdict_grace(self.cfg.idle_timeout)).min(deadline);
        self.shared.verdict_or(fallback, grace).await
    }
}

/// Why a link event ended the collective.
enum EventError {
    /// A protocol violation or a local failure: the collective fails with it.
    Fatal(CollectiveError),
    /// The left link broke, for this reason; who is to blame is still to be found out.
    LinkLost(String),
}

/// Feeds one event of the left link (`None`: its reader stopped) to `engine`, after checking the frame's
/// tags and size.
fn apply_event(
    ev: Option<LinkEvent>,
    engine: &mut dyn Engine,
    guard: &mut SequenceGuard,
    pool: &Arc<BufferPool>,
    left_rank: usize,
) -> std::result::Result<(), EventError> {
    let proto = |msg: String| EventError::Fatal(CollectiveError::Protocol { rank: left_rank, msg });
    // Tags first, then the size this engine can take (the reader read `len` bytes for either kind).
    let mut check = |h: &Header, len: usize| {
        guard.check(h).map_err(|e| proto(e.to_string()))?;
        let max = engine.max_payload_bytes();
        if len > max {
            return Err(proto(format!("payload of {len} bytes exceeds the {max} expected")));
        }
        Ok(())
    };
    match ev.unwrap_or(LinkEvent::Closed("reader stopped".into())) {
        LinkEvent::Frame(h, payload) => {
            check(&h, payload.len())?;
            let msg = frame::decode_msg(&h, &payload).map_err(|e| proto(e.to_string()))?;
            engine.handle(msg).map_err(|e| proto(e.to_string()))
        }
        LinkEvent::F32Le(h, pieces, lent) => {
            check(&h, h.len as usize)?;
            let msg = Msg {
                phase: h.phase,
                chunk: h.chunk,
                sub: h.sub,
                payload: Payload::F32Le(LePieces {
                    pieces,
                    pool: Some(pool.clone()),
                    lent,
                }),
            };
            engine.handle(msg).map_err(|e| proto(e.to_string()))
        }
        LinkEvent::Bad(e) => Err(proto(e.to_string())),
        LinkEvent::Closed(reason) => Err(EventError::LinkLost(reason)),
    }
}
