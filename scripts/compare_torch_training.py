#!/usr/bin/env python3
"""Trains ringtrain's model in PyTorch from the same initial weights on the same batches, step by step, and
compares the loss and gradient norm of every step with a ringtrain metrics file.

It answers "is this loss curve ringtrain's numerics or the optimisation itself?": when PyTorch, started from
the very same weights, sees the same batches and uses the same optimizer, the per-step losses agree with
ringtrain's until chaotic divergence sets in, and a spike that PyTorch shows too is the hyper-parameters'
doing, not a numerical bug.

usage:
    B=target/release/ringtrain
    # ringtrain's initial weights for --model small and seed 1337 (no step is run):
    $B train --model small --backend cpu --steps 0 --save /tmp/small-init
    # ringtrain's default 200-step run; PyTorch repeats its first 30 steps:
    $B train --model small --backend cpu --metrics /tmp/small.jsonl
    python3 scripts/compare_torch_training.py /tmp/small-init --steps 30 --metrics /tmp/small.jsonl
    # The former defaults (no warmup), where both sides blow up at step 4:
    $B train --model small --backend cpu --warmup 0 --metrics /tmp/small-w0.jsonl
    python3 scripts/compare_torch_training.py /tmp/small-init --steps 30 --warmup 0 --metrics /tmp/small-w0.jsonl

It prints one line per step (PyTorch's loss and gradient norm, ringtrain's, their relative differences)
and the ratio loss[s] / loss[s-1] of each side's worst step. The schedule flags (--lr, --warmup,
--min-lr, --total-steps) must be the ones the ringtrain run used; the defaults are ringtrain's defaults
for the model (`default_lr`, `default_warmup` and `TrainOptions::for_model` in src/trainer/options.rs);
pass --warmup 0 to compare a run made with --warmup 0. The batches are the
`synthetic` corpus's shuffled windows (seed 1337), rebuilt in Python by ringtrain_data.py; only one rank
and no gradient accumulation are modelled. Exits 0 after printing, 2 on bad usage.

needs: python3 -m pip install -r scripts/requirements.txt
"""
import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ringtrain_data  # noqa: E402
from ringtrain_presets import adamw  # noqa: E402


def lr_at(step, lr, warmup, min_lr, total_steps):
    """`LrSchedule::lr_at` for the cosine schedule, 0-based step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def read_metrics(path):
    rows = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line
                rows[row["step"]] = row
    return rows


def worst_ratio(losses):
    """(ratio, step) of the largest loss[s] / loss[s-1], steps counted from 1."""
    ratios = [(losses[i] / losses[i - 1], i + 1) for i in range(1, len(losses))]
    return max(ratios) if ratios else (float("nan"), 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("init", help="HF GPT-2 directory with the initial weights (ringtrain --steps 0 --save)")
    parser.add_argument("--steps", type=int, default=30, help="steps to train (default 30)")
    parser.add_argument("--metrics", help="ringtrain metrics file (JSON Lines) to compare with")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, help="default: the model's n_positions")
    parser.add_argument("--lr", type=float, help="peak lr (default: ringtrain's default_lr for the model)")
    parser.add_argument("--warmup", type=int, help="warmup steps (default: a fifth of --total-steps)")
    parser.add_argument("--min-lr", type=float, help="cosine floor (default lr/10)")
    parser.add_argument("--total-steps", type=int, default=200, help="schedule length (ringtrain's --steps)")
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the PyTorch per-step losses and norms here")
    args = parser.parse_args()

    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"SKIP: {e}")
        return 0
    torch.set_num_threads(args.threads)
    model = GPT2LMHeadModel.from_pretrained(args.init).float().train()
    cfg = model.config
    if cfg.vocab_size != 256:
        parser.error(f"{args.init} has vocabulary {cfg.vocab_size}; only the byte-level synthetic corpus is modelled")
    t = args.seq_len or min(cfg.n_positions, 1024)
    lr = args.lr if args.lr is not None else (3e-3 if cfg.n_embd <= 256 else 6e-4)
    min_lr = args.min_lr if args.min_lr is not None else lr / 10
    warmup = args.warmup if args.warmup is not None else args.total_steps // 5

    tokens = ringtrain_data.synthetic_train_tokens()
    sampler = ringtrain_data.WindowSampler(len(tokens), t, args.batch_size, True, args.seed)

    opt = adamw(model, lr)
    theirs = read_metrics(args.metrics) if args.metrics else {}

    print(f"{'step':>4} {'lr':>9} {'torch loss':>10} {'torch norm':>10} | {'ours loss':>9} {'ours norm':>9} "
          f"| {'d loss':>8} {'d norm':>8}")
    losses, norms = [], []
    for step in range(args.steps):
        inputs, targets = ringtrain_data.batch(tokens, sampler.windows_for_step(step), t)
        inputs, targets = torch.from_numpy(inputs), torch.from_numpy(targets)
        step_lr = lr_at(step, lr, warmup, min_lr, args.total_steps)
        for group in opt.param_groups:
            group["lr"] = step_lr
        opt.zero_grad(set_to_none=True)
        logits = model(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        losses.append(loss.item())
        norms.append(norm)
        line = f"{step + 1:>4} {step_lr:>9.3e} {losses[-1]:>10.4f} {norm:>10.3f}"
        row = theirs.get(step + 1)
        if row:
            dl = (row["loss"] - losses[-1]) / losses[-1]
            dn = (row["grad_norm"] - norm) / norm
            line += f" | {row['loss']:>9.4f} {row['grad_norm']:>9.3f} | {dl:>+8.1e} {dn:>+8.1e}"
        print(line, flush=True)

    ratio, at = worst_ratio(losses)
    print(f"torch: worst loss[s]/loss[s-1] = {ratio:.3f} at step {at}, max grad norm {max(norms):.2f} "
          f"at step {1 + int(np.argmax(norms))}")
    ours = [theirs[s]["loss"] for s in range(1, args.steps + 1) if s in theirs]
    if len(ours) == args.steps:
        ratio, at = worst_ratio(ours)
        print(f"ringtrain: worst loss[s]/loss[s-1] = {ratio:.3f} at step {at}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loss": losses, "grad_norm": norms}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
