#!/usr/bin/env python3
"""PyTorch eager CPU reference for ringtrain's `bench step`: training throughput of the same GPT-2.

Builds ringtrain's preset (tiny / small / gpt2) as transformers.GPT2LMHeadModel in fp32 with eager attention
(--attention eager, the default) or transformers' own default, torch's scaled_dot_product_attention
(--attention sdpa), gelu_new and no dropout, and trains it with torch.optim.AdamW (lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight
decay 0.1 on tensors of rank >= 2 only) on uniformly random tokens: a fresh [B, T+1] batch per step, inputs
are the first T, targets the last T, mean cross-entropy over all B*T targets. Each step is forward, loss,
backward, AdamW step and zero_grad. After --warmup untimed steps, --steps steps are timed one by one.

Prints one JSON line ("impl" is pytorch-sdpa-cpu with --attention sdpa), e.g.
  {"impl": "pytorch-eager-cpu", "model": "tiny", "batch": 4, "seq": 64, "threads": 2, "ms_per_step": 5.1,
   "tokens_per_s": 50000.0, "torch": "2.15.0", ...}
ms_per_step is the mean over the timed steps and tokens_per_s = B*T / mean step time; the extra fields
(median, min, parameter count, last loss, versions, load average) help judge the noise.

usage: python3 scripts/bench_torch_cpu.py --model tiny|small|gpt2 --batch-size B --seq-len T --steps N
                                          [--warmup W] [--threads K] [--seed S] [--attention eager|sdpa]
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ringtrain_presets import PRESETS, adamw, hf_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description="PyTorch eager CPU training-step benchmark (ringtrain reference)")
    ap.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", choices=["eager", "sdpa"], default="eager",
                    help="transformers' attention implementation (default: %(default)s; transformers' own is sdpa)")
    args = ap.parse_args()

    try:
        import torch
        import transformers
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"SKIP: torch/transformers not installed ({e}); see scripts/requirements.txt", file=sys.stderr)
        return 0

    B, T = args.batch_size, args.seq_len
    if B < 1 or T < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--batch-size, --seq-len, --steps and --threads must be positive, --warmup >= 0")
    cfg = hf_config(args.model)
    if T > cfg.n_positions:
        ap.error(f"--seq-len {T} exceeds n_positions {cfg.n_positions} of preset {args.model}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation=args.attention).float().train()
    n_params = sum(p.numel() for p in model.parameters())  # wte counted once: lm_head is tied

    opt = adamw(model, args.lr)

    V = cfg.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    # Batches are made before timing so the clock sees only the training step.
    batches = [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(args.warmup + args.steps)]

    def step(tok):
        x, y = tok[:, :-1], tok[:, 1:]
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    load_before = os.getloadavg()[0]
    for i in range(args.warmup):
        step(batches[i])
    times = []
    loss = None
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = step(batches[i])
        loss_value = loss.item()  # forces completion; on CPU the step is synchronous anyway
        times.append(time.perf_counter() - t0)

    mean_s = sum(times) / len(times)
    out = {
        "impl": f"pytorch-{args.attention}-cpu",
        "model": args.model,
        "batch": B,
        "seq": T,
        "threads": args.threads,
        "ms_per_step": round(mean_s * 1e3, 3),
        "tokens_per_s": round(B * T / mean_s, 1),
        "torch": torch.__version__,
        "ms_per_step_median": round(statistics.median(times) * 1e3, 3),
        "ms_per_step_min": round(min(times) * 1e3, 3),
        "steps": args.steps,
        "warmup": args.warmup,
        "params": n_params,
        "last_loss": round(loss_value, 4),
        "transformers": transformers.__version__,
        # 1-minute load average before and after the run: above `threads`, other work shared the cores.
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
