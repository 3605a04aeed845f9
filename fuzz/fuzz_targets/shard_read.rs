//! Feeds arbitrary bytes to the token shard reader as a whole `.bin` file, then does what training does with
//! it: checks the vocabulary and reads every window. It must return an error or tokens that fit the input,
//! never panic or allocate for a count the file does not hold. Run: `cd fuzz && cargo +nightly fuzz run
//! shard_read`.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use ringtrain::data::{Shard, TokenStream, GPT2_VOCAB_SIZE};

fuzz_target!(|data: &[u8]| {
    let Ok(shard) = Shard::from_bytes(Path::new("fuzz.bin"), data.to_vec()) else {
        return;
    };
    assert_eq!(1024 + 2 * shard.len(), data.len());
    let stream = TokenStream::from_shards("fuzz", vec![shard]);
    if stream.validate_vocab(GPT2_VOCAB_SIZE).is_err() {
        return;
    }
    let mut window = [0u32; 64];
    let mut start = 0;
    while start < stream.len() {
        let n = (stream.len() - start).min(window.len() as u64) as usize;
        stream.copy_range(start, &mut window[..n]).expect("a window in bounds");
        assert!(window[..n].iter().all(|&t| (t as usize) < GPT2_VOCAB_SIZE));
        start += n as u64;
    }
});
