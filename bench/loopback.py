#!/usr/bin/env python3
"""ringtrain against PyTorch DDP (Gloo) on this machine's loopback, in one run.

    python3 bench/loopback.py ROUNDS [--models tiny,small] [--ranks 1,2,4] [--steps 15] [--warmup 5]
                              [--bucket-mb 1] [--update replicated] [--impls ringtrain,ringtrain-off,ddp]

For each model and rank count, ROUNDS rounds of these measurements (--impls), in an order that rotates per
round:
  ringtrain       `ringtrain launch --nproc N -- train ... --overlap on --transport quic` (QUIC on 127.0.0.1)
  ringtrain-off   the same with `--overlap off`
  ringtrain-shm   `--overlap on --transport shm`: the ring links through shared memory
  ddp             N processes of bench/hosts/ddp.py over Gloo on 127.0.0.1 (bucket_cap_mb = --bucket-mb)
Every rank has one compute thread, the same preset, per-rank batch 8 and sequence length (the preset's
n_positions, at most 128), and the same gradient bucket size. With one rank there is no communication:
that is each trainer's own baseline.

Prints one JSON line per measurement, then one per (model, ranks, trainer) with the medians over rounds:
step_ms, tokens_per_s, added_ms_per_step (over the same trainer's one-rank median), and for ringtrain
comm_ms, exposed_comm_ms and their ratio. Needs python3 with torch and transformers for the DDP side, and
target/release/ringtrain (RINGTRAIN_BIN to override).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from ringtrain_presets import PRESETS  # noqa: E402

JOB_TIMEOUT_S = 900


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs):
    return round(statistics.median(xs), 3) if xs else None


class Bench:
    def __init__(self, args, workdir, binary):
        self.a = args
        self.workdir = workdir
        self.binary = binary

    def seq_len(self, model):
        return min(PRESETS[model]["n_positions"], 128)

    def ringtrain(self, model, ranks, overlap, transport, label):
        a = self.a
        metrics = os.path.join(self.workdir, f"{label}.jsonl")
        cmd = [self.binary, "launch", "--nproc", str(ranks), "--", "train", "--model", model, "--batch-size",
               str(a.batch_size), "--seq-len", str(self.seq_len(model)), "--steps", str(a.warmup + a.steps),
               "--backend", "cpu", "--threads", "1", "--metrics", metrics, "--eval-batches", "1", "--bucket-mb",
               str(a.bucket_mb), "--update", a.update, "--overlap", overlap, "--transport", transport]
        with open(os.path.join(self.workdir, f"{label}.log"), "w") as log:
            subprocess.run(cmd, stdout=log, stderr=log, check=True, timeout=JOB_TIMEOUT_S)
        with open(metrics) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        timed = [r for r in rows if r["step"] > a.warmup]
        return {"step_ms": [r["step_ms"] for r in timed], "comm_ms": [r["comm_ms"] for r in timed],
                "exposed_ms": [r.get("exposed_comm_ms", r["comm_ms"]) for r in timed]}

    def ddp(self, model, ranks, label):
        a = self.a
        port = str(free_port())
        cmd = ["python3", os.path.join(HERE, "hosts", "ddp.py"), "--model", model, "--batch-size",
               str(a.batch_size), "--seq-len", str(self.seq_len(model)), "--steps", str(a.steps), "--warmup",
               str(a.warmup), "--threads", "1", "--bucket-mb", str(a.bucket_mb)]
        procs = []
        for r in range(ranks):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            log = open(os.path.join(self.workdir, f"{label}.rank{r}.log"), "w")
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True), log))
        outs = []
        for proc, log in procs:
            out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
            log.close()
            if proc.returncode != 0:
                raise RuntimeError(f"{label}: a DDP rank exited with {proc.returncode} (log {log.name})")
            outs.append(out)
        res = json.loads(outs[0].strip().splitlines()[-1])
        return {"step_ms": res["step_ms"]}

    def measure(self, rnd, model, ranks, impl):
        label = f"r{rnd}-{model}-n{ranks}-{impl}"
        if impl == "ddp":
            res = self.ddp(model, ranks, label)
        else:
            transport = "shm" if impl == "ringtrain-shm" and ranks > 1 else "quic"
            res = self.ringtrain(model, ranks, "off" if impl == "ringtrain-off" else "on", transport, label)
        step = statistics.median(res["step_ms"])
        tokens = ranks * self.a.batch_size * self.seq_len(model)
        out = {"round": rnd, "model": model, "ranks": ranks, "impl": impl, "step_ms": round(step, 3),
               "tokens_per_s": round(tokens / step * 1e3, 1), "load": [round(x, 2) for x in os.getloadavg()]}
        if "comm_ms" in res:
            out["comm_ms"] = round(statistics.median(res["comm_ms"]), 3)
            out["exposed_comm_ms"] = round(statistics.median(res["exposed_ms"]), 3)
        print(json.dumps(out), flush=True)
        return out


def summarise(results, models, ranks_list, impls):
    for model in models:
        for impl in impls:
            # ringtrain-off's and ringtrain-shm's one-rank runs are ringtrain's: one rank sends nothing.
            own = impl if impl == "ddp" or (model, 1, impl) in {(r["model"], r["ranks"], r["impl"]) for r in results} \
                else "ringtrain"
            base = [r["step_ms"] for r in results if (r["model"], r["ranks"], r["impl"]) == (model, 1, own)]
            for ranks in ranks_list:
                rows = [r for r in results if (r["model"], r["ranks"], r["impl"]) == (model, ranks, impl)]
                if not rows:
                    continue
                s = {"summary": impl, "model": model, "ranks": ranks, "rounds": len(rows),
                     "step_ms": median([r["step_ms"] for r in rows]),
                     "tokens_per_s": median([r["tokens_per_s"] for r in rows])}
                if base and ranks > 1:
                    s["added_ms_per_step"] = round(s["step_ms"] - statistics.median(base), 3)
                if ranks > 1 and "comm_ms" in rows[0]:
                    s["comm_ms"] = median([r["comm_ms"] for r in rows])
                    s["exposed_comm_ms"] = median([r["exposed_comm_ms"] for r in rows])
                    s["exposed_share"] = round(s["exposed_comm_ms"] / s["comm_ms"], 3) if s["comm_ms"] else None
                print(json.dumps(s), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--update", choices=["replicated", "sharded"], default="replicated")
    ap.add_argument("--impls", default="ringtrain,ringtrain-off,ddp")
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    ranks_list = [int(n) for n in a.ranks.split(",") if n]
    if a.rounds < 1 or any(m not in PRESETS for m in models) or any(n < 1 for n in ranks_list):
        ap.error("ROUNDS >= 1, models from the presets, ranks >= 1")
    binary = os.environ.get("RINGTRAIN_BIN", os.path.join(ROOT, "target", "release", "ringtrain"))
    if not os.access(binary, os.X_OK):
        ap.error(f"{binary} not found: run `cargo build --release` (or set RINGTRAIN_BIN)")
    impls = [i for i in a.impls.split(",") if i]
    if any(i not in ("ringtrain", "ringtrain-off", "ringtrain-shm", "ddp") for i in impls):
        ap.error("--impls: ringtrain, ringtrain-off, ringtrain-shm, ddp")
    print(json.dumps({"machine": f"{os.cpu_count()} cores", "binary": binary, "steps": a.steps,
                      "warmup": a.warmup, "batch": a.batch_size, "bucket_mb": a.bucket_mb, "update": a.update,
                      "threads_per_rank": 1}), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="rt-loopback-") as workdir:
        bench = Bench(a, workdir, binary)
        for rnd in range(1, a.rounds + 1):
            for model in models:
                for ranks in ranks_list:
                    shift = (rnd - 1) % len(impls)
                    for impl in impls[shift:] + impls[:shift]:
                        if ranks == 1 and impl in ("ringtrain-off", "ringtrain-shm") and "ringtrain" in impls:
                            continue  # one rank sends nothing: overlap changes nothing
                        results.append(bench.measure(rnd, model, ranks, impl))
    summarise(results, models, ranks_list, impls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
