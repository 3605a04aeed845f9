//! Bounded fuzzing, on the stable toolchain, of every reader of untrusted bytes: the frame decoder, the token
//! shard reader, the checkpoint reader (`config.json` + `model.safetensors` + `trainer_state.safetensors`) and
//! the TOML train config (`--config`).
//!
//! Each target starts from valid seed files and mutates them with a seeded RNG (bit flips, truncations,
//! deletions, insertions, splices between seeds, huge values written over length fields and over decimal
//! numbers, dictionary tokens, random bytes) for `RINGTRAIN_FUZZ_SECS` seconds (default 15). Every case must:
//! - not panic;
//! - when refused, give an error whose message is not empty;
//! - when accepted, give a result consistent with its input (sizes add up);
//! - never make one allocation larger than `factor * input + SLACK` bytes, measured by the counting
//!   allocator below while the reader runs. An allocation sized by an unchecked header field breaks it.
//!
//! `factor` is 1 where the reader only copies its input, 2 for checkpoints (BF16/F16 weights widen to
//! f32), and 32 for the TOML config: the `toml` crate's lexer reserves about 27 bytes of tokens per byte of
//! the file, whatever the file says (measured 27.4x from 2 KB to 100 KB). The JSON header of a safetensors
//! file also costs the `safetensors` crate a multiple of its own length when it is pathological (up to about
//! 20x for a shape array of 50 000 entries); mutations here add at most a few hundred bytes per case, so
//! that stays inside `SLACK`. Both costs follow the bytes present, never a length or count read from them.
//!
//! The mutator is hand-rolled rather than proptest: a time bound rather than a case count, mutations that
//! start from real files and know where their length fields are, and the case that failed saved in the
//! framing of the cargo-fuzz target of the same name (`fuzz/fuzz_targets/`), which runs the same entry
//! points for longer. `RINGTRAIN_FUZZ_SEED` changes the seed (the default is fixed so CI runs the same
//! cases every time).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain::collective::frame::{decode_frame, decode_msg, encode_msg, Header, Kind, SequenceGuard};
use ringtrain::collective::frame::{encode_frame, ABSOLUTE_MAX_PAYLOAD};
use ringtrain::collective::ring::{Msg, Payload};
use ringtrain::data::shard::shard_header;
use ringtrain::data::{Shard, TokenStream, GPT2_VOCAB_SIZE};
use ringtrain::model::checkpoint::{
    load_model_bytes, load_trainer_state_bytes, save_checkpoint, TrainerState, CONFIG_FILE, MODEL_FILE,
    TRAINER_STATE_FILE,
};
use ringtrain::model::{ModelConfig, ParamLayout};
use safetensors::{Dtype, SafeTensors};

/// The real `--config` parser lives in the binary crate; compiling its source here fuzzes that code itself.
#[allow(dead_code)]
#[path = "../src/cli/args.rs"]
mod args;

// ---------------------------------------------------------------------------------------------------------
// The counting allocator.

/// Forwards to the system allocator and, while armed, records the largest single request made by the armed
/// thread or by a rayon worker (the shard reader checks the vocabulary in parallel). Other tests of this
/// binary run on other threads and are not counted.
struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Const-initialised and without a destructor, so reading it never allocates.
    static ARMED_HERE: Cell<bool> = const { Cell::new(false) };
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn record(size: usize) {
    if ARMED.load(Ordering::Relaxed) && (ARMED_HERE.with(Cell::get) || rayon::current_thread_index().is_some()) {
        LARGEST.fetch_max(size, Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged, so `System`'s guarantees
// are ours; the bookkeeping only touches atomics and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` came from this allocator, i.e. from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// The allocator's record is global, so the targets (one test each) take turns, seeds built included.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `f` with the allocator armed; returns its result (or the panic) and the largest single allocation.
fn measured<R>(f: impl FnOnce() -> R) -> (std::thread::Result<R>, usize) {
    LARGEST.store(0, Ordering::SeqCst);
    ARMED_HERE.with(|a| a.set(true));
    ARMED.store(true, Ordering::SeqCst);
    let result = catch_unwind(AssertUnwindSafe(f));
    ARMED.store(false, Ordering::SeqCst);
    ARMED_HERE.with(|a| a.set(false));
    (result, LARGEST.load(Ordering::SeqCst))
}

// ---------------------------------------------------------------------------------------------------------
// The harness.

/// What one run of a reader said.
enum Outcome {
    Accepted,
    Refused(String),
    /// Accepted, but the result contradicts the input.
    Inconsistent(String),
}

/// Runs a reader on the files of one input.
type Reader = dyn Fn(&[Vec<u8>]) -> Outcome;

/// A reader under test. An input is one or more files (`parts`); the bound on any single allocation is
/// `factor * (total bytes) + SLACK`.
struct Target {
    name: &'static str,
    seeds: Vec<Vec<Vec<u8>>>,
    /// Byte strings worth inserting: keys, delimiters, numbers at the edges of the formats' ranges.
    dictionary: &'static [&'static str],
    factor: usize,
    run: Box<Reader>,
    /// The cargo-fuzz framing of an input, for the file saved when a case fails.
    frame: fn(&[Vec<u8>]) -> Vec<u8>,
}

/// Room for the fixed-size structures a reader builds whatever its input (a parsed header, a few names). The
/// seeds' own runs stay within a few hundred bytes of `factor * input`.
const SLACK: usize = 16 << 10;
/// Mutated inputs are cut to this length so that a case stays fast.
const MAX_INPUT: usize = 256 << 10;

fn fuzz_duration() -> Duration {
    let secs = std::env::var("RINGTRAIN_FUZZ_SECS")
        .ok()
        .map(|s| {
            s.parse::<f64>()
                .expect("RINGTRAIN_FUZZ_SECS must be a number of seconds")
        })
        .unwrap_or(15.0);
    Duration::from_secs_f64(secs)
}

fn fuzz_seed() -> u64 {
    std::env::var("RINGTRAIN_FUZZ_SEED")
        .ok()
        .map(|s| s.parse::<u64>().expect("RINGTRAIN_FUZZ_SEED must be an integer"))
        .unwrap_or(0x5EED_F022)
}

/// What a case showed: whether the input was accepted, and how far its largest allocation went past
/// `factor * input` (what the slack had to cover).
#[derive(Debug)]
struct Passed {
    accepted: bool,
    over: usize,
}

/// Checks one input; on failure saves it (cargo-fuzz framing) and returns what went wrong.
fn check(target: &Target, input: &[Vec<u8>], what: &str) -> Result<Passed, String> {
    let total: usize = input.iter().map(Vec::len).sum();
    let bound = target.factor * total + SLACK;
    let (result, largest) = measured(|| (target.run)(input));
    let over = largest.saturating_sub(target.factor * total);
    let failure = match result {
        Err(_) => "panicked".to_string(),
        Ok(_) if largest > bound => {
            format!("allocated {largest} bytes at once for {total} bytes of input (bound {bound})")
        }
        Ok(Outcome::Refused(msg)) if msg.trim().is_empty() => "refused it with an empty message".into(),
        Ok(Outcome::Inconsistent(why)) => format!("accepted it inconsistently: {why}"),
        Ok(Outcome::Accepted) => return Ok(Passed { accepted: true, over }),
        Ok(Outcome::Refused(_)) => return Ok(Passed { accepted: false, over }),
    };
    let saved = std::env::temp_dir().join(format!("ringtrain-fuzz-{}-{}.bin", target.name, std::process::id()));
    let _ = std::fs::write(&saved, (target.frame)(input));
    Err(format!(
        "{}: {what} {failure}; input saved to {} (replay: cd fuzz && cargo +nightly fuzz run {} {})",
        target.name,
        saved.display(),
        target.name,
        saved.display()
    ))
}

/// Every seed must be accepted (else the harness fuzzes nothing), then mutants run until the time is up.
fn fuzz(make_target: fn() -> Target) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let target = make_target();
    for (i, seed) in target.seeds.iter().enumerate() {
        match check(&target, seed, &format!("seed {i}")) {
            Ok(Passed { accepted: true, .. }) => {}
            Ok(Passed { accepted: false, .. }) => {
                panic!("{}: seed {i} is refused: {}", target.name, refusal(&target, seed))
            }
            Err(e) => panic!("{e}"),
        }
    }
    let seed = fuzz_seed();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ fnv(target.name));
    let (deadline, start) = (fuzz_duration(), Instant::now());
    let (mut cases, mut accepted, mut most_over) = (0u64, 0u64, 0usize);
    while start.elapsed() < deadline {
        let input = mutant(&target, &mut rng);
        match check(&target, &input, &format!("case {cases} (RINGTRAIN_FUZZ_SEED={seed})")) {
            Ok(passed) => {
                accepted += u64::from(passed.accepted);
                most_over = most_over.max(passed.over);
            }
            Err(e) => panic!("{e}"),
        }
        cases += 1;
    }
    println!(
        "{}: {cases} cases in {:.1} s, {accepted} accepted, {} refused with an error; largest allocation at \
         most {most_over} bytes over {}x the input (slack {SLACK})",
        target.name,
        start.elapsed().as_secs_f64(),
        cases - accepted,
        target.factor
    );
    assert!(cases > 0, "{}: no case ran", target.name);
}

fn refusal(target: &Target, input: &[Vec<u8>]) -> String {
    match (target.run)(input) {
        Outcome::Refused(msg) | Outcome::Inconsistent(msg) => msg,
        Outcome::Accepted => "accepted".into(),
    }
}

/// FNV-1a, so that each target draws its own stream from the one seed.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

// ---------------------------------------------------------------------------------------------------------
// The mutator.

/// Values at the edges of length and count fields.
fn interesting(rng: &mut ChaCha8Rng, len: usize) -> u64 {
    const FIXED: [u64; 16] = [
        0,
        1,
        2,
        3,
        0x7f,
        0xff,
        0x7fff,
        0xffff,
        0x7fff_ffff,
        0x8000_0000,
        0xffff_ffff,
        1 << 32,
        ABSOLUTE_MAX_PAYLOAD as u64,
        100_000_000,
        i64::MAX as u64,
        u64::MAX,
    ];
    match rng.random_range(0..4) {
        0 => (len as u64).wrapping_add(rng.random_range(0..16)).wrapping_sub(8),
        1 => rng.random(),
        _ => FIXED[rng.random_range(0..FIXED.len())],
    }
}

fn mutant(target: &Target, rng: &mut ChaCha8Rng) -> Vec<Vec<u8>> {
    let mut input = target.seeds[rng.random_range(0..target.seeds.len())].clone();
    let mutations = 1 + rng.random_range(0..4);
    for _ in 0..mutations {
        let part = rng.random_range(0..input.len());
        let donor = {
            let other = &target.seeds[rng.random_range(0..target.seeds.len())];
            other[part.min(other.len() - 1)].clone()
        };
        mutate(&mut input[part], &donor, target.dictionary, rng);
        input[part].truncate(MAX_INPUT);
    }
    input
}

fn mutate(bytes: &mut Vec<u8>, donor: &[u8], dictionary: &[&str], rng: &mut ChaCha8Rng) {
    let len = bytes.len();
    let pos = |rng: &mut ChaCha8Rng| if len == 0 { 0 } else { rng.random_range(0..len) };
    // Formats put their length fields up front; aim there half the time.
    let field_pos = |rng: &mut ChaCha8Rng| {
        if rng.random_bool(0.5) {
            rng.random_range(0..16usize) * 4
        } else {
            pos(rng)
        }
    };
    match rng.random_range(0..11) {
        0 if len > 0 => {
            let p = pos(rng);
            bytes[p] ^= 1 << rng.random_range(0..8);
        }
        1 if len > 0 => {
            let p = pos(rng);
            bytes[p] = [0, 0xff, 0x7f, 0x80, b'"', b'{', b'[', b'\\', b'=', b'\n'][rng.random_range(0..10)];
        }
        2 => bytes.truncate(pos(rng)),
        3 if len > 0 => {
            let (a, n) = (pos(rng), 1 + rng.random_range(0..64));
            bytes.drain(a..(a + n).min(len));
        }
        4 => {
            let p = pos(rng);
            let extra: Vec<u8> = (0..1 + rng.random_range(0..32)).map(|_| rng.random()).collect();
            bytes.splice(p..p, extra);
        }
        5 => {
            let value = interesting(rng, len);
            let width = [2usize, 4, 8][rng.random_range(0..3)];
            let p = field_pos(rng);
            if p + width <= len {
                bytes[p..p + width].copy_from_slice(&value.to_le_bytes()[..width]);
            }
        }
        6 if !donor.is_empty() => {
            let a = rng.random_range(0..donor.len());
            let b = a + rng.random_range(0..(donor.len() - a).min(512) + 1);
            let (p, q) = (pos(rng), pos(rng));
            let (p, q) = (p.min(q), p.max(q).min(p + 64));
            bytes.splice(p..q, donor[a..b].iter().copied());
        }
        7 => replace_number(bytes, rng),
        8 if !dictionary.is_empty() => {
            let token = dictionary[rng.random_range(0..dictionary.len())].as_bytes();
            let p = pos(rng);
            let q = if rng.random_bool(0.5) {
                p
            } else {
                (p + token.len()).min(len)
            };
            bytes.splice(p..q, token.iter().copied());
        }
        9 if len > 0 => {
            let (a, n) = (pos(rng), 1 + rng.random_range(0..256));
            let copy = bytes[a..(a + n).min(len)].to_vec();
            let p = pos(rng);
            bytes.splice(p..p, copy);
        }
        10 if rng.random_bool(0.1) => {
            *bytes = (0..rng.random_range(0..4096)).map(|_| rng.random()).collect();
        }
        _ => {}
    }
}

/// Rewrites one decimal number of a text (a JSON or TOML value, a safetensors offset or shape) as a number
/// at the edge of a range.
fn replace_number(bytes: &mut Vec<u8>, rng: &mut ChaCha8Rng) {
    let starts: Vec<usize> = (0..bytes.len())
        .filter(|&i| bytes[i].is_ascii_digit() && (i == 0 || !bytes[i - 1].is_ascii_digit()))
        .collect();
    if starts.is_empty() {
        return;
    }
    let a = starts[rng.random_range(0..starts.len())];
    let b = a + bytes[a..].iter().take_while(|c| c.is_ascii_digit()).count();
    let text = match rng.random_range(0..4) {
        0 => "18446744073709551616".to_string(),
        1 => "0".to_string(),
        _ => interesting(rng, bytes.len()).to_string(),
    };
    bytes.splice(a..b, text.into_bytes());
}

// ---------------------------------------------------------------------------------------------------------
// Frame decoder.

fn frame_target() -> Target {
    let f32_msg = Msg {
        phase: 1,
        chunk: 2,
        sub: 3,
        payload: Payload::F32(vec![1.5, -0.0, f32::NAN, 7.0]),
    };
    let bytes_msg = Msg {
        phase: 0,
        chunk: 1,
        sub: 0,
        payload: Payload::Bytes(b"gathered bytes".to_vec()),
    };
    let control = Header::unsequenced(Kind::Control, 9);
    let seeds = vec![
        vec![encode_msg(42, 3, 9, &f32_msg)],
        vec![encode_msg(42, 3, 10, &bytes_msg)],
        vec![encode_msg(
            1,
            0,
            0,
            &Msg {
                payload: Payload::F32(Vec::new()),
                ..f32_msg.clone()
            },
        )],
        vec![encode_frame(control, br#"{"hello":1}"#)],
        vec![encode_msg(
            42,
            3,
            11,
            &Msg {
                payload: Payload::Compact {
                    wire: ringtrain::collective::Wire::Int8,
                    bytes: vec![0, 0, 128, 63, 1, 255],
                },
                ..f32_msg.clone()
            },
        )],
    ];
    Target {
        name: "frame_decode",
        seeds,
        dictionary: &["RTRF", "\u{1}\u{0}"],
        factor: 1,
        run: Box::new(|input| frame_case(&input[0])),
        frame: |input| {
            // The cargo-fuzz target reads the payload bound from its first two bytes.
            let mut out = u16::MAX.to_le_bytes().to_vec();
            out.extend_from_slice(&input[0]);
            out
        },
    }
}

/// What a link does with a received frame: decode it under the largest bound the protocol ever passes, then
/// a data frame into a ring message checked against the expected sequence.
fn frame_case(bytes: &[u8]) -> Outcome {
    let (h, payload) = match decode_frame(bytes, ABSOLUTE_MAX_PAYLOAD) {
        Ok(frame) => frame,
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    if payload.len() != h.len as usize {
        return Outcome::Inconsistent(format!("payload of {} bytes, header says {}", payload.len(), h.len));
    }
    let mut guard = SequenceGuard::new(h.job);
    guard.begin(h.seq, h.step);
    if h.kind.is_ring_data() {
        if let Err(e) = decode_msg(&h, payload) {
            return Outcome::Refused(e.to_string());
        }
        if let Err(e) = guard.check(&h) {
            return Outcome::Refused(e.to_string());
        }
        if guard.check(&h).is_ok() {
            return Outcome::Inconsistent("a repeated frame was accepted".into());
        }
        return Outcome::Accepted;
    }
    // A control frame is not a ring message; the decoder must say so.
    match decode_msg(&h, payload) {
        Ok(_) => Outcome::Inconsistent(format!("a {:?} frame decoded as a ring message", h.kind)),
        Err(_) => Outcome::Accepted,
    }
}

#[test]
fn frame_decoder_survives_mutated_frames() {
    fuzz(frame_target);
}

// ---------------------------------------------------------------------------------------------------------
// Token shards.

fn shard_bytes(count: i32, tokens: &[u16]) -> Vec<u8> {
    let mut out = shard_header(count).to_vec();
    out.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    out
}

fn shard_target() -> Target {
    let tokens: Vec<u16> = (0..300u16).map(|i| i.wrapping_mul(167) % 50257).collect();
    let seeds = vec![
        vec![shard_bytes(0, &[])],
        vec![shard_bytes(1, &[50256])],
        vec![shard_bytes(300, &tokens)],
    ];
    Target {
        name: "shard_read",
        seeds,
        dictionary: &[],
        factor: 1,
        run: Box::new(|input| shard_case(&input[0])),
        frame: |input| input[0].clone(),
    }
}

/// What a training run does with a shard: open it, check the vocabulary, read every window.
fn shard_case(bytes: &[u8]) -> Outcome {
    let shard = match Shard::from_bytes(Path::new("fuzz.bin"), bytes.to_vec()) {
        Ok(s) => s,
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    if 1024 + 2 * shard.len() != bytes.len() {
        return Outcome::Inconsistent(format!("{} tokens in {} bytes", shard.len(), bytes.len()));
    }
    let stream = TokenStream::from_shards("fuzz", vec![shard]);
    if let Err(e) = stream.validate_vocab(GPT2_VOCAB_SIZE) {
        return Outcome::Refused(e.to_string());
    }
    let mut window = [0u32; 64];
    let mut start = 0;
    while start < stream.len() {
        let n = (stream.len() - start).min(window.len() as u64) as usize;
        if let Err(e) = stream.copy_range(start, &mut window[..n]) {
            return Outcome::Inconsistent(format!("reading a window in bounds: {e}"));
        }
        if window[..n].iter().any(|&t| t as usize >= GPT2_VOCAB_SIZE) {
            return Outcome::Inconsistent("a token outside the vocabulary passed validation".into());
        }
        start += n as u64;
    }
    Outcome::Accepted
}

#[test]
fn shard_reader_survives_mutated_shards() {
    fuzz(shard_target);
}

// ---------------------------------------------------------------------------------------------------------
// Checkpoints.

/// A GPT-2 small enough that a checkpoint is a few kilobytes.
fn micro_config() -> ModelConfig {
    ModelConfig {
        n_layer: 1,
        n_embd: 4,
        n_head: 2,
        vocab_size: 8,
        n_positions: 4,
    }
}

/// Values exactly representable in bfloat16, so the BF16 seed is the same model.
fn micro_params(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect()
}

/// The F32 checkpoint we write, then a Hugging Face-style variant of its model file: BF16, no key prefix,
/// a stored copy of the tied head and an old attention-mask buffer.
fn checkpoint_seeds() -> Vec<Vec<Vec<u8>>> {
    let cfg = micro_config();
    let layout = ParamLayout::new(&cfg);
    let params = micro_params(layout.total);
    let state = TrainerState {
        step: 3,
        tokens_seen: 96,
        data_cursor: 12,
        world_size: 2,
        config_hash: cfg.hash_hex(),
        seed: 7,
        m: micro_params(layout.total),
        v: micro_params(layout.total).iter().map(|x| x * x).collect(),
        extra: [("args".to_string(), "{}".to_string())].into(),
        sync: [("outer_momentum".to_string(), vec![0.5, -1.0, 2.0])].into(),
    };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    save_checkpoint(&ckpt, &cfg, &layout, &params, Some(&state)).unwrap();
    let read = |name: &str| std::fs::read(ckpt.join(name)).unwrap();
    let (config, model, trainer) = (read(CONFIG_FILE), read(MODEL_FILE), read(TRAINER_STATE_FILE));
    let hf_model = bf16_hf_variant(&model);
    vec![
        vec![config.clone(), model, trainer.clone()],
        vec![config, hf_model, trainer],
    ]
}

fn bf16_hf_variant(model: &[u8]) -> Vec<u8> {
    let st = SafeTensors::deserialize(model).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (key, view) in st.iter() {
        let bf16: Vec<u8> = view.data().chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        let name = key.strip_prefix("transformer.").unwrap().to_string();
        if name == "wte.weight" {
            tensors.push((
                "lm_head.weight".into(),
                Dtype::BF16,
                view.shape().to_vec(),
                bf16.clone(),
            ));
        }
        tensors.push((name, Dtype::BF16, view.shape().to_vec(), bf16));
    }
    tensors.push(("h.0.attn.bias".into(), Dtype::F32, vec![1], 1f32.to_le_bytes().to_vec()));
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, d, s, b)| {
            (
                k.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// What `--resume` does: the model files, then the trainer state against the model's layout.
fn checkpoint_case(input: &[Vec<u8>]) -> Outcome {
    let (cfg, params) = match load_model_bytes(&input[0], &input[1]) {
        Ok(loaded) => loaded,
        Err(e) => return Outcome::Refused(format!("{e:#}")),
    };
    let layout = ParamLayout::new(&cfg);
    if params.len() != layout.total {
        return Outcome::Inconsistent(format!("{} parameters for a layout of {}", params.len(), layout.total));
    }
    let state = match load_trainer_state_bytes(&input[2], &layout) {
        Ok(state) => state,
        Err(e) => return Outcome::Refused(format!("{e:#}")),
    };
    if state.m.len() != layout.total || state.v.len() != layout.total || state.world_size == 0 {
        return Outcome::Inconsistent("trainer state does not fit the layout".into());
    }
    Outcome::Accepted
}

/// The cargo-fuzz `checkpoint_read` framing: two u32 lengths (config, model), then the three files.
fn checkpoint_frame(input: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(input[0].len() as u32).to_le_bytes());
    out.extend_from_slice(&(input[1].len() as u32).to_le_bytes());
    input.iter().for_each(|p| out.extend_from_slice(p));
    out
}

fn checkpoint_target() -> Target {
    Target {
        name: "checkpoint_read",
        seeds: checkpoint_seeds(),
        dictionary: &[
            "\"n_layer\":1024,",
            "\"vocab_size\":1048576,",
            "\"n_embd\":65536,",
            "\"n_head\":0,",
            "null",
            "1e400",
            "-1",
            "\"F16\"",
            "\"BF16\"",
            "\"I64\"",
            "\"BOOL\"",
            "\"F8_E4M3\"",
            "\"data_offsets\":[0,4294967296]",
            "\"shape\":[4294967296,4294967296]",
            "\"shape\":[]",
            "\"__metadata__\":{}",
            "\"ringtrain.version\":\"2\"",
            "\"world_size\":\"0\"",
            "\"step\":\"-1\"",
            "transformer.",
            "exp_avg_sq.",
            "lm_head.weight",
            "h.0.attn.bias",
            "h.99999999999999999999.attn.bias",
            "\\ud800",
            "{",
            "}",
            "[",
            ",",
        ],
        // A BF16 or F16 model file widens to f32: the parameters take twice the bytes of their tensors.
        factor: 2,
        run: Box::new(checkpoint_case),
        frame: checkpoint_frame,
    }
}

#[test]
fn checkpoint_reader_survives_mutated_checkpoints() {
    fuzz(checkpoint_target);
}

// ---------------------------------------------------------------------------------------------------------
// TOML train config.

const TOML_SEED: &str = r#"# a complete config
model = "tiny"
n-layer = 2
n-embd = 64
n-head = 4
vocab-size = 256
n-positions = 64
data = "synthetic"
tokenizer = "byte"
backend = "cpu"
batch-size = 4
seq-len = 32
grad-accum = 2
steps = 100
lr = 3e-3
lr-schedule = "cosine"
warmup = 10
min-lr = 3e-4
lr-scaling = "sqrt"
base-batch = 8
weight-decay = 0.1
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
grad-clip = 1.0
seed = 1234
shuffle = "on"
update = "sharded"
verify-every = 10
on-divergence = "abort"
on-nonfinite = "skip"
bucket-mb = 25.0
overlap = "on"
save-every = 50
eval-every = 20
eval-batches = 4
timeout = 30.5
"#;

fn config_target() -> Target {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.toml");
    let file = RefCell::new(File::create(&path).unwrap());
    Target {
        name: "config_read",
        seeds: vec![
            vec![TOML_SEED.as_bytes().to_vec()],
            vec![b"model = \"gpt2\"\nsteps = 1\n".to_vec()],
        ],
        dictionary: &[
            "n-layer = 1024\n",
            "vocab-size = 99999999999999999999\n",
            "batch-size = 0\n",
            "lr = nan\n",
            "lr = inf\n",
            "lr = -1e308\n",
            "bucket-mb = 1e308\n",
            "steps = 18446744073709551615\n",
            "world-size = 0\n",
            "master-port = 65536\n",
            "[table]\n",
            "[[array]]\n",
            "a.b.c = 1\n",
            "unknown-key = 1\n",
            "model = [1, 2]\n",
            "\"\"\"",
            "'''",
            "1979-05-27T07:32:00Z",
            "\\u0000",
            "\\U0010FFFF",
            "=",
            "#",
            "\"",
        ],
        // The toml lexer reserves about 27 bytes per byte of the file (see the module comment).
        factor: 32,
        run: Box::new(move |input| {
            let _keep = &dir;
            config_case(&path, &mut file.borrow_mut(), &input[0])
        }),
        frame: |input| input[0].clone(),
    }
}

/// What `ringtrain train --config FILE` does with the file before any training starts. The file is
/// rewritten in place: truncating it on open costs milliseconds on some file systems.
fn config_case(path: &Path, file: &mut File, bytes: &[u8]) -> Outcome {
    file.seek(SeekFrom::Start(0)).unwrap();
    file.write_all(bytes).unwrap();
    file.set_len(bytes.len() as u64).unwrap();
    let flags = args::TrainArgs {
        config: Some(path.to_path_buf()),
        ..Default::default()
    };
    let resolved = flags.merged_with_file().and_then(|a| {
        let model = a.model_config()?;
        a.resolve(&model, 1).map(|_| ())
    });
    match resolved {
        Ok(()) => Outcome::Accepted,
        Err(e) => Outcome::Refused(format!("{e:#}")),
    }
}

#[test]
fn train_config_survives_mutated_toml() {
    fuzz(config_target);
}

/// The harness itself: a reader that trusts a header length is caught, so the bound is not vacuous.
#[test]
fn an_allocation_sized_by_the_input_is_caught() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let trusting = Target {
        name: "trusting",
        seeds: vec![vec![vec![0; 16]]],
        dictionary: &[],
        factor: 1,
        run: Box::new(|input| {
            let claimed = u32::from_le_bytes(input[0][..4].try_into().unwrap()) as usize;
            let buf: Vec<u8> = Vec::with_capacity(claimed);
            std::hint::black_box(&buf);
            Outcome::Accepted
        }),
        frame: |input| input[0].clone(),
    };
    assert!(check(&trusting, &[vec![0; 16]], "small").is_ok());
    let mut huge = vec![0u8; 16];
    huge[..4].copy_from_slice(&(8u32 << 20).to_le_bytes());
    let err = check(&trusting, &[huge], "huge").unwrap_err();
    assert!(err.contains("allocated 8388608 bytes"), "{err}");
}
