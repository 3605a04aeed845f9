//! Data module: corrupt inputs give clear errors, the sampler keeps the data contract, the synthetic corpus
//! is pinned, and tokenizers match their references.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Instant;

use proptest::prelude::*;
use ringtrain::data::{
    eval_windows, fill_batch, load_splits, load_tokens, split_for_rank, synthetic, write_shard, Shard, Tokenizer,
    TokenizerKind, ValSource, WindowSampler,
};

/// blake3 of `synthetic::train_text()`. If this changes, every synthetic run changes: do it on purpose only.
const SYNTHETIC_TRAIN_BLAKE3: &str = "0c4d7967d66bcf8881c21c99fce38c38892eac48450d06faa7f1806760431fd3";
/// blake3 of `synthetic::val_text()`.
const SYNTHETIC_VAL_BLAKE3: &str = "d4802d475d1a4818b08b228b3aa096762941fd1d7bf5a2ad2ec7a31ffd27ad17";

fn spec(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes a shard with a hand-made header: (magic, version, count) and then `tokens` as u16.
fn raw_shard(path: &Path, magic: i32, version: i32, count: i32, tokens: &[u16]) {
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[magic, version, count]);
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

fn load_err(path: &Path) -> String {
    load_tokens(spec(path), TokenizerKind::Byte).unwrap_err().to_string()
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "expected {p:?} in error message: {msg}");
    }
}

// ---------------------------------------------------------------- corrupt inputs

#[test]
fn bad_magic_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.bin");
    raw_shard(&p, 12345, 1, 3, &[1, 2, 3]);
    assert_has(&load_err(&p), &["bad.bin", "magic is 12345", "expected 20240520"]);
}

#[test]
fn wrong_version_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("v2.bin");
    raw_shard(&p, 20240520, 2, 3, &[1, 2, 3]);
    assert_has(&load_err(&p), &["v2.bin", "version 2"]);
}

#[test]
fn truncated_header_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("short.bin");
    std::fs::write(&p, 20240520i32.to_le_bytes()).unwrap();
    assert_has(
        &load_err(&p),
        &["short.bin", "truncated", "4 bytes", "1024-byte header"],
    );
}

#[test]
fn count_larger_than_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("trunc.bin");
    // The header claims two billion tokens: must fail from the size check, not try to allocate 4 GB.
    raw_shard(&p, 20240520, 1, 2_000_000_000, &[1, 2, 3]);
    assert_has(
        &load_err(&p),
        &["trunc.bin", "truncated", "2000000000 tokens", "1030 bytes"],
    );
}

#[test]
fn trailing_bytes_are_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("long.bin");
    raw_shard(&p, 20240520, 1, 2, &[1, 2, 3]);
    assert_has(
        &load_err(&p),
        &["long.bin", "oversized", "2 tokens", "2 trailing bytes"],
    );
}

/// `Shard::from_bytes` (what the fuzzers drive) refuses every corrupt shard above with the same message as
/// opening the file.
#[test]
fn in_memory_shards_are_checked_like_files() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(i32, i32, i32, &[u16]); 6] = [
        (12345, 1, 3, &[1, 2, 3]),
        (20240520, 2, 3, &[1, 2, 3]),
        (20240520, 1, 2_000_000_000, &[1, 2, 3]),
        (20240520, 1, 2, &[1, 2, 3]),
        (20240520, 1, -5, &[]),
        (20240520, 1, 3, &[1, 2, 3]),
    ];
    for (i, (magic, version, count, tokens)) in cases.into_iter().enumerate() {
        let p = dir.path().join(format!("{i}.bin"));
        raw_shard(&p, magic, version, count, tokens);
        let bytes = std::fs::read(&p).unwrap();
        match (Shard::open(&p), Shard::from_bytes(&p, bytes)) {
            (Ok(file), Ok(memory)) => assert_eq!((file.len(), memory.len()), (3, 3)),
            (Err(file), Err(memory)) => assert_eq!(file.to_string(), memory.to_string()),
            (file, memory) => panic!("case {i}: the file gives {file:?}, the bytes {memory:?}"),
        }
    }
    for short in [&b""[..], &20240520i32.to_le_bytes()] {
        let err = Shard::from_bytes(Path::new("short.bin"), short.to_vec())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("short.bin") && (err.contains("empty") || err.contains("truncated")),
            "{err}"
        );
    }
}

#[test]
fn invalid_utf8_text_names_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("latin1.txt");
    std::fs::write(&p, b"caf\xe9 au lait").unwrap();
    assert_has(&load_err(&p), &["latin1.txt", "invalid UTF-8 at byte offset 3"]);
}

#[test]
fn empty_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("empty.txt");
    let b = dir.path().join("empty.bin");
    std::fs::write(&t, b"").unwrap();
    std::fs::write(&b, b"").unwrap();
    assert_has(&load_err(&t), &["empty.txt", "empty"]);
    assert_has(&load_err(&b), &["empty.bin", "empty"]);
    // A valid header with zero tokens is not a corpus either.
    let z = dir.path().join("zero.bin");
    write_shard(&z, &[]).unwrap();
    assert_has(&load_err(&z), &["zero.bin", "no tokens"]);
}

#[test]
fn token_outside_vocab_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("wide.bin");
    write_shard(&p, &[5, 255, 256, 7]).unwrap();
    let stream = load_tokens(spec(&p), TokenizerKind::Byte).unwrap();
    stream.validate_vocab(50257).unwrap();
    let err = stream.validate_vocab(256).unwrap_err().to_string();
    assert_has(&err, &["token 256 at position 2", "wide.bin", "vocabulary of 256"]);
}

#[test]
fn missing_paths_and_bad_flags_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert_has(
        &load_err(&dir.path().join("missing.txt")),
        &["missing.txt", "does not exist"],
    );
    assert_has(&load_err(dir.path()), &["no .bin shards"]);
    let err = "sentencepiece".parse::<TokenizerKind>().unwrap_err().to_string();
    assert_has(&err, &["sentencepiece", "byte", "gpt2"]);
}

// ---------------------------------------------------------------- corpora

#[test]
fn bin_roundtrip_dir_and_glob() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u32> = (0..1000).map(|i| (i * 37) % 50257).collect();
    let b: Vec<u32> = vec![50256, 0, 65535];
    // Written out of order: loading must sort by name.
    write_shard(&dir.path().join("s_001.bin"), &b).unwrap();
    write_shard(&dir.path().join("s_000.bin"), &a).unwrap();
    std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();

    let one = load_tokens(spec(&dir.path().join("s_000.bin")), TokenizerKind::Gpt2).unwrap();
    assert_eq!(one.to_vec(0, one.len()).unwrap(), a);

    let all: Vec<u32> = a.iter().chain(&b).copied().collect();
    let from_dir = load_tokens(spec(dir.path()), TokenizerKind::Byte).unwrap();
    assert_eq!(from_dir.to_vec(0, from_dir.len()).unwrap(), all);
    let pattern = format!("{}/s_*.bin", dir.path().display());
    let from_glob = load_tokens(&pattern, TokenizerKind::Byte).unwrap();
    assert_eq!(from_glob.to_vec(0, from_glob.len()).unwrap(), all);

    // Reads that cross the shard boundary.
    let mut buf = [0u32; 4];
    from_dir.copy_range(998, &mut buf).unwrap();
    assert_eq!(buf, [a[998], a[999], 50256, 0]);
    assert!(from_dir.copy_range(1000, &mut buf).is_err());
}

#[test]
fn train_val_shard_naming_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    write_shard(&dir.path().join("fw_train_000001.bin"), &[1, 2, 3, 4]).unwrap();
    write_shard(&dir.path().join("fw_train_000002.bin"), &[5, 6]).unwrap();
    write_shard(&dir.path().join("fw_val_000000.bin"), &[9, 9, 9]).unwrap();
    let s = load_splits(spec(dir.path()), None, TokenizerKind::Gpt2).unwrap();
    assert_eq!(s.train.to_vec(0, s.train.len()).unwrap(), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(s.val.as_ref().unwrap().len(), 3);
    assert_eq!(s.val_source, ValSource::ValShards);

    let other = tempfile::tempdir().unwrap();
    write_shard(&other.path().join("a.bin"), &[1, 2]).unwrap();
    let s = load_splits(spec(other.path()), None, TokenizerKind::Gpt2).unwrap();
    assert!(s.val.is_none());
    assert_eq!(s.val_source, ValSource::None);
    let s = load_splits(spec(other.path()), Some(spec(dir.path())), TokenizerKind::Gpt2).unwrap();
    assert_eq!(s.val.unwrap().len(), 9);
    assert_eq!(s.val_source, ValSource::Explicit);
}

#[test]
fn text_holds_out_last_five_percent() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.txt");
    let text: String = (0..1000).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    std::fs::write(&p, &text).unwrap();
    let s = load_splits(spec(&p), None, TokenizerKind::Byte).unwrap();
    assert_eq!(s.train.len(), 950);
    let val = s.val.unwrap();
    assert_eq!(val.len(), 50);
    assert_eq!(
        val.to_vec(0, 3).unwrap(),
        text.as_bytes()[950..953]
            .iter()
            .map(|&b| u32::from(b))
            .collect::<Vec<_>>()
    );
    assert_eq!(s.val_source, ValSource::HeldOut);

    let tiny = dir.path().join("tiny.txt");
    std::fs::write(&tiny, "short text").unwrap();
    let s = load_splits(spec(&tiny), None, TokenizerKind::Byte).unwrap();
    assert_eq!((s.train.len(), s.val.is_none()), (10, true));

    let s = load_splits(spec(&p), Some("synthetic"), TokenizerKind::Byte).unwrap();
    assert_eq!(s.train.len(), 1000);
    assert!(s.val.unwrap().len() > 100_000);
}

#[test]
fn gpt2_tokenizer_matches_r50k() {
    let tok = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
    assert_eq!(tok.encode("hello world"), vec![31373, 995]);
    assert_eq!(tok.decode(&[31373, 995]), "hello world");
    assert_eq!(tok.vocab_size(), 50257);
    assert_eq!(tok.eot(), Some(50256));
    // Literal special-token text stays ordinary text.
    assert!(!tok.encode("<|endoftext|>").contains(&50256));
}

#[test]
fn text_file_with_gpt2() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("hw.txt");
    std::fs::write(&p, "hello world").unwrap();
    let s = load_tokens(spec(&p), TokenizerKind::Gpt2).unwrap();
    assert_eq!(s.to_vec(0, 2).unwrap(), vec![31373, 995]);
    let s = load_tokens(spec(&p), TokenizerKind::Byte).unwrap();
    assert_eq!(s.len(), 11);
}

// ---------------------------------------------------------------- synthetic corpus

fn hex_blake3(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

#[test]
fn synthetic_corpus_is_pinned_and_fast() {
    let t0 = Instant::now();
    let train = synthetic::train_text();
    let val = synthetic::val_text();
    let elapsed = t0.elapsed();
    assert!(
        elapsed.as_secs_f64() < 1.0,
        "generating the synthetic corpus took {elapsed:?}"
    );
    assert!((1_000_000..=2_000_000).contains(&train.len()), "{}", train.len());
    assert!(train.is_ascii() && val.is_ascii());
    assert_eq!(hex_blake3(train.as_bytes()), SYNTHETIC_TRAIN_BLAKE3);
    assert_eq!(hex_blake3(val.as_bytes()), SYNTHETIC_VAL_BLAKE3);
    assert_eq!(synthetic::train_text(), train);
}

#[test]
fn synthetic_splits_for_both_tokenizers() {
    let byte = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    assert_eq!(byte.train.len() as usize, synthetic::train_text().len());
    assert_eq!(byte.val_source, ValSource::SyntheticVal);
    byte.train.validate_vocab(256).unwrap();
    assert_eq!(
        byte.train.to_vec(0, 9).unwrap(),
        b"Story 1.\n".iter().map(|&b| u32::from(b)).collect::<Vec<_>>()
    );

    let gpt2 = load_splits("synthetic", None, TokenizerKind::Gpt2).unwrap();
    gpt2.train.validate_vocab(50257).unwrap();
    gpt2.val.as_ref().unwrap().validate_vocab(50257).unwrap();
    // BPE merges whole words, so the stream is several times shorter than the bytes.
    assert!(gpt2.train.len() * 3 < byte.train.len());
    let tok = Tokenizer::new(TokenizerKind::Gpt2).unwrap();
    assert!(tok
        .decode(&gpt2.train.to_vec(0, 20).unwrap())
        .starts_with("Story 1.\nOnce upon a time"));
}

// ---------------------------------------------------------------- windows and sampler

#[test]
fn fill_batch_shifts_targets_by_one() {
    let stream = ringtrain::data::TokenStream::from_tokens("mem", &(0..100).collect::<Vec<u32>>()).unwrap();
    let t = 8;
    assert_eq!(stream.n_windows(t), 12); // (100 - 1) / 8
    let (mut x, mut y) = (vec![0u32; 2 * t], vec![0u32; 2 * t]);
    fill_batch(&stream, &[3, 11], t, &mut x, &mut y).unwrap();
    assert_eq!(&x[..t], &(24..32).collect::<Vec<u32>>()[..]);
    assert_eq!(&y[..t], &(25..33).collect::<Vec<u32>>()[..]);
    assert_eq!(&x[t..], &(88..96).collect::<Vec<u32>>()[..]);
    assert_eq!(&y[t..], &(89..97).collect::<Vec<u32>>()[..]);
    let err = fill_batch(&stream, &[12, 0], t, &mut x, &mut y)
        .unwrap_err()
        .to_string();
    assert_has(&err, &["window 12", "12 windows"]);
    assert!(fill_batch(&stream, &[0], t, &mut x, &mut y).is_err());
}

#[test]
fn shuffle_off_is_sequential() {
    let s = WindowSampler::new(20, 6, false, 123).unwrap();
    assert_eq!(s.steps_per_epoch(), 3);
    assert_eq!(s.windows_for_step(0), (0..6).collect::<Vec<u64>>());
    assert_eq!(s.windows_for_step(2), (12..18).collect::<Vec<u64>>());
    // Windows 18 and 19 are the dropped tail; step 3 starts epoch 1 again at window 0.
    assert_eq!(s.windows_for_step(3), (0..6).collect::<Vec<u64>>());
}

#[test]
fn shuffle_on_is_a_permutation_per_epoch() {
    let (n, g) = (103u64, 10usize);
    let s = WindowSampler::new(n, g, true, 42).unwrap();
    let spe = s.steps_per_epoch();
    assert_eq!(spe, 10);
    let mut epochs = Vec::new();
    for epoch in 0..3u64 {
        let mut seen = Vec::new();
        for k in 0..spe {
            let w = s.windows_for_step(epoch * spe + k);
            assert_eq!(w.len(), g);
            seen.extend(w);
        }
        let unique: BTreeSet<u64> = seen.iter().copied().collect();
        assert_eq!(unique.len(), seen.len(), "a window repeated within epoch {epoch}");
        assert!(unique.iter().all(|&w| w < n));
        // The full order is a permutation; only its 3-window tail is skipped.
        let full: BTreeSet<u64> = s.epoch_order(epoch).iter().copied().collect();
        assert_eq!(full, (0..n).collect());
        epochs.push(seen);
    }
    assert_ne!(epochs[0], epochs[1]);
    assert_ne!(epochs[1], epochs[2]);
    assert_ne!(epochs[0], (0..100).collect::<Vec<u64>>());
    // Same seed, same order (a fresh sampler has no cache); another seed, another order.
    let again = WindowSampler::new(n, g, true, 42).unwrap();
    assert_eq!(again.windows_for_step(13), s.windows_for_step(13));
    let other = WindowSampler::new(n, g, true, 43).unwrap();
    assert_ne!(other.windows_for_step(0), s.windows_for_step(0));
}

#[test]
fn shuffle_order_is_pinned() {
    // Portability guard: these indices must not change across platforms or dependency versions.
    let s = WindowSampler::new(1000, 8, true, 1234).unwrap();
    assert_eq!(s.windows_for_step(0), vec![405, 480, 301, 663, 902, 265, 130, 972]);
    assert_eq!(s.windows_for_step(125), vec![325, 260, 181, 637, 872, 612, 867, 535]);
    // epoch 1
}

#[test]
fn too_little_data_is_an_error() {
    let err = WindowSampler::for_tokens(1000, 64, 32, true, 0)
        .unwrap_err()
        .to_string();
    assert_has(&err, &["15 windows", "needs 32", "2049 tokens"]);
}

#[test]
fn eval_batches_are_the_first_windows() {
    assert_eq!(eval_windows(10, 2, 4), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(eval_windows(10, 5, 4).len(), 2);
    assert!(eval_windows(3, 5, 4).is_empty());
}

fn union_of_split(windows: &[u64], world: usize, batch: usize, accum: usize) -> Vec<u64> {
    let mut all = Vec::new();
    for rank in 0..world {
        let micro = split_for_rank(windows, rank, world, batch, accum).unwrap();
        assert_eq!(micro.len(), accum);
        for m in &micro {
            assert_eq!(m.len(), batch);
            all.extend(m);
        }
    }
    all.sort_unstable();
    all
}

proptest! {
    #[test]
    fn split_union_is_the_global_batch(g8 in 1usize..6, seed in any::<u64>(), step in 0u64..50) {
        let g = 8 * g8;
        let sampler = WindowSampler::new(500, g, true, seed).unwrap();
        let windows = sampler.windows_for_step(step);
        let mut expected = windows.clone();
        expected.sort_unstable();
        for world in [1usize, 2, 4] {
            for accum in [1usize, 2] {
                let batch = g / (world * accum);
                prop_assert_eq!(&union_of_split(&windows, world, batch, accum), &expected);
            }
        }
    }
}
