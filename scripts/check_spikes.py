#!/usr/bin/env python3
"""Checks a ringtrain metrics file (--metrics, JSON Lines) for loss spikes and gradient-norm blow-ups.

usage:
    B=target/release/ringtrain
    $B train --model small --backend cpu --metrics /tmp/small.jsonl
    python3 scripts/check_spikes.py /tmp/small.jsonl [--max-ratio 1.2] [--max-norm-growth 2] [--until N]

A step fails when its loss exceeds the previous step's by more than --max-ratio (default 1.2: 20%), or its
gradient norm exceeds the largest norm of all the steps before it by more than --max-norm-growth (default
2). --until N checks only steps 1..N. It prints the worst ratio of each kind, every failing step with the
losses and norms around it, the last training loss and the last validation loss.

Reading the result: a real spike moves the gradient norm too (the old `small` default: loss 4.43 -> 6.97 at
step 4 with norm 2.4 -> 111). Late in a 200-step run at low loss, batches of 8 sequences differ by up to
about 30% on their own, with a flat gradient norm: the final `small` model, held fixed, already shows
consecutive batch losses up to 1.26 apart on steps 151..200 (scripts/batch_noise.py). So a late loss-ratio
failure with a quiet norm is batch noise.

Exits 0 when no checked step fails, 1 when one does, 2 on bad usage or an unreadable file. Needs no
third-party package.
"""
import argparse
import json
import sys


def read_metrics(path):
    """The step records in step order; a torn last line (a crash mid-write) is ignored."""
    rows = []
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not JSON: {e}") from None
    for row in rows:
        for key in ("step", "loss", "grad_norm"):
            if not isinstance(row.get(key), (int, float)):
                raise ValueError(f"{path}: step record without a numeric {key!r}: {row}")
    return sorted(rows, key=lambda r: r["step"])


def context(rows, i):
    lo, hi = max(0, i - 2), min(len(rows), i + 3)
    return " ".join(f"{r['step']}:{r['loss']:.3f}/{r['grad_norm']:.2f}" for r in rows[lo:hi])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics")
    parser.add_argument("--max-ratio", type=float, default=1.2)
    parser.add_argument("--max-norm-growth", type=float, default=2.0)
    parser.add_argument("--until", type=int, help="check only steps up to this one")
    args = parser.parse_args()
    try:
        rows = read_metrics(args.metrics)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(rows) < 2:
        print(f"error: {args.metrics} has {len(rows)} step record(s); need at least 2", file=sys.stderr)
        return 2

    failures = []
    worst_ratio, worst_growth = (0.0, 0), (0.0, 0)
    max_norm = rows[0]["grad_norm"]
    for i in range(1, len(rows)):
        prev, cur = rows[i - 1], rows[i]
        if args.until is not None and cur["step"] > args.until:
            break
        ratio = cur["loss"] / prev["loss"]
        growth = cur["grad_norm"] / max_norm if max_norm > 0 else float("inf")
        worst_ratio = max(worst_ratio, (ratio, cur["step"]))
        worst_growth = max(worst_growth, (growth, cur["step"]))
        if not ratio <= args.max_ratio:
            failures.append(f"step {cur['step']}: loss ratio {ratio:.3f}  [step:loss/norm {context(rows, i)}]")
        if not growth <= args.max_norm_growth:
            failures.append(f"step {cur['step']}: norm growth {growth:.2f}  [step:loss/norm {context(rows, i)}]")
        max_norm = max(max_norm, cur["grad_norm"])

    checked = f"steps 1..{args.until}" if args.until is not None else f"{len(rows)} steps"
    vals = [r["val_loss"] for r in rows if isinstance(r.get("val_loss"), (int, float))]
    print(f"{args.metrics}: {checked}; worst loss ratio {worst_ratio[0]:.3f} at step {worst_ratio[1]}, "
          f"worst norm growth {worst_growth[0]:.2f} at step {worst_growth[1]}; "
          f"last loss {rows[-1]['loss']:.4f}" + (f", last val loss {vals[-1]:.4f}" if vals else ""))
    for line in failures:
        print("FAIL " + line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
