#!/usr/bin/env python3
"""PyTorch eager fp32 reference for bench/device/run.sh, on the GPU: the training step of ringtrain's `bench
step` on the same model and shapes, and a square fp32 matmul.

The model is ringtrain's preset built by scripts/ringtrain_presets.py (transformers' GPT2LMHeadModel, eager
attention, gelu_new, no dropout, tied LM head, fp32), trained with the same AdamW on uniformly random tokens
made on the device before timing. TF32 is off for matmuls and cuDNN, so every product is full fp32, as in
ringtrain. After --warmup untimed steps, --steps steps are timed as one span, closed by a device
synchronize. The matmul times --matmul-iters products of two random S x S matrices after three untimed ones.

Prints two JSON lines:
  {"impl": "pytorch-eager-fp32", "backend": "torch ... on <device>", "params": N, "batch": B, "seq": T,
   "ms_per_step": ..., "tokens_per_s": ..., ...}
  {"op": "matmul_forward", "m": S, "k": S, "n": S, "backend": "torch ... on <device>", "gflops": ...}
(the fields figures.py reads, as ringtrain's `bench step` and `bench kernels` name them).

--device cpu with --model tiny runs the same code without a GPU, to check the script itself.
Exits 3, saying why, when torch or transformers cannot be imported or the device is not available.

usage: python3 bench/device/torch_ref.py [--model gpt2] [--batch-size 8] [--seq-len 1024] [--steps 10]
                                         [--warmup 3] [--matmul 4096] [--matmul-iters 10] [--device cuda]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from ringtrain_presets import PRESETS, adamw, hf_config  # noqa: E402

UNAVAILABLE = 3


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step_line(torch, args, device, name, tf32):
    from transformers import AutoModelForCausalLM

    cfg = hf_config(args.model)
    if args.seq_len > cfg.n_positions:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds n_positions {cfg.n_positions} of {args.model}")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().to(device).train()
    n_params = sum(p.numel() for p in model.parameters())  # wte counted once: lm_head is tied
    opt = adamw(model, 3e-4)
    B, T, V = args.batch_size, args.seq_len, cfg.vocab_size
    g = torch.Generator(device=device).manual_seed(args.seed)
    # [steps, B, T+1] token ids, made before timing: inputs are the first T of a row, targets the last T.
    tokens = torch.randint(0, V, (args.warmup + args.steps, B, T + 1), generator=g, device=device)

    def step(tok):
        logits = model(input_ids=tok[:, :-1]).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tok[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first_loss = None
    for i in range(args.warmup):
        loss = step(tokens[i])
        first_loss = loss.item() if first_loss is None else first_loss
    sync(torch, device)
    started = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        loss = step(tokens[i])
    sync(torch, device)
    secs = time.perf_counter() - started
    return {
        "impl": "pytorch-eager-tf32" if tf32 else "pytorch-eager-fp32",
        "backend": name,
        "model": args.model,
        "params": n_params,
        "batch": B,
        "seq": T,
        "steps": args.steps,
        "warmup": args.warmup,
        "ms_per_step": secs * 1e3 / args.steps,
        "tokens_per_s": B * T * args.steps / secs,
        "first_loss": first_loss,
        "last_loss": loss.item(),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def matmul_line(torch, args, device, name):
    s = args.matmul
    g = torch.Generator(device=device).manual_seed(args.seed)
    a = torch.randn(s, s, generator=g, device=device)  # [S, S]
    b = torch.randn(s, s, generator=g, device=device)  # [S, S]
    for _ in range(3):
        c = a @ b  # [S, S]
    sync(torch, device)
    started = time.perf_counter()
    for _ in range(args.matmul_iters):
        c = a @ b
    sync(torch, device)
    secs = time.perf_counter() - started
    del c
    return {
        "op": "matmul_forward",
        "m": s,
        "k": s,
        "n": s,
        "backend": name,
        "iters": args.matmul_iters,
        "gflops": 2.0 * s**3 * args.matmul_iters / secs / 1e9,
    }


def main():
    ap = argparse.ArgumentParser(description="PyTorch eager fp32 GPU reference for bench/device/run.sh")
    ap.add_argument("--model", choices=sorted(PRESETS), default="gpt2")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--matmul", type=int, default=4096, help="square matmul size, 0 for none")
    ap.add_argument("--matmul-iters", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tf32", action="store_true", help="also time the step with TF32 matmuls (a second line)")
    args = ap.parse_args()
    if min(args.batch_size, args.seq_len, args.steps, args.matmul_iters) < 1 or args.warmup < 0 or args.matmul < 0:
        ap.error("--batch-size, --seq-len, --steps and --matmul-iters must be positive, --warmup and --matmul >= 0")

    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"torch_ref.py: torch and transformers are needed ({e})", file=sys.stderr)
        return UNAVAILABLE
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"torch_ref.py: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return UNAVAILABLE
    # Full fp32 products, as ringtrain computes them (TF32 would round the inputs to 10 mantissa bits).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    name = f"torch {torch.__version__} (transformers {transformers.__version__}) on {where}"

    print(json.dumps(train_step_line(torch, args, device, name, tf32=False)), flush=True)
    if args.matmul:
        print(json.dumps(matmul_line(torch, args, device, name)), flush=True)
    if args.tf32:
        # The same step with TF32 matmuls, against ringtrain's --matmul-precision tf32.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
        print(json.dumps(train_step_line(torch, args, device, name, tf32=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
