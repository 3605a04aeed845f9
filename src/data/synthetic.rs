//! The built-in `synthetic` corpus: deterministic, English-like ASCII stories with a learnable structure.
//!
//! It exists so that training, CI and the simulator work with no data download, and so that "the loss went
//! down" means something: a small byte-level model quickly learns the spelling, spacing and punctuation, a
//! larger one can go on to learn the longer-range rules below.
//!
//! # Structure
//!
//! The text is a sequence of stories. Story `n` (n = 1, 2, 3, … counting up) is:
//!
//! ```text
//! Story {n}.
//! Once upon a time, there was a {adjective} {animal} named {Name}.
//! {3 to 6 body sentences, one per line}
//! The end.
//! (blank line)
//! ```
//!
//! Each body sentence is one of five kinds, chosen uniformly:
//!
//! 1. action — `The {animal} {verb} the {colour} {object}.` (the story's animal, copied from line 2);
//! 2. mood — `{Name} is {mood} today.` (the story's name);
//! 3. sum — `{Name} has {a} {fruit} and finds {b} more, so now {Name} has {a+b} {fruit}.` with a, b in 1..=9;
//! 4. counting — `{Name} counts {k}, {k+1}, {k+2}, {k+3}.` with k in 1..=20;
//! 5. weather — `The sun is {warm|bright} and the sky is {blue|grey}.`
//!
//! Every slot is filled from a list of eight words (fruit and mood: four), so within a word the next byte is
//! nearly always determined by the first one or two letters: a byte bigram model is already below 2 nats per
//! byte, and the rules (copying names and animals, sums, counting up) reward context beyond that.
//!
//! # Determinism
//!
//! All choices come from the raw ChaCha8 stream (see `rng.rs`) with integer-only rejection sampling, so the
//! bytes are identical on every machine and for every `rand` version; a test pins the hash. Train and
//! validation texts use different seeds, so validation stories are new combinations of the same grammar.

use rand_chacha::ChaCha8Rng;

use super::rng::{keyed_rng, uniform_below};

/// Seed of the training text.
pub const TRAIN_SEED: u64 = 1;
/// Seed of the validation text.
pub const VAL_SEED: u64 = 2;
/// The training text is generated until it reaches this many bytes (it then ends after the current story).
pub const TRAIN_TARGET_BYTES: usize = 1_500_000;
/// Target size of the validation text.
pub const VAL_TARGET_BYTES: usize = 150_000;

const RNG_TAG: &[u8] = b"ringtrain/synth";

const ADJECTIVES: [&str; 8] = ["little", "big", "brave", "quiet", "clever", "gentle", "young", "proud"];
const ANIMALS: [&str; 8] = ["cat", "dog", "fox", "bird", "bear", "frog", "mouse", "rabbit"];
const NAMES: [&str; 8] = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry"];
const VERBS: [&str; 8] = [
    "sees", "finds", "likes", "chases", "carries", "wants", "paints", "hides",
];
const COLOURS: [&str; 8] = ["red", "blue", "green", "yellow", "small", "large", "shiny", "old"];
const OBJECTS: [&str; 8] = ["ball", "box", "hat", "book", "cup", "kite", "stone", "apple"];
const MOODS: [&str; 4] = ["happy", "tired", "hungry", "sleepy"];
const FRUITS: [&str; 4] = ["apples", "pears", "plums", "cherries"];

/// The training text of the `synthetic` corpus (about 1.5 MB).
pub fn train_text() -> String {
    generate(TRAIN_SEED, TRAIN_TARGET_BYTES)
}

/// The validation text of the `synthetic` corpus (about 150 KB, a different seed).
pub fn val_text() -> String {
    generate(VAL_SEED, VAL_TARGET_BYTES)
}

/// Generates whole stories until the text has at least `target_bytes` bytes.
pub fn generate(seed: u64, target_bytes: usize) -> String {
    let mut rng = keyed_rng(RNG_TAG, seed, 0);
    let mut out = String::with_capacity(target_bytes + 512);
    let mut story = 1u64;
    while out.len() < target_bytes {
        write_story(&mut rng, story, &mut out);
        story += 1;
    }
    out
}

fn pick<'a, const N: usize>(rng: &mut ChaCha8Rng, words: &[&'a str; N]) -> &'a str {
    words[uniform_below(rng, N as u64) as usize]
}

/// A uniform integer in `lo..=hi`.
fn between(rng: &mut ChaCha8Rng, lo: u64, hi: u64) -> u64 {
    lo + uniform_below(rng, hi - lo + 1)
}

fn write_story(rng: &mut ChaCha8Rng, n: u64, out: &mut String) {
    use std::fmt::Write;
    let adjective = pick(rng, &ADJECTIVES);
    let animal = pick(rng, &ANIMALS);
    let name = pick(rng, &NAMES);
    // Writing to a String cannot fail.
    let _ = writeln!(out, "Story {n}.");
    let _ = writeln!(out, "Once upon a time, there was a {adjective} {animal} named {name}.");
    for _ in 0..between(rng, 3, 6) {
        let _ = match uniform_below(rng, 5) {
            0 => {
                let (verb, colour, object) = (pick(rng, &VERBS), pick(rng, &COLOURS), pick(rng, &OBJECTS));
                writeln!(out, "The {animal} {verb} the {colour} {object}.")
            }
            1 => writeln!(out, "{name} is {} today.", pick(rng, &MOODS)),
            2 => {
                let (a, b, fruit) = (between(rng, 1, 9), between(rng, 1, 9), pick(rng, &FRUITS));
                writeln!(
                    out,
                    "{name} has {a} {fruit} and finds {b} more, so now {name} has {} {fruit}.",
                    a + b
                )
            }
            3 => {
                let k = between(rng, 1, 20);
                writeln!(out, "{name} counts {}, {}, {}, {}.", k, k + 1, k + 2, k + 3)
            }
            _ => {
                let sun = if uniform_below(rng, 2) == 0 { "warm" } else { "bright" };
                let sky = if uniform_below(rng, 2) == 0 { "blue" } else { "grey" };
                writeln!(out, "The sun is {sun} and the sky is {sky}.")
            }
        };
    }
    out.push_str("The end.\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Conditional entropy (nats/byte) of the next byte given the previous `k` bytes, from counts.
    fn ngram_entropy(text: &[u8], k: usize) -> f64 {
        let mut counts: std::collections::HashMap<&[u8], [u32; 256]> = std::collections::HashMap::new();
        for w in text.windows(k + 1) {
            counts.entry(&w[..k]).or_insert([0; 256])[w[k] as usize] += 1;
        }
        let total = (text.len() - k) as f64;
        let mut h = 0.0;
        for row in counts.values() {
            let n: u32 = row.iter().sum();
            for &c in row.iter().filter(|&&c| c > 0) {
                h -= c as f64 / total * (c as f64 / n as f64).ln();
            }
        }
        h
    }

    #[test]
    fn looks_like_the_documented_grammar() {
        let text = generate(7, 20_000);
        assert!(text.is_ascii());
        assert!(text.starts_with("Story 1.\nOnce upon a time, there was a "));
        assert!(text.contains("\nStory 2.\nOnce upon a time"));
        assert!(text.ends_with("The end.\n\n"));
        assert!(text.len() >= 20_000 && text.len() < 21_000);
        // Sums are right.
        for line in text.lines().filter(|l| l.contains(" more, so now ")) {
            let nums: Vec<u64> = line.split(' ').filter_map(|w| w.parse().ok()).collect();
            assert_eq!(nums.len(), 3, "{line}");
            assert_eq!(nums[0] + nums[1], nums[2], "{line}");
        }
    }

    #[test]
    fn train_and_val_differ_and_are_learnable() {
        let train = train_text();
        let val = val_text();
        assert!((TRAIN_TARGET_BYTES..TRAIN_TARGET_BYTES + 1000).contains(&train.len()));
        assert!((VAL_TARGET_BYTES..VAL_TARGET_BYTES + 1000).contains(&val.len()));
        assert_ne!(&train.as_bytes()[..1000], &val.as_bytes()[..1000]);
        let h0 = ngram_entropy(train.as_bytes(), 0);
        let h1 = ngram_entropy(train.as_bytes(), 1);
        let h3 = ngram_entropy(train.as_bytes(), 3);
        eprintln!("synthetic entropy nats/byte: unigram {h0:.3}, bigram {h1:.3}, 4-gram {h3:.3}");
        assert!(h1 < 2.0 && h3 < 1.0, "unigram {h0}, bigram {h1}, 4-gram {h3}");
    }
}
