#!/usr/bin/env python3
"""PyTorch DDP reference for the emulated-hosts benchmark: one rank of data-parallel GPT-2 training over
Gloo (TCP), started like ringtrain with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment.

The model is ringtrain's preset (scripts/ringtrain_presets.py) as transformers.GPT2LMHeadModel in fp32 with
eager attention, gelu_new and no dropout. Each rank trains on its own uniformly random tokens (content does
not change the timing): forward, mean cross-entropy over B*T targets, backward (DDP all-reduces the gradient
in buckets of --bucket-mb MiB while backward runs), global-norm clipping at --grad-clip as ringtrain does by
default, torch.optim.AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on tensors of rank >= 2), zero_grad.
WORLD_SIZE=1 (or unset) is the single-rank baseline: the same loop without a process group or DDP wrapper.

Rank 0 prints one JSON line:
  {"impl": "pytorch-ddp-gloo", "world": 2, "ms_per_step_median": ..., "tokens_per_s": ..., "step_ms": [...]}
step_ms holds every timed step (after --warmup untimed ones) as rank 0 saw it; tokens_per_s is the global
batch (world * B * T) over the median step. With --tcp-stats (used inside the emulated hosts, where every
TCP socket of the namespace belongs to this job) each rank also reads `ss -ti` before leaving and rank 0
adds the sums over all ranks: bytes_sent, bytes_retrans, retrans segments.

usage: WORLD_SIZE=.. RANK=.. MASTER_ADDR=.. MASTER_PORT=.. GLOO_SOCKET_IFNAME=eth0 \\
       python3 bench/hosts/ddp.py [--model small] [--batch-size 8] [--seq-len 128] [--steps 15] [--warmup 5]
                                  [--threads 1] [--bucket-mb 1] [--tcp-stats]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
from ringtrain_presets import PRESETS, adamw, hf_config  # noqa: E402


def env_int(name, default):
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"environment variable {name}={raw!r} is not an integer")


def tcp_counters():
    """Sums of bytes_sent, bytes_retrans and retrans (segments, total) over this namespace's TCP sockets."""
    out = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, check=False).stdout
    sums = {"bytes_sent": 0, "bytes_retrans": 0, "retrans_segs": 0, "sockets": 0}
    for line in out.splitlines():
        line = line.strip()
        if "bytes_sent:" in line or "rtt:" in line:
            sums["sockets"] += "rtt:" in line
            for key, field in (("bytes_sent", "bytes_sent"), ("bytes_retrans", "bytes_retrans")):
                m = re.search(rf"\b{field}:(\d+)", line)
                if m:
                    sums[key] += int(m.group(1))
            m = re.search(r"\bretrans:\d+/(\d+)", line)
            if m:
                sums["retrans_segs"] += int(m.group(1))
    return sums


def main():
    ap = argparse.ArgumentParser(description="PyTorch DDP (Gloo) reference rank for bench/hosts")
    ap.add_argument("--model", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=15, help="timed steps (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: %(default)s)")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (default: %(default)s)")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="0 turns clipping off (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--tcp-stats", action="store_true", help="report this namespace's TCP counters (ss -ti)")
    args = ap.parse_args()
    B, T = args.batch_size, args.seq_len
    if min(B, T, args.steps, args.threads) < 1 or args.warmup < 0 or args.bucket_mb <= 0:
        ap.error("--batch-size, --seq-len, --steps, --threads and --bucket-mb must be positive, --warmup >= 0")

    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    world = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise SystemExit(f"RANK={rank} WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    cfg = hf_config(args.model)
    if T > cfg.n_positions:
        ap.error(f"--seq-len {T} exceeds n_positions {cfg.n_positions} of preset {args.model}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").float().train()
    n_params = sum(p.numel() for p in model.parameters())  # wte counted once: lm_head is tied
    opt = adamw(model, args.lr)
    net = model
    if world > 1:
        # env:// reads MASTER_ADDR / MASTER_PORT; GLOO_SOCKET_IFNAME picks the host's interface.
        dist.init_process_group("gloo", rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)

    V = cfg.vocab_size
    g = torch.Generator().manual_seed(args.seed + rank)
    # Batches are made before timing so the clock sees only the training step.
    batches = [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(args.warmup + args.steps)]

    def step(tok):
        x, y = tok[:, :-1], tok[:, 1:]
        logits = net(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        loss.backward()  # under DDP, returns once every bucket is all-reduced
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    load_before = os.getloadavg()[0]
    for i in range(args.warmup):
        step(batches[i])
    if world > 1:
        dist.barrier()
    times = []
    loss = None
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = step(batches[i])
        times.append(time.perf_counter() - t0)

    tcp = None
    if world > 1:
        if args.tcp_stats:
            # Read before the group is torn down, while the job's connections are still open.
            dist.barrier()
            mine = tcp_counters()
            keys = sorted(mine)
            t = torch.tensor([mine[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(t)
            tcp = {k: int(v) for k, v in zip(keys, t.tolist())}
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return 0
    median = statistics.median(times)
    out = {
        "impl": "pytorch-ddp-gloo" if world > 1 else "pytorch-single",
        "model": args.model,
        "world": world,
        "batch": B,
        "seq": T,
        "threads": args.threads,
        "bucket_mb": args.bucket_mb,
        "params": n_params,
        "steps": args.steps,
        "warmup": args.warmup,
        "ms_per_step_median": round(median * 1e3, 3),
        "ms_per_step_mean": round(statistics.mean(times) * 1e3, 3),
        "tokens_per_s": round(world * B * T / median, 1),
        "last_loss": round(loss, 4),
        "step_ms": [round(t * 1e3, 2) for t in times],
        "torch": torch.__version__,
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if tcp is not None:
        out["tcp"] = tcp
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
