//! Frames on quinn streams: reading any frame within a bound, reading a data frame without copying its f32
//! payload, and building data, control and abort frames (the format itself is [`crate::collective::frame`]).

use std::sync::Arc;

use quinn::RecvStream;

use super::messages::Control;
use crate::collective::buffer_pool::{BufferPool, PooledLeF32};
use crate::collective::frame::{self, FrameError, Header, Kind, HEADER_LEN};
use crate::collective::ring::{Msg, Payload};
use crate::collective::CollectiveError;

/// Largest control message payload (JSON) accepted.
pub(super) const MAX_CONTROL: usize = 1 << 20;
/// Abort reasons are cut to this many bytes.
const MAX_REASON: usize = 4096;

/// Received stream data shorter than this is copied rather than kept as a slice of its datagram (a quarter
/// of the largest loopback datagram, so retained memory stays within 4x of the payload).
const MIN_ZERO_COPY_PIECE: usize = 16 << 10;

#[derive(Debug)]
pub(super) enum ReadFail {
    /// The stream or connection ended.
    Closed(String),
    /// The peer sent a frame the protocol forbids.
    Bad(FrameError),
}

impl std::fmt::Display for ReadFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadFail::Closed(s) => write!(f, "connection closed: {s}"),
            ReadFail::Bad(e) => write!(f, "bad frame: {e}"),
        }
    }
}

fn closed_reason(e: &quinn::ReadExactError) -> String {
    match e {
        quinn::ReadExactError::FinishedEarly(_) => "stream finished".into(),
        quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => c.to_string(),
        quinn::ReadExactError::ReadError(r) => r.to_string(),
    }
}

/// What the left link's reader hands the collective loop.
pub(super) enum LinkEvent {
    Frame(Header, Vec<u8>),
    /// A data frame of kind F32: its payload as received, `h.len` bytes in all (a multiple of 4), and
    /// whether the pieces are lent from a shared-memory ring (see [`LePieces::lent`]).
    ///
    /// [`LePieces::lent`]: crate::collective::le_pieces::LePieces::lent
    F32Le(Header, Vec<bytes::Bytes>, bool),
    Closed(String),
    Bad(FrameError),
}

/// Reads one frame whose payload is at most `max_payload` bytes.
pub(super) async fn read_frame(recv: &mut RecvStream, max_payload: usize) -> Result<(Header, Vec<u8>), ReadFail> {
    let h = read_header(recv, max_payload).await?;
    // `h.len` is bounded by `max_payload` here.
    let mut payload = vec![0u8; h.len as usize];
    recv.read_exact(&mut payload)
        .await
        .map_err(|e| ReadFail::Closed(closed_reason(&e)))?;
    Ok((h, payload))
}

/// Reads and checks a frame header; its `len` is at most `max_payload`.
async fn read_header(recv: &mut RecvStream, max_payload: usize) -> Result<Header, ReadFail> {
    let mut hb = [0u8; HEADER_LEN];
    recv.read_exact(&mut hb)
        .await
        .map_err(|e| ReadFail::Closed(closed_reason(&e)))?;
    Header::decode(&hb, max_payload).map_err(ReadFail::Bad)
}

/// Reads one data frame. A well-formed f32 payload is taken as the stream's own received pieces (no copy:
/// the engine sums or stores straight from them, see `le_pieces.rs`).
pub(super) async fn read_data_frame(recv: &mut RecvStream, max_payload: usize) -> Result<LinkEvent, ReadFail> {
    let h = read_header(recv, max_payload).await?;
    // `h.len` is bounded by `max_payload` here.
    let len = h.len as usize;
    if h.kind == Kind::F32 && len % 4 == 0 {
        let pieces = read_pieces(recv, len).await?;
        return Ok(LinkEvent::F32Le(h, pieces, false));
    }
    let mut payload = vec![0u8; len];
    recv.read_exact(&mut payload)
        .await
        .map_err(|e| ReadFail::Closed(closed_reason(&e)))?;
    Ok(LinkEvent::Frame(h, payload))
}

/// Reads the next `len` bytes of the stream as the pieces quinn received them in.
async fn read_pieces(recv: &mut RecvStream, len: usize) -> Result<Vec<bytes::Bytes>, ReadFail> {
    let mut pieces = Vec::new();
    // Small pieces are copied together: each piece keeps its whole datagram alive, so a peer sending
    // a few bytes per packet could otherwise pin up to 65 KB per byte sent (at most 4x here).
    let mut small = bytes::BytesMut::new();
    let mut left = len;
    while left > 0 {
        let chunk = recv
            .read_chunk(left, true)
            .await
            .map_err(|e| ReadFail::Closed(closed_reason(&quinn::ReadExactError::ReadError(e))))?;
        let chunk = chunk.ok_or_else(|| ReadFail::Closed("stream finished".into()))?;
        left -= chunk.bytes.len();
        if chunk.bytes.len() < MIN_ZERO_COPY_PIECE {
            small.extend_from_slice(&chunk.bytes);
        } else {
            if !small.is_empty() {
                pieces.push(small.split().freeze());
            }
            pieces.push(chunk.bytes);
        }
    }
    if !small.is_empty() {
        pieces.push(small.freeze());
    }
    Ok(pieces)
}

/// Reads one control message; with `job`, a frame for another job is refused.
pub(super) async fn read_control(recv: &mut RecvStream, job: Option<u64>) -> Result<Control, String> {
    let (h, p) = read_frame(recv, MAX_CONTROL).await.map_err(|e| e.to_string())?;
    if h.kind != Kind::Control {
        return Err(format!("expected a control frame, got {:?}", h.kind));
    }
    if let Some(j) = job {
        if h.job != j {
            return Err(format!(
                "job id mismatch: frame for job {:#x}, this job is {j:#x}",
                h.job
            ));
        }
    }
    serde_json::from_slice(&p).map_err(|e| format!("malformed control message: {e}"))
}

/// The chunks of one data frame: the header, then the payload as its own buffer or buffers (no copy for
/// f32; an owned buffer's storage returns to `pool` once quinn is done with it).
pub(super) fn data_frame_chunks(job: u64, step: u64, seq: u64, m: Msg, pool: &Arc<BufferPool>) -> Vec<bytes::Bytes> {
    let h = Header::of_msg(job, step, seq, &m);
    let payload = match m.payload {
        Payload::F32(v) => vec![bytes::Bytes::from_owner(PooledLeF32::new(v, pool.clone()))],
        Payload::F32Le(p) => p.pieces,
        Payload::Bytes(v) | Payload::Compact { bytes: v, .. } => vec![bytes::Bytes::from(v)],
    };
    let mut hb = Vec::with_capacity(HEADER_LEN);
    h.encode(&mut hb);
    let mut chunks = Vec::with_capacity(1 + payload.len());
    chunks.push(bytes::Bytes::from(hb));
    chunks.extend(payload);
    chunks
}

pub(super) fn control_frame(job: u64, c: &Control) -> Vec<u8> {
    let payload = serde_json::to_vec(c).expect("control messages serialize");
    frame::encode_frame(Header::unsequenced(Kind::Control, job), &payload)
}

/// Abort notice: `chunk` = the rank blamed, `sub` = 1 when it is dead rather than aborting.
pub(super) fn abort_frame(job: u64, rank: usize, dead: bool, reason: &str) -> Vec<u8> {
    let mut r = reason.as_bytes();
    if r.len() > MAX_REASON {
        r = &r[..MAX_REASON];
    }
    let h = Header {
        chunk: rank as u32,
        sub: dead as u32,
        ..Header::unsequenced(Kind::Abort, job)
    };
    frame::encode_frame(h, r)
}

/// The error an abort notice from rank 0 reports.
pub(super) fn parse_abort(h: &Header, payload: &[u8]) -> CollectiveError {
    let reason = String::from_utf8_lossy(payload).into_owned();
    let rank = h.chunk as usize;
    if h.sub == 1 {
        CollectiveError::PeerDead { rank, reason }
    } else {
        CollectiveError::Aborted { rank, reason }
    }
}
