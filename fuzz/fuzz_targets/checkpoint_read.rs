//! Feeds arbitrary bytes to the checkpoint loader as the three files of a checkpoint directory, in the order
//! `--resume` reads them: `config.json`, `model.safetensors`, then `trainer_state.safetensors` against the
//! model's layout. Input framing: the lengths of the first two files as two little-endian u32, then the three
//! files back to back (the last takes the rest). It must return an error or buffers that fit the model, never
//! panic or allocate for tensors the file does not hold. Run: `cd fuzz && cargo +nightly fuzz run
//! checkpoint_read`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringtrain::model::checkpoint::{load_model_bytes, load_trainer_state_bytes};
use ringtrain::model::ParamLayout;

/// Cuts `n` bytes off the front of `data`, or all of it when it holds fewer.
fn take<'a>(data: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (head, tail) = data.split_at(n.min(data.len()));
    *data = tail;
    head
}

fn length(data: &mut &[u8]) -> usize {
    let mut word = [0u8; 4];
    let head = take(data, 4);
    word[..head.len()].copy_from_slice(head);
    u32::from_le_bytes(word) as usize
}

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    let (config_len, model_len) = (length(&mut rest), length(&mut rest));
    let config = take(&mut rest, config_len);
    let model = take(&mut rest, model_len);
    let Ok((cfg, params)) = load_model_bytes(config, model) else {
        return;
    };
    let layout = ParamLayout::new(&cfg);
    assert_eq!(params.len(), layout.total);
    if let Ok(state) = load_trainer_state_bytes(rest, &layout) {
        assert_eq!((state.m.len(), state.v.len()), (layout.total, layout.total));
        assert!(state.world_size >= 1);
    }
});
