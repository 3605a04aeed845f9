//! Feeds arbitrary bytes to the frame decoder: it must return an error or a frame within the bound, never
//! panic or allocate more than the bound. Run: `cd fuzz && cargo +nightly fuzz run frame_decode`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringtrain::collective::frame::{decode_frame, decode_msg, SequenceGuard};

fuzz_target!(|data: &[u8]| {
    // First two bytes choose the bound the protocol would pass at this point.
    if data.len() < 2 {
        return;
    }
    let max = u16::from_le_bytes([data[0], data[1]]) as usize;
    if let Ok((h, payload)) = decode_frame(&data[2..], max) {
        assert!(h.len as usize <= max);
        let _ = decode_msg(&h, payload);
        let mut g = SequenceGuard::new(h.job);
        g.begin(h.seq, h.step);
        let _ = g.check(&h);
        assert!(g.check(&h).is_err(), "a repeated frame must be refused");
    }
});
