#!/usr/bin/env python3
"""How much a training loss curve moves from batch to batch alone: the losses of one fixed model (no update)
on the batches that a default ringtrain run trains on at steps S..S+N-1.

usage:
    B=target/release/ringtrain
    $B train --model small --backend cpu --eval-every 0 --save /tmp/small-200
    python3 scripts/batch_noise.py /tmp/small-200 --from-step 151 --steps 50

It prints the mean and spread of those losses and the largest ratio loss[s] / loss[s-1] between consecutive
batches. Since the model does not change, that ratio is the floor below which a per-step "loss rose by more
than X%" check cannot go on that stretch of the run: for the default `small` run at step 200 it is 1.26 over
steps 151..200 (4 of 49 pairs above 1.2), so a 20% rule over the whole run flags batches, not instability
(scripts/check_spikes.py). The batches are the shuffled `synthetic` windows of the given seed with one
rank and no accumulation (ringtrain_data.py). Prints SKIP and exits 0 without torch/transformers.

needs: python3 -m pip install -r scripts/requirements.txt
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ringtrain_data  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="HF GPT-2 directory (a ringtrain checkpoint)")
    parser.add_argument("--from-step", type=int, default=151, help="first step (1-based) whose batch is used")
    parser.add_argument("--steps", type=int, default=50, help="number of consecutive batches")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, help="default: the model's n_positions")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.from_step < 1 or args.steps < 2:
        parser.error("--from-step must be at least 1 and --steps at least 2")
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"SKIP: {e}")
        return 0
    torch.set_num_threads(args.threads)
    model = GPT2LMHeadModel.from_pretrained(args.checkpoint).float().eval()
    cfg = model.config
    if cfg.vocab_size != 256:
        parser.error(f"{args.checkpoint} has vocabulary {cfg.vocab_size}; only the byte-level synthetic corpus is modelled")
    t = args.seq_len or min(cfg.n_positions, 1024)
    tokens = ringtrain_data.synthetic_train_tokens()
    sampler = ringtrain_data.WindowSampler(len(tokens), t, args.batch_size, True, args.seed)

    losses = []
    with torch.no_grad():
        for step in range(args.from_step - 1, args.from_step - 1 + args.steps):
            inputs, targets = ringtrain_data.batch(tokens, sampler.windows_for_step(step), t)
            logits = model(torch.from_numpy(inputs)).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                                                     torch.from_numpy(targets).reshape(-1))
            losses.append(loss.item())
    losses = np.array(losses)
    ratios = losses[1:] / losses[:-1]
    worst = int(np.argmax(ratios))
    last = args.from_step + args.steps - 1
    print(f"{args.checkpoint} held fixed, batches of steps {args.from_step}..{last}: loss mean {losses.mean():.4f}, "
          f"std {losses.std():.4f} ({losses.std() / losses.mean():.1%}), min {losses.min():.4f}, max {losses.max():.4f}")
    print(f"largest consecutive ratio {ratios[worst]:.3f} (step {args.from_step + worst + 1}); "
          f"ratios above 1.2: {int((ratios > 1.2).sum())} of {len(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
