#!/usr/bin/env python3
"""All-reduce busbw of PyTorch's Gloo backend (torch.distributed over TCP on loopback), for comparison with
`ringtrain bench allreduce`. N processes via torch.multiprocessing; f32 sum; 2 warm-up iterations, then the
mean time of ITERS; time = slowest rank; busbw = algbw x 2(N-1)/N.

Usage: python3 gloo.py NPROC [SIZES_BYTES comma-separated] [ITERS]
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def human(b):
    if b >= 1 << 20 and b % (1 << 20) == 0:
        return f"{b >> 20}MiB"
    if b >= 1 << 10 and b % (1 << 10) == 0:
        return f"{b >> 10}KiB"
    return f"{b}B"


def worker(rank, world, port, sizes, iters, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes:
        x = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
        for _ in range(2):
            dist.all_reduce(x)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        el = (time.perf_counter() - t) / iters
        worst = torch.tensor([el], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rows.append((nbytes, worst.item()))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main():
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    sizes = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 64 << 20]
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(worker, args=(world, port, sizes, iters, out), nprocs=world, join=True)
    rows = out.get()
    print(f"gloo (torch {torch.__version__}) all-reduce (f32 sum), {world} processes, TCP on loopback")
    print(f"{'size':>10} {'time_us':>12} {'algbw_GB/s':>12} {'busbw_GB/s':>12}")
    for nbytes, secs in rows:
        algbw = nbytes / secs / 1e9
        busbw = algbw * 2 * (world - 1) / world
        print(f"{human(nbytes):>10} {secs * 1e6:>12.1f} {algbw:>12.3f} {busbw:>12.3f}")


if __name__ == "__main__":
    main()
