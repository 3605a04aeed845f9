#!/usr/bin/env python3
"""Python tiktoken reference for `ringtrain tokenize` (bench/tokenize.sh).

Tokenizes the documents of a JSONL file with GPT-2's r50k_base using `encode_ordinary_batch` on N threads,
counting one end-of-text token per document as `ringtrain tokenize` writes it, and prints one JSON line:
impl, file_bytes, documents, tokens, seconds, mb_per_s (10^6 bytes), tokens_per_s, cpu_seconds (user +
system, including loading the ranks), peak_rss_mb, and `matches` when --expect-tokens is given (exit
status 1 on a mismatch).

Works offline: the ranks come from the r50k_base.tiktoken file that tiktoken-rs ships in its crate source
(found under ~/.cargo/registry unless --ranks is given) and are checked against OpenAI's published hash.
The time covers reading, JSON parsing and encoding; nothing is written.

usage: bench_tiktoken.py FILE.jsonl [--field text] [--threads 2] [--batch-docs 4096] [--expect-tokens N]
needs: pip install tiktoken
"""

import argparse
import glob
import json
import os
import resource
import sys
import time

# tiktoken's own r50k_base definition: pattern, special token and the hash of the ranks file.
R50K_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
ENDOFTEXT = "<|endoftext|>"
EOT = 50256


def find_ranks():
    pattern = os.path.expanduser("~/.cargo/registry/src/*/tiktoken-rs-*/assets/r50k_base.tiktoken")
    found = sorted(glob.glob(pattern))
    if not found:
        sys.exit(f"no r50k_base.tiktoken under {pattern}; pass --ranks (build ringtrain first: cargo fetches it)")
    return found[-1]


def r50k_base(ranks_path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(ranks_path, expected_hash=R50K_SHA256)
    return tiktoken.Encoding(
        name="r50k_base_local",
        pat_str=R50K_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: EOT},
        explicit_n_vocab=50257,
    )


def batches(path, field, batch_docs):
    """Yields lists of document texts, skipping blank lines like ringtrain does."""
    batch = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            batch.append(json.loads(line)[field])
            if len(batch) == batch_docs:
                yield batch
                batch = []
    if batch:
        yield batch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--field", default="text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-docs", type=int, default=4096)
    ap.add_argument("--ranks", help="path of r50k_base.tiktoken (default: tiktoken-rs's copy)")
    ap.add_argument("--expect-tokens", type=int, help="ringtrain's token count, separators included")
    args = ap.parse_args()

    enc = r50k_base(args.ranks or find_ranks())
    file_bytes = os.path.getsize(args.file)
    documents = tokens = 0
    start = time.perf_counter()
    for docs in batches(args.file, args.field, args.batch_docs):
        encoded = enc.encode_ordinary_batch(docs, num_threads=args.threads)
        documents += len(docs)
        tokens += len(docs) + sum(len(t) for t in encoded)
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {
        "impl": f"tiktoken {__import__('tiktoken').__version__} encode_ordinary_batch",
        "threads": args.threads,
        "file_bytes": file_bytes,
        "documents": documents,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "mb_per_s": round(file_bytes / seconds / 1e6, 2),
        "tokens_per_s": round(tokens / seconds),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
    }
    if args.expect_tokens is not None:
        report["expected_tokens"] = args.expect_tokens
        report["matches"] = tokens == args.expect_tokens
    print(json.dumps(report), flush=True)
    return 0 if report.get("matches", True) else 1


if __name__ == "__main__":
    sys.exit(main())
