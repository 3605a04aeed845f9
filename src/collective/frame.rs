//! Wire format: versioned, bounded frames.
//!
//! A frame is a fixed 48-byte little-endian header followed by `len` payload bytes:
//!
//! | bytes  | field   | meaning                                                      |
//! |--------|---------|--------------------------------------------------------------|
//! | 0..4   | magic   | `b"RTRF"`                                                    |
//! | 4..6   | version | [`PROTOCOL_VERSION`]                                         |
//! | 6      | kind    | [`Kind`]                                                     |
//! | 7      | flags   | reserved, must be 0                                          |
//! | 8..16  | job     | job id (every frame of a job carries it)                     |
//! | 16..24 | step    | training step set by the trainer                             |
//! | 24..32 | seq     | collective sequence number, +1 per collective                |
//! | 32..36 | phase   | ring phase within the collective                             |
//! | 36..40 | chunk   | chunk index                                                  |
//! | 40..44 | sub     | sub-chunk index                                              |
//! | 44..48 | len     | payload length in bytes                                      |
//!
//! Decoding never trusts `len`: the caller passes the largest payload the protocol allows at that point, and
//! a larger `len` is rejected before anything is allocated. Truncated input, unknown kinds, bad magic,
//! versions or flags, and f32 payloads whose length is not a multiple of 4 are errors. [`SequenceGuard`]
//! rejects frames of another job, step or collective and duplicates within a collective. Nothing here panics
//! on any input (fuzzed by `fuzz/fuzz_targets/frame_decode.rs`, property-tested in `tests/frame.rs`).

use std::collections::HashSet;

use super::ring::{Msg, Payload};
use super::wire::Wire;

pub const MAGIC: [u8; 4] = *b"RTRF";
/// Version 2: ring welcomes carry certificate fingerprints, every endpoint presents a client certificate,
/// and a hello may carry the address the rank asks the others to dial. Version 3: hellos and welcomes carry
/// each rank's host identity and shared-memory endpoint, and a peer hello says whether the link's data goes
/// through shared memory. Version 4: hellos carry the host and `--collective`. Version 5: the elastic join's
/// `Admitted` message. Version 6: the compact data kinds [`Kind::Bf16`] and [`Kind::Int8`]. Version 7: an elastic
/// re-form's `Unformed` verdict.
pub const PROTOCOL_VERSION: u16 = 7;
pub const HEADER_LEN: usize = 48;
/// Hard ceiling on any payload, whatever the caller allows (64 MiB).
pub const ABSOLUTE_MAX_PAYLOAD: usize = 64 << 20;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Ring data, f32 little-endian payload.
    F32 = 1,
    /// Ring data, opaque bytes (gathers).
    Bytes = 2,
    /// Control message (rendezvous, peer hello), JSON payload.
    Control = 3,
    /// Authentication token, 32 bytes.
    Auth = 4,
    /// Abort notice, UTF-8 reason; `chunk` carries the failing rank.
    Abort = 5,
    /// Ring data of a reducing collective sent as bf16 (`--wire bf16`), little-endian.
    Bf16 = 6,
    /// Ring data of a reducing collective sent as blockwise-scaled int8 (`--wire int8`): the blocks'
    /// f32 scales, then one byte per value ([`crate::collective::wire`]).
    Int8 = 7,
}

impl Kind {
    /// The kind of a reducing collective's data frame sent in `wire`.
    pub fn of_wire(wire: Wire) -> Kind {
        match wire {
            Wire::F32 => Kind::F32,
            Wire::Bf16 => Kind::Bf16,
            Wire::Int8 => Kind::Int8,
        }
    }

    /// Whether frames of this kind carry ring data (sequenced, checked by [`SequenceGuard`]).
    pub fn is_ring_data(self) -> bool {
        matches!(self, Kind::F32 | Kind::Bytes | Kind::Bf16 | Kind::Int8)
    }

    pub fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::F32,
            2 => Kind::Bytes,
            3 => Kind::Control,
            4 => Kind::Auth,
            5 => Kind::Abort,
            6 => Kind::Bf16,
            7 => Kind::Int8,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    pub kind: Kind,
    pub job: u64,
    pub step: u64,
    pub seq: u64,
    pub phase: u32,
    pub chunk: u32,
    pub sub: u32,
    pub len: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("truncated frame: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("protocol version {got} not supported (this build speaks {PROTOCOL_VERSION})")]
    Version { got: u16 },
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("reserved flags {0:#x} set")]
    Flags(u8),
    #[error("payload of {len} bytes exceeds the {max} allowed here")]
    TooLong { len: usize, max: usize },
    #[error("f32 or bf16 payload of {0} bytes is not a whole number of values")]
    Misaligned(usize),
    #[error("{0} trailing bytes after the frame")]
    Trailing(usize),
    #[error("unexpected frame kind {got:?} (expected {want})")]
    WrongKind { got: Kind, want: &'static str },
    #[error("frame for job {got:#x}, this job is {want:#x}")]
    Job { got: u64, want: u64 },
    #[error("frame for step {got}, this rank is at step {want}")]
    Step { got: u64, want: u64 },
    #[error("out-of-sequence frame: collective #{got} while running #{want}")]
    OutOfSequence { got: u64, want: u64 },
    #[error("duplicate frame (collective #{seq}, phase {phase}, chunk {chunk}, sub {sub})")]
    Duplicate { seq: u64, phase: u32, chunk: u32, sub: u32 },
}

impl Header {
    /// The header of the data frame that carries ring message `msg` at collective `seq` of `step`.
    pub fn of_msg(job: u64, step: u64, seq: u64, msg: &Msg) -> Header {
        let (kind, len) = match &msg.payload {
            Payload::F32(v) => (Kind::F32, v.len() * 4),
            Payload::F32Le(p) => (Kind::F32, p.len_bytes()),
            Payload::Bytes(v) => (Kind::Bytes, v.len()),
            Payload::Compact { wire, bytes } => (Kind::of_wire(*wire), bytes.len()),
        };
        Header {
            kind,
            job,
            step,
            seq,
            phase: msg.phase,
            chunk: msg.chunk,
            sub: msg.sub,
            len: u32::try_from(len).expect("payload fits in u32"),
        }
    }

    /// The header of a frame outside the ring's sequence (authentication, control, abort): step, sequence
    /// and position are zero; [`encode_frame`] sets the length.
    pub fn unsequenced(kind: Kind, job: u64) -> Header {
        Header {
            kind,
            job,
            step: 0,
            seq: 0,
            phase: 0,
            chunk: 0,
            sub: 0,
            len: 0,
        }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out.push(self.kind as u8);
        out.push(0);
        out.extend_from_slice(&self.job.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.phase.to_le_bytes());
        out.extend_from_slice(&self.chunk.to_le_bytes());
        out.extend_from_slice(&self.sub.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }

    /// Decodes a header from the first [`HEADER_LEN`] bytes of `b`, rejecting payloads over `max_payload`.
    pub fn decode(b: &[u8], max_payload: usize) -> Result<Header, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Truncated {
                need: HEADER_LEN,
                have: b.len(),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != PROTOCOL_VERSION {
            return Err(FrameError::Version { got: version });
        }
        let kind = Kind::from_u8(b[6]).ok_or(FrameError::UnknownKind(b[6]))?;
        if b[7] != 0 {
            return Err(FrameError::Flags(b[7]));
        }
        let len = u32_at(44);
        let max = max_payload.min(ABSOLUTE_MAX_PAYLOAD);
        if len as usize > max {
            return Err(FrameError::TooLong { len: len as usize, max });
        }
        if (kind == Kind::F32 && len % 4 != 0) || (kind == Kind::Bf16 && len % 2 != 0) {
            return Err(FrameError::Misaligned(len as usize));
        }
        Ok(Header {
            kind,
            job: u64_at(8),
            step: u64_at(16),
            seq: u64_at(24),
            phase: u32_at(32),
            chunk: u32_at(36),
            sub: u32_at(40),
            len,
        })
    }
}

/// Encodes a header and payload into one buffer.
pub fn encode_frame(mut header: Header, payload: &[u8]) -> Vec<u8> {
    header.len = u32::try_from(payload.len()).expect("payload fits in u32");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    header.encode(&mut out);
    out.extend_from_slice(payload);
    out
}

/// Decodes exactly one frame occupying all of `b`.
pub fn decode_frame(b: &[u8], max_payload: usize) -> Result<(Header, &[u8]), FrameError> {
    let h = Header::decode(b, max_payload)?;
    let need = HEADER_LEN + h.len as usize;
    if b.len() < need {
        return Err(FrameError::Truncated { need, have: b.len() });
    }
    if b.len() > need {
        return Err(FrameError::Trailing(b.len() - need));
    }
    Ok((h, &b[HEADER_LEN..]))
}

/// Encodes a ring message as a data frame.
pub fn encode_msg(job: u64, step: u64, seq: u64, msg: &Msg) -> Vec<u8> {
    let h = Header::of_msg(job, step, seq, msg);
    let len = h.len as usize;
    let mut out = Vec::with_capacity(HEADER_LEN + len);
    h.encode(&mut out);
    match &msg.payload {
        Payload::F32(v) => {
            out.resize(HEADER_LEN + len, 0);
            // Compiles to a plain copy on little-endian targets.
            for (d, x) in out[HEADER_LEN..].chunks_exact_mut(4).zip(v) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        Payload::F32Le(p) => p.pieces.iter().for_each(|b| out.extend_from_slice(b)),
        Payload::Bytes(v) | Payload::Compact { bytes: v, .. } => out.extend_from_slice(v),
    }
    out
}

/// Turns a data frame back into a ring message.
pub fn decode_msg(h: &Header, payload: &[u8]) -> Result<Msg, FrameError> {
    if payload.len() != h.len as usize {
        return Err(FrameError::Truncated {
            need: h.len as usize,
            have: payload.len(),
        });
    }
    let payload = match h.kind {
        Kind::F32 => {
            if payload.len() % 4 != 0 {
                return Err(FrameError::Misaligned(payload.len()));
            }
            let mut v = vec![0f32; payload.len() / 4];
            for (d, c) in v.iter_mut().zip(payload.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            Payload::F32(v)
        }
        Kind::Bytes => Payload::Bytes(payload.to_vec()),
        // The engine checks the length against the values it expects.
        Kind::Bf16 => Payload::Compact {
            wire: Wire::Bf16,
            bytes: payload.to_vec(),
        },
        Kind::Int8 => Payload::Compact {
            wire: Wire::Int8,
            bytes: payload.to_vec(),
        },
        other => {
            return Err(FrameError::WrongKind {
                got: other,
                want: "ring data",
            })
        }
    };
    Ok(Msg {
        phase: h.phase,
        chunk: h.chunk,
        sub: h.sub,
        payload,
    })
}

/// Checks the data frames of one link against the job, step and collective being run.
#[derive(Debug)]
pub struct SequenceGuard {
    job: u64,
    step: u64,
    seq: u64,
    seen: HashSet<(u32, u32, u32)>,
}

impl SequenceGuard {
    pub fn new(job: u64) -> Self {
        SequenceGuard {
            job,
            step: 0,
            seq: 0,
            seen: HashSet::new(),
        }
    }

    /// Starts collective `seq` at training step `step`.
    pub fn begin(&mut self, seq: u64, step: u64) {
        self.seq = seq;
        self.step = step;
        self.seen.clear();
    }

    /// Accepts a data frame header or says why not.
    pub fn check(&mut self, h: &Header) -> Result<(), FrameError> {
        if !h.kind.is_ring_data() {
            return Err(FrameError::WrongKind {
                got: h.kind,
                want: "ring data",
            });
        }
        if h.job != self.job {
            return Err(FrameError::Job {
                got: h.job,
                want: self.job,
            });
        }
        if h.seq != self.seq {
            return Err(FrameError::OutOfSequence {
                got: h.seq,
                want: self.seq,
            });
        }
        if h.step != self.step {
            return Err(FrameError::Step {
                got: h.step,
                want: self.step,
            });
        }
        if !self.seen.insert((h.phase, h.chunk, h.sub)) {
            return Err(FrameError::Duplicate {
                seq: h.seq,
                phase: h.phase,
                chunk: h.chunk,
                sub: h.sub,
            });
        }
        Ok(())
    }
}
