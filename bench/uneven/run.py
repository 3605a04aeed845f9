#!/usr/bin/env python3
"""Uneven workers: `--batch-split even` against `auto` when one rank is held to a fraction of a core.

    python3 bench/uneven/run.py [--net loopback|hosts] [--rate 1gbit] [--ranks 2] [--quota 40]
                                [--rounds 3] [--steps 15] [--warmup 15] [--model small] [--batch 8]
                                [--seq-len 128] [--global-batch G] [--sim]

Needs root (a cgroup, and for --net hosts the emulated hosts of bench/hosts/hosts.sh). The last rank runs in
a CPU cgroup with a quota of QUOTA% of one core (cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`, period
20 ms); the script creates the cgroup and removes it at the end, also on an error or Ctrl-C. `--quota 0`
limits no rank. Every rank has one compute thread (RAYON_NUM_THREADS and LP_NUM_THREADS=1, so lavapipe
too); `--backends cpu,wgpu` gives each rank its backend.

In each round, in turn:
  alone        every rank's configuration trained alone (world 1, its own batch of --batch sequences per
               step, under its own limit). With --ranks 2 one at a time; with more, all at once, as
               bench/hosts/compare.py's single-rank baseline (the ranks share the machine's cores), so the
               sum is what the machine does without communication. --alone apart|together chooses.
  even         one job over the ranks, --global-batch G (default ranks x --batch) split even
  auto         the same with --batch-split auto
Tokens/s is the median over the timed steps (after --warmup, which lets auto settle) of the metrics'
tokens_per_s. Prints one JSON line per measurement and a summary line with the medians over rounds: even and
auto against the sum of the alone figures, and the split auto settled on. With --sim it also prints the
sim's prediction (`ringtrain-sim --timing-only --worker-speed`) for even and auto, its compute profile taken
from the alone runs, next to the measured steps.

The binaries are target/release/ringtrain and ringtrain-sim (RINGTRAIN_BIN / RINGTRAIN_SIM_BIN override).
"""
import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
HOSTS_SH = os.path.join(ROOT, "bench", "hosts", "hosts.sh")
JOB_TIMEOUT_S = 1200
# The quota's period: 20 ms, so that a step of tens of milliseconds sees the limit as a slower core rather
# than as whole periods of running and stopping.
PERIOD_US = 20000


class Cgroup:
    """A CPU cgroup limited to `percent` of one core, v2 or v1."""

    def __init__(self, percent):
        name = f"ringtrain-uneven-{os.getpid()}"
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            self.path = os.path.join("/sys/fs/cgroup", name)
            os.mkdir(self.path)
            with open(os.path.join(self.path, "cpu.max"), "w") as f:
                f.write(f"{percent * PERIOD_US // 100} {PERIOD_US}")
        else:
            self.path = os.path.join("/sys/fs/cgroup/cpu", name)
            os.mkdir(self.path)
            with open(os.path.join(self.path, "cpu.cfs_period_us"), "w") as f:
                f.write(str(PERIOD_US))
            with open(os.path.join(self.path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(percent * PERIOD_US // 100))

    def wrap(self, cmd):
        """`cmd` started inside the cgroup (the shell joins it, then becomes the command)."""
        procs = os.path.join(self.path, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd]

    def remove(self):
        if os.path.isdir(self.path):
            os.rmdir(self.path)


def run_all(cmds, envs, workdir, label):
    """Starts every command at once, waits for all, fails naming the rank that failed."""
    procs = []
    for i, (cmd, env) in enumerate(zip(cmds, envs)):
        log = open(os.path.join(workdir, f"{label}.{i}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=dict(os.environ, **env), stdout=log, stderr=log), log))
    failed = []
    for i, (proc, log) in enumerate(procs):
        try:
            proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            failed.append(f"process {i} timed out")
        log.close()
        if proc.returncode != 0:
            with open(log.name) as f:
                tail = f.read()[-600:]
            failed.append(f"process {i} exited with {proc.returncode}: {tail}")
    if failed:
        raise RuntimeError(f"{label}: " + "; ".join(failed))


def timed(path, warmup):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r["step"] > warmup]
    if not rows:
        raise RuntimeError(f"{path}: no timed steps")
    return rows


class Bench:
    def __init__(self, a, workdir, cgroup):
        self.a, self.workdir, self.cgroup = a, workdir, cgroup
        self.bin = os.environ.get("RINGTRAIN_BIN", os.path.join(ROOT, "target", "release", "ringtrain"))
        self.secret = os.path.join(workdir, "secret")
        with open(os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        self.port = 29700
        self.global_batch = a.global_batch or a.ranks * a.batch
        self.alone_apart = (a.alone or ("apart" if a.ranks == 2 else "together")) == "apart"

    def command(self, rank, limited, extra, metrics):
        a = self.a
        backends = a.backends.split(",")
        backend = backends[rank % len(backends)]
        limited = limited and self.cgroup is not None
        cmd = [self.bin, "train", "--model", a.model, "--batch-size", str(a.batch), "--seq-len", str(a.seq_len),
               "--steps", str(a.warmup + a.steps), "--backend", backend, "--threads", "1", "--eval-every", "0",
               "--metrics", metrics, "--secret-file", self.secret, *extra]
        if a.net == "hosts":
            cmd = ["ip", "netns", "exec", f"rt-h{rank}", *cmd]
        # Outermost: `ip netns exec` mounts its own /sys, without the cgroup tree; its child inherits the group.
        if limited:
            cmd = self.cgroup.wrap(cmd)
        return cmd

    def master(self):
        return "10.77.0.1" if self.a.net == "hosts" else "127.0.0.1"

    def job(self, label, split):
        a = self.a
        self.port += 1
        cmds, envs, metrics = [], [], os.path.join(self.workdir, f"{label}.metrics.jsonl")
        for rank in range(a.ranks):
            extra = ["--global-batch", str(self.global_batch), "--batch-split", split]
            cmds.append(self.command(rank, rank == a.ranks - 1, extra, metrics if rank == 0 else os.devnull))
            envs.append({"RANK": str(rank), "WORLD_SIZE": str(a.ranks), "MASTER_ADDR": self.master(),
                         "MASTER_PORT": str(self.port), "RAYON_NUM_THREADS": "1", "LP_NUM_THREADS": "1"})
        run_all(cmds, envs, self.workdir, label)
        rows = timed(metrics, a.warmup)
        shares = [r["batch_shares"] for r in timed(metrics, 0) if r.get("batch_shares")]
        return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                "step_ms": statistics.median(r["step_ms"] for r in rows),
                "shares": shares[-1] if shares else None}

    def alone(self, label):
        """Each rank's configuration alone: tokens/s and step ms per rank."""
        a = self.a
        single = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
                  "RAYON_NUM_THREADS": "1", "LP_NUM_THREADS": "1"}
        paths = [os.path.join(self.workdir, f"{label}.{r}.metrics.jsonl") for r in range(a.ranks)]
        cmds = [self.command(r, r == a.ranks - 1, [], paths[r]) for r in range(a.ranks)]
        if self.alone_apart:
            for r in range(a.ranks):
                run_all([cmds[r]], [single], self.workdir, f"{label}.{r}")
        else:
            run_all(cmds, [single] * a.ranks, self.workdir, label)
        out = []
        for p in paths:
            rows = timed(p, a.warmup)
            out.append({"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                        "step_ms": statistics.median(r["step_ms"] for r in rows)})
        return out


def predict(a, alone, shares):
    """The sim's step for the even and the auto split, compute profile from the fastest rank alone."""
    sim = os.environ.get("RINGTRAIN_SIM_BIN", os.path.join(ROOT, "target", "release", "ringtrain-sim"))
    fastest = min(r["step_ms"] for r in alone)
    speeds = ",".join(f"{fastest / r['step_ms']:.4f}" for r in alone)
    # Backward is about twice forward on the CPU backend; the update's share is small at this size.
    net = ("latency=50us,bandwidth=1Gbit,cpu-per-byte=1.1ns" if a.net == "hosts"
           else "latency=20us,bandwidth=10Gbit,cpu-per-byte=1.1ns")
    out = subprocess.run(
        [sim, "--timing-only", "--workers", str(a.ranks), "--model", a.model, "--batch-size", str(a.batch),
         "--seq-len", str(a.seq_len), "--global-batch", str(a.global_batch or a.ranks * a.batch),
         "--worker-speed", speeds, "--network", net,
         "--compute-ms", f"forward={fastest / 3:.3f},backward={2 * fastest / 3:.3f}"],
        capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("worker speeds"))
    return {"sim": line, "network": net}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--net", choices=["loopback", "hosts"], default="loopback")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--quota", type=int, default=40, help="percent of one core for the last rank (0: no limit)")
    p.add_argument("--backends", default="cpu", help="backend of each rank, comma-separated, cycled")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--sim", action="store_true")
    p.add_argument("--alone", choices=["apart", "together"],
                   help="run the alone baselines one at a time or all at once (default: apart for 2 ranks)")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/uneven/run.py needs root (a CPU cgroup; emulated hosts)")
    cgroup = Cgroup(a.quota) if a.quota > 0 else None
    hosts_up = False

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        if a.net == "hosts":
            subprocess.run([HOSTS_SH, "up", str(a.ranks), a.rate], check=True, stdout=subprocess.DEVNULL)
            hosts_up = True
        with tempfile.TemporaryDirectory(prefix="ringtrain-uneven-") as workdir:
            b = Bench(a, workdir, cgroup)
            rounds = []
            for rnd in range(1, a.rounds + 1):
                alone = b.alone(f"r{rnd}-alone")
                # Alternate the order of the two jobs over rounds.
                order = ["even", "auto"] if rnd % 2 else ["auto", "even"]
                res = {split: b.job(f"r{rnd}-{split}", split) for split in order}
                row = {"round": rnd, "net": a.net if a.net == "loopback" else f"{a.ranks} hosts x {a.rate}",
                       "ranks": a.ranks, "backends": a.backends, "quota_percent": a.quota, "global_batch": b.global_batch,
                       "alone_tokens_per_s": [round(r["tokens_per_s"]) for r in alone],
                       "alone_step_ms": [round(r["step_ms"], 1) for r in alone],
                       "even_tokens_per_s": round(res["even"]["tokens_per_s"]),
                       "even_step_ms": round(res["even"]["step_ms"], 1),
                       "auto_tokens_per_s": round(res["auto"]["tokens_per_s"]),
                       "auto_step_ms": round(res["auto"]["step_ms"], 1), "auto_shares": res["auto"]["shares"],
                       "loadavg": [round(x, 2) for x in os.getloadavg()]}
                if a.sim:
                    row.update(predict(a, alone, res["auto"]["shares"]))
                print(json.dumps(row), flush=True)
                rounds.append(row)
            med = lambda k: statistics.median(r[k] for r in rounds)
            alone_sum = statistics.median(sum(r["alone_tokens_per_s"]) for r in rounds)
            print(json.dumps({
                "summary": True, "net": rounds[0]["net"], "ranks": a.ranks, "quota_percent": a.quota,
                "alone": "apart" if b.alone_apart else "together",
                "alone_sum_tokens_per_s": round(alone_sum), "even_tokens_per_s": round(med("even_tokens_per_s")),
                "auto_tokens_per_s": round(med("auto_tokens_per_s")),
                "even_over_alone_sum": round(med("even_tokens_per_s") / alone_sum, 3),
                "auto_over_alone_sum": round(med("auto_tokens_per_s") / alone_sum, 3),
                "auto_over_even": round(med("auto_tokens_per_s") / med("even_tokens_per_s"), 3),
                "even_step_ms": med("even_step_ms"), "auto_step_ms": med("auto_step_ms"),
                "auto_shares": [r["auto_shares"] for r in rounds]}), flush=True)
    finally:
        if hosts_up:
            subprocess.run([HOSTS_SH, "down"], stdout=subprocess.DEVNULL)
        if cgroup is not None:
            cgroup.remove()


if __name__ == "__main__":
    main()
