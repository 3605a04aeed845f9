//! `ringtrain tokenize` end to end: shards hold exactly the reference tokenizer's tokens with a separator
//! before each document, split into validation and training shards that `train` picks up and trains on,
//! and bad inputs give an error naming the file and line while leaving no shard or temporary file behind.

use std::path::{Path, PathBuf};

use ringtrain::data::{load_splits, TokenizerKind, ValSource};

mod common;
use common::{fails_with_all as fails_with, ringtrain};

/// Runs a command that must succeed; returns stdout.
fn ok(args: &[&str]) -> String {
    let out = ringtrain(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ringtrain {args:?} failed:\n{stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The files in `dir` (none if it does not exist), sorted.
fn files_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Reads a shard without the library: checks the header words and the file size, returns the tokens.
fn read_shard(path: &Path) -> Vec<u32> {
    let bytes = std::fs::read(path).unwrap();
    let word = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(
        (word(0), word(1)),
        (20240520, 1),
        "{}: magic and version",
        path.display()
    );
    assert!(
        (3..256).all(|i| word(i) == 0),
        "{}: reserved header words",
        path.display()
    );
    let count = word(2) as usize;
    assert_eq!(
        bytes.len(),
        1024 + 2 * count,
        "{}: size against the header count",
        path.display()
    );
    bytes[1024..]
        .chunks_exact(2)
        .map(|p| u32::from(u16::from_le_bytes([p[0], p[1]])))
        .collect()
}

/// The shards of `dir` in stream order (val 000000, then train 000001, ...) with their tokens.
fn shards_in_order(dir: &Path, prefix: &str) -> Vec<(String, Vec<u32>)> {
    let mut names = files_in(dir);
    names.sort_by_key(|n| n.rsplit('_').next().unwrap().to_string());
    for (i, name) in names.iter().enumerate() {
        let split = if i == 0 { "val" } else { "train" };
        assert_eq!(name, &format!("{prefix}_{split}_{i:06}.bin"));
    }
    names
        .into_iter()
        .map(|n| {
            let tokens = read_shard(&dir.join(&n));
            (n, tokens)
        })
        .collect()
}

fn gpt2_reference(docs: &[&str]) -> Vec<u32> {
    let bpe = tiktoken_rs::r50k_base().unwrap();
    let mut tokens = Vec::new();
    for doc in docs {
        tokens.push(50256);
        tokens.extend(bpe.encode_ordinary(doc));
    }
    tokens
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog.\n\nIt's 3.14 o'clock — naïve café, 日本語 🙂\n  \
                    indented line\twith a tab\r\nand <|endoftext|> written as text.\n";

fn jsonl_docs() -> Vec<String> {
    (0..40)
        .map(|i| {
            format!(
                "Document {i}: \"quoted\" words, a newline\nand unicode é{}.",
                "ab ".repeat(i % 7)
            )
        })
        .collect()
}

fn write_jsonl(path: &Path, docs: &[String]) {
    let lines: Vec<String> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| serde_json::json!({"id": i, "meta": {"text": 1}, "text": d}).to_string())
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// Trains `tiny` (one layer) for 3 steps on `dir` and checks that every step logged a finite loss.
fn train_three_steps(dir: &Path, tokenizer: &str) {
    let metrics = dir.parent().unwrap().join(format!("{tokenizer}-metrics.jsonl"));
    let args = [
        "train",
        "--model",
        "tiny",
        "--n-layer",
        "1",
        "--data",
        s(dir),
        "--tokenizer",
        tokenizer,
        "--steps",
        "3",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--eval-every",
        "3",
        "--metrics",
        s(&metrics),
    ];
    ok(&args);
    let records = ringtrain::metrics::read_metrics(&metrics).unwrap();
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| r.loss.is_finite()));
}

#[test]
fn gpt2_shards_hold_the_reference_tokens_and_train() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("a.txt");
    std::fs::write(&text, TEXT).unwrap();
    let jsonl = dir.path().join("b.jsonl");
    let docs = jsonl_docs();
    write_jsonl(&jsonl, &docs);
    let out = dir.path().join("shards");
    let stdout = ok(&["tokenize", s(&text), s(&jsonl), "-o", s(&out)]);

    let mut all_docs = vec![TEXT];
    all_docs.extend(docs.iter().map(String::as_str));
    let want = gpt2_reference(&all_docs);
    let shards = shards_in_order(&out, "gpt2");
    assert_eq!(shards.len(), 2, "a small corpus gives one val and one train shard");
    let got: Vec<u32> = shards.iter().flat_map(|(_, t)| t.clone()).collect();
    assert_eq!(got, want);
    assert_eq!(shards[0].1.len(), want.len() / 10, "the first tenth is validation");
    assert!(
        stdout.contains(&format!("41 documents, {} tokens (gpt2) -> 2 shards", want.len())),
        "{stdout}"
    );

    let splits = load_splits(s(&out), None, TokenizerKind::Gpt2).unwrap();
    assert_eq!(splits.val_source, ValSource::ValShards);
    assert_eq!(splits.train.len() + splits.val.unwrap().len(), want.len() as u64);
    train_three_steps(&out, "gpt2");
}

#[test]
fn text_longer_than_a_chunk_encodes_like_the_whole_file() {
    // The synthetic corpus (about 1.5 MB) is read in several pieces; together they must encode like one call.
    let dir = tempfile::tempdir().unwrap();
    let corpus = ringtrain::data::synthetic::train_text() + "\nnaïve — 日本語 🙂  end  \n";
    assert!(corpus.len() > ringtrain::data::documents::TEXT_CHUNK_BYTES);
    let text = dir.path().join("big.txt");
    std::fs::write(&text, &corpus).unwrap();
    let out = dir.path().join("shards");
    ok(&["tokenize", s(&text), "-o", s(&out), "--shard-tokens", "100000"]);
    let shards = shards_in_order(&out, "gpt2");
    assert!(shards.len() > 3);
    assert!(shards[..shards.len() - 1].iter().all(|(_, t)| t.len() == 100_000));
    let got: Vec<u32> = shards.into_iter().flat_map(|(_, t)| t).collect();
    assert_eq!(got, gpt2_reference(&[&corpus]));
}

#[test]
fn byte_shards_use_the_separator_and_train() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("a.txt");
    let body = "Once upon a time, there was a byte. ".repeat(60);
    std::fs::write(&text, &body).unwrap();
    let jsonl = dir.path().join("b.JSONL");
    let docs = jsonl_docs();
    write_jsonl(&jsonl, &docs);
    let out = dir.path().join("shards");
    let stdout = ok(&[
        "tokenize",
        s(&jsonl),
        s(&text),
        "-o",
        s(&out),
        "--tokenizer",
        "byte",
        "--shard-tokens",
        "1000",
    ]);
    let mut want = Vec::new();
    for doc in docs.iter().map(String::as_str).chain([body.as_str()]) {
        want.push(0);
        want.extend(doc.bytes().map(u32::from));
    }
    let shards = shards_in_order(&out, "byte");
    assert_eq!(shards.len(), want.len().div_ceil(1000));
    assert!(shards[..shards.len() - 1].iter().all(|(_, t)| t.len() == 1000));
    let got: Vec<u32> = shards.into_iter().flat_map(|(_, t)| t).collect();
    assert_eq!(got, want);
    assert!(
        stdout.contains("41 documents") && stdout.contains("1 val (1000 tokens)"),
        "{stdout}"
    );
    train_three_steps(&out, "byte");
}

/// Runs `tokenize` on `inputs` that must fail with every needle in the message and leave `out` without
/// any file.
fn bad_input(inputs: &[&Path], extra: &[&str], needles: &[&str]) {
    let out = inputs[0].parent().unwrap().join("out");
    let mut args = vec!["tokenize"];
    args.extend(inputs.iter().map(|p| s(p)));
    args.extend(["-o", s(&out)]);
    args.extend(extra);
    fails_with(&args, needles);
    assert_eq!(
        files_in(&out),
        Vec::<String>::new(),
        "files left behind in {}",
        out.display()
    );
}

fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn invalid_utf8_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let txt = write(&dir, "bad.txt", b"line one\nline two\nthree \xff\xfe\nfour\n");
    bad_input(&[&txt], &[], &["bad.txt:3: invalid UTF-8 at byte offset 24"]);
    let jsonl = write(&dir, "bad.jsonl", b"{\"text\": \"ok\"}\n{\"text\": \"\xc3(\"}\n");
    bad_input(&[&jsonl], &[], &["bad.jsonl:2: invalid UTF-8"]);
}

#[test]
fn bad_jsonl_lines_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let not_json = write(&dir, "a.jsonl", b"{\"text\": \"ok\"}\n\n{\"text\": \"unterminated}\n");
    bad_input(&[&not_json], &[], &["a.jsonl:3: not valid JSON"]);
    let missing = write(&dir, "b.jsonl", b"{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n");
    bad_input(&[&missing], &[], &["b.jsonl:2: no \"text\" field"]);
    bad_input(&[&missing], &["--field", "body"], &["b.jsonl:1: no \"body\" field"]);
    let number = write(&dir, "c.jsonl", b"{\"text\": \"ok\"}\n{\"text\": 42}\n");
    bad_input(
        &[&number],
        &[],
        &["c.jsonl:2: field \"text\" is a number, not a string"],
    );
    let array = write(&dir, "d.jsonl", b"[\"text\"]\n");
    bad_input(&[&array], &[], &["d.jsonl:1: expected a JSON object, found an array"]);
}

#[test]
fn an_error_after_full_shards_removes_them() {
    // Many good lines fill several shards before line 301 fails; none of them may stay.
    let dir = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (0..300)
        .map(|i| format!("{{\"text\": \"document number {i}\"}}"))
        .collect();
    lines.push("{\"text\": null}".into());
    let jsonl = write(&dir, "late.jsonl", lines.join("\n").as_bytes());
    bad_input(
        &[&jsonl],
        &["--tokenizer", "byte", "--shard-tokens", "100"],
        &["late.jsonl:301: field \"text\" is null, not a string"],
    );
}

#[test]
fn missing_empty_and_directory_inputs_are_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(&dir, "good.txt", b"fine text");
    let missing = dir.path().join("missing.txt");
    bad_input(&[&good, &missing], &[], &["missing.txt", "No such file"]);
    let empty = write(&dir, "empty.jsonl", b"");
    bad_input(&[&good, &empty], &[], &["empty.jsonl: file is empty"]);
    bad_input(&[&good, dir.path()], &[], &["is a directory"]);
    let no_text = write(&dir, "blank.jsonl", b"{\"text\": \"\"}\n");
    bad_input(&[&no_text], &[], &["gave 1 token(s)", "at least 2"]);
    bad_input(&[&good], &["--tokenizer", "bpe"], &["unknown tokenizer \"bpe\""]);
    bad_input(&[&good], &["--shard-tokens", "0"], &["shard size 0"]);
}

#[test]
fn bad_output_folders_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(&dir, "in.txt", b"some text to tokenize");
    let file = write(&dir, "taken", b"a file");
    fails_with(
        &["tokenize", s(&input), "-o", s(&file)],
        &["taken exists and is not a directory"],
    );
    let under_file = file.join("sub");
    fails_with(&["tokenize", s(&input), "-o", s(&under_file)], &["taken/sub"]);
    assert_eq!(std::fs::read(&file).unwrap(), b"a file");

    // A folder that already holds shards is left alone.
    let out = dir.path().join("out");
    ok(&["tokenize", s(&input), "-o", s(&out), "--tokenizer", "byte"]);
    let before: Vec<Vec<u8>> = files_in(&out)
        .iter()
        .map(|n| std::fs::read(out.join(n)).unwrap())
        .collect();
    fails_with(
        &["tokenize", s(&input), "-o", s(&out)],
        &["already contains token shards (byte_train_000001.bin, byte_val_000000.bin)"],
    );
    let after: Vec<Vec<u8>> = files_in(&out)
        .iter()
        .map(|n| std::fs::read(out.join(n)).unwrap())
        .collect();
    assert_eq!(before, after);
}
