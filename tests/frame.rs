//! Frame decoding never panics or over-allocates, and rejects truncated, oversized, duplicated and
//! out-of-sequence frames.

use proptest::prelude::*;
use ringtrain::collective::frame::*;
use ringtrain::collective::ring::{Msg, Payload};
use ringtrain::collective::Wire;

fn data_header(seq: u64, phase: u32, chunk: u32, sub: u32) -> Header {
    Header {
        kind: Kind::F32,
        job: 42,
        step: 3,
        seq,
        phase,
        chunk,
        sub,
        len: 0,
    }
}

#[test]
fn round_trip() {
    let m = Msg {
        phase: 2,
        chunk: 1,
        sub: 7,
        payload: Payload::F32(vec![1.5, -0.0, f32::NAN, 3.0]),
    };
    let bytes = encode_msg(42, 3, 9, &m);
    assert_eq!(bytes.len(), HEADER_LEN + 16);
    let (h, p) = decode_frame(&bytes, 16).unwrap();
    assert_eq!((h.job, h.step, h.seq, h.len), (42, 3, 9, 16));
    let back = decode_msg(&h, p).unwrap();
    match (&back.payload, &m.payload) {
        (Payload::F32(a), Payload::F32(b)) => {
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            )
        }
        _ => panic!("kind changed"),
    }
    let b = Msg {
        phase: 0,
        chunk: 3,
        sub: 0,
        payload: Payload::Bytes(vec![9; 32]),
    };
    let bytes = encode_msg(1, 0, 0, &b);
    let (h, p) = decode_frame(&bytes, 32).unwrap();
    assert_eq!(decode_msg(&h, p).unwrap(), b);
    // Compact formats keep their bytes and their kind (the engine checks the length against its values).
    for (wire, kind) in [(Wire::Bf16, Kind::Bf16), (Wire::Int8, Kind::Int8)] {
        let c = Msg {
            phase: 1,
            chunk: 0,
            sub: 2,
            payload: Payload::Compact {
                wire,
                bytes: vec![7; 10],
            },
        };
        let bytes = encode_msg(5, 1, 2, &c);
        let (h, p) = decode_frame(&bytes, 10).unwrap();
        assert_eq!(h.kind, kind);
        assert_eq!(decode_msg(&h, p).unwrap(), c);
    }
}

#[test]
fn a_bf16_frame_holds_whole_values() {
    let mut frame = Vec::new();
    Header {
        kind: Kind::Bf16,
        len: 3,
        ..data_header(0, 0, 0, 0)
    }
    .encode(&mut frame);
    frame.extend_from_slice(&[0; 3]);
    assert_eq!(decode_frame(&frame, 64), Err(FrameError::Misaligned(3)));
}

#[test]
fn rejects_bad_frames() {
    let m = Msg {
        phase: 0,
        chunk: 0,
        sub: 0,
        payload: Payload::F32(vec![1.0; 8]),
    };
    let good = encode_msg(42, 3, 0, &m);
    // Oversized for what is expected here.
    assert!(matches!(
        decode_frame(&good, 31),
        Err(FrameError::TooLong { len: 32, max: 31 })
    ));
    // Truncated header and payload.
    assert!(matches!(
        decode_frame(&good[..10], 1 << 20),
        Err(FrameError::Truncated { .. })
    ));
    assert!(matches!(
        decode_frame(&good[..good.len() - 1], 1 << 20),
        Err(FrameError::Truncated { .. })
    ));
    // Trailing garbage.
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(decode_frame(&long, 1 << 20), Err(FrameError::Trailing(1))));
    // Header mutations.
    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(decode_frame(&b, 64), Err(FrameError::BadMagic(_))));
    let mut b = good.clone();
    b[4] = 99;
    assert!(matches!(decode_frame(&b, 64), Err(FrameError::Version { got: 99 })));
    let mut b = good.clone();
    b[6] = 200;
    assert!(matches!(decode_frame(&b, 64), Err(FrameError::UnknownKind(200))));
    let mut b = good.clone();
    b[7] = 1;
    assert!(matches!(decode_frame(&b, 64), Err(FrameError::Flags(1))));
    // A huge declared length is refused before allocation, whatever the caller allows.
    let mut b = good.clone();
    b[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Header::decode(&b, usize::MAX),
        Err(FrameError::TooLong { .. })
    ));
    // Misaligned f32 payload.
    let h = Header {
        kind: Kind::F32,
        job: 1,
        step: 0,
        seq: 0,
        phase: 0,
        chunk: 0,
        sub: 0,
        len: 0,
    };
    let b = encode_frame(h, &[1, 2, 3]);
    assert!(matches!(decode_frame(&b, 64), Err(FrameError::Misaligned(3))));
}

#[test]
fn sequence_guard() {
    let mut g = SequenceGuard::new(42);
    g.begin(5, 3);
    g.check(&data_header(5, 0, 1, 0)).unwrap();
    g.check(&data_header(5, 0, 1, 1)).unwrap();
    assert!(matches!(
        g.check(&data_header(5, 0, 1, 0)),
        Err(FrameError::Duplicate { .. })
    ));
    assert!(matches!(
        g.check(&data_header(6, 0, 1, 2)),
        Err(FrameError::OutOfSequence { got: 6, want: 5 })
    ));
    assert!(matches!(
        g.check(&data_header(4, 0, 1, 2)),
        Err(FrameError::OutOfSequence { got: 4, want: 5 })
    ));
    let mut other_job = data_header(5, 1, 0, 0);
    other_job.job = 43;
    assert!(matches!(g.check(&other_job), Err(FrameError::Job { .. })));
    let mut other_step = data_header(5, 1, 0, 0);
    other_step.step = 4;
    assert!(matches!(
        g.check(&other_step),
        Err(FrameError::Step { got: 4, want: 3 })
    ));
    let mut control = data_header(5, 1, 0, 0);
    control.kind = Kind::Control;
    assert!(matches!(g.check(&control), Err(FrameError::WrongKind { .. })));
    g.begin(6, 3);
    g.check(&data_header(6, 0, 1, 0)).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200), max in 0usize..1 << 20) {
        if let Ok((h, p)) = decode_frame(&bytes, max) {
            prop_assert!(h.len as usize <= max);
            prop_assert_eq!(p.len(), h.len as usize);
            let _ = decode_msg(&h, p);
        }
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        len in 0usize..40,
        pos in 0usize..HEADER_LEN + 160,
        val in any::<u8>(),
        cut in 0usize..HEADER_LEN + 161,
        max in 0usize..200,
    ) {
        let m = Msg { phase: 1, chunk: 2, sub: 3, payload: Payload::F32(vec![0.5; len]) };
        let mut b = encode_msg(7, 1, 2, &m);
        if pos < b.len() {
            b[pos] = val;
        }
        b.truncate(cut);
        if let Ok((h, p)) = decode_frame(&b, max) {
            prop_assert!(h.len as usize <= max);
            prop_assert_eq!(b.len(), HEADER_LEN + h.len as usize);
            let _ = decode_msg(&h, p);
        }
    }

    #[test]
    fn truncation_is_always_an_error(len in 0usize..64, cut_from_end in 1usize..64) {
        let m = Msg { phase: 0, chunk: 0, sub: 0, payload: Payload::Bytes(vec![1; len]) };
        let b = encode_msg(7, 1, 2, &m);
        let cut = b.len().saturating_sub(cut_from_end);
        let is_truncated = matches!(decode_frame(&b[..cut], 1 << 20), Err(FrameError::Truncated { .. }));
        prop_assert!(is_truncated);
    }
}
