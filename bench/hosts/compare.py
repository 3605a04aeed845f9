#!/usr/bin/env python3
"""ringtrain against PyTorch DDP (Gloo) on emulated hosts, in one run: the same hosts, link and queues.

    python3 bench/hosts/compare.py HOSTS RATE ROUNDS [--steps 15] [--warmup 5] [--bucket-mb 1]
                                                     [--update replicated] [--overlap on,off]

Brings up HOSTS emulated hosts at RATE with bench/hosts/hosts.sh (needs root), and for ROUNDS rounds runs
these measurements, ringtrain's first in odd rounds and DDP's first in even ones:
  ringtrain-single  `ringtrain train` with WORLD_SIZE=1 in every host at once (independent jobs): the
                    baseline without communication but with the same number of busy ranks on the cores
  ringtrain         one rank per host over QUIC, RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and a secret
                    file, `--overlap on` (named ringtrain-off with `--overlap off`; --overlap picks which run)
  ddp-single        bench/hosts/ddp.py with WORLD_SIZE=1 in every host at once
  ddp               bench/hosts/ddp.py, one rank per host over Gloo (TCP)
Every rank has one compute thread, the same model preset, per-rank batch and sequence length, and the same
gradient bucket size (ringtrain's --bucket-mb, DDP's bucket_cap_mb). The hosts are
removed at the end, also on an error or Ctrl-C.

Prints one JSON line per measurement, then one per implementation with the medians over rounds; every field
is described in bench/hosts/README.md. The ringtrain binary is target/release/ringtrain (RINGTRAIN_BIN to
override); build it first with `cargo build --release`.
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
HOSTS_SH = os.path.join(HERE, "hosts.sh")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from ringtrain_presets import PRESETS  # noqa: E402

MASTER_ADDR = "10.77.0.1"
# Counters read in every host namespace before and after a measurement (nstat, absolute values).
NSTAT_KEYS = ("UdpOutDatagrams", "UdpRcvbufErrors", "UdpSndbufErrors", "UdpInErrors", "TcpOutSegs", "TcpRetransSegs")
JOB_TIMEOUT_S = 900


def ns(i):
    return f"rt-h{i}"


def param_count(model):
    p = PRESETS[model]
    L, C, V, T = p["n_layer"], p["n_embd"], p["vocab_size"], p["n_positions"]
    # wte + wpe + per block (2 layer norms, qkv, attention proj, fc, fc proj) + final layer norm.
    return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


def host_sysctl(name):
    """A sysctl as host 0 sees it (namespaces inherit the TCP congestion control of the machine)."""
    out = subprocess.run(["ip", "netns", "exec", ns(0), "sysctl", "-n", name], capture_output=True, text=True)
    return out.stdout.strip() or None


def loadavg():
    return [round(x, 2) for x in os.getloadavg()]


def median(xs):
    return round(statistics.median(xs), 3) if xs else None


# ---- counters -------------------------------------------------------------------------------------------

def qdisc_counters():
    out = subprocess.run([HOSTS_SH, "status"], capture_output=True, text=True, check=True).stdout
    return {q["queue"]: q for q in (json.loads(line) for line in out.splitlines() if line.strip())}


def nstat_counters(hosts):
    per_host = []
    for i in range(hosts):
        out = subprocess.run(["ip", "netns", "exec", ns(i), "nstat", "-asz"], capture_output=True, text=True,
                             check=True).stdout
        values = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in NSTAT_KEYS:
                values[parts[0]] = int(parts[1])
        per_host.append(values)
    return per_host


def counter_deltas(before_q, after_q, before_n, after_n):
    queues = []
    for name, a in after_q.items():
        b = before_q.get(name, {})
        queues.append({"queue": name, **{k: a[k] - b.get(k, 0) for k in ("sent_bytes", "sent_pkts", "dropped",
                                                                         "overlimits")}})
    hosts = [{k: a.get(k, 0) - b.get(k, 0) for k in NSTAT_KEYS} for b, a in zip(before_n, after_n)]
    return queues, hosts


def wire_summary(queues, hosts):
    """Totals over the host egress queues (where a host's own traffic waits) and the switch ports."""
    egress = [q for q in queues if q["queue"].endswith("-egress")]
    switch = [q for q in queues if not q["queue"].endswith("-egress")]
    sent = sum(q["sent_bytes"] for q in egress)
    pkts = sum(q["sent_pkts"] for q in egress)
    dropped = sum(q["dropped"] for q in egress)
    mean_pkt = sent / pkts if pkts else 0.0
    return {
        "egress_sent_bytes": sent,
        "egress_sent_pkts": pkts,
        "egress_dropped": dropped,
        "egress_overlimits": sum(q["overlimits"] for q in egress),
        "switch_dropped": sum(q["dropped"] for q in switch),
        "udp_rcvbuf_errors": sum(h["UdpRcvbufErrors"] for h in hosts),
        "udp_sndbuf_errors": sum(h["UdpSndbufErrors"] for h in hosts),
        "tcp_retrans_segs": sum(h["TcpRetransSegs"] for h in hosts),
        # Each packet lost on the way is sent again: dropped packets times the mean packet size.
        "lost_bytes_est": round((dropped + sum(q["dropped"] for q in switch)) * mean_pkt),
    }


# ---- jobs -----------------------------------------------------------------------------------------------

def run_ranks(commands, workdir, label, env_per_rank):
    """Starts commands[i] in host i's namespace with env_per_rank[i]; waits for all; returns their stdouts."""
    procs = []
    for i, cmd in enumerate(commands):
        env = dict(os.environ, **env_per_rank[i])
        log = open(os.path.join(workdir, f"{label}.rank{i}.log"), "w")
        proc = subprocess.Popen(["ip", "netns", "exec", ns(i), *cmd], env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        procs.append((proc, log))
    outs, failed = [], []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for i, (proc, log) in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failed.append(f"rank {i} timed out after {JOB_TIMEOUT_S}s")
        log.close()
        if proc.returncode != 0:
            failed.append(f"rank {i} exited with status {proc.returncode} (log: {log.name})")
        outs.append(out)
    if failed:
        raise RuntimeError(f"{label}: " + "; ".join(failed))
    return outs


class Bench:
    def __init__(self, args, workdir, binary):
        self.a = args
        self.workdir = workdir
        self.binary = binary
        self.secret = os.path.join(workdir, "secret")
        with open(os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        help_text = subprocess.run([binary, "train", "--help"], capture_output=True, text=True).stdout
        # One compute thread per rank: --threads where the build has it, else rayon's variable.
        self.thread_flags = ["--threads", "1"] if "--threads" in help_text else []
        self.port = 29600

    def next_port(self):
        self.port += 1
        return str(self.port)

    def rank_env(self, world, port):
        """Environment of the process in each host: one job over `world` hosts, or with world == 1 one
        independent single-rank job per host (the baseline under the same CPU load)."""
        ranks = range(world) if world > 1 else [0] * (1 if self.a.single_alone else self.a.hosts)
        return [{"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": port,
                 "RAYON_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"} for r in ranks]

    def ringtrain(self, world, label, overlap):
        a = self.a
        envs = self.rank_env(world, self.next_port())
        metrics = [os.path.join(self.workdir, f"{label}.h{i}.metrics.jsonl") for i in range(len(envs))]
        cmds = [[self.binary, "train", "--model", a.model, "--batch-size", str(a.batch_size), "--seq-len",
                 str(a.seq_len), "--steps", str(a.warmup + a.steps), "--backend", "cpu", "--secret-file",
                 self.secret, "--metrics", m, "--eval-batches", "1", "--bucket-mb", str(a.bucket_mb),
                 "--update", a.update, "--overlap", overlap, *self.thread_flags] for m in metrics]
        run_ranks(cmds, self.workdir, label, envs)
        # Rank 0 of a job writes the metrics: host 0's file, or every host's for the independent baselines.
        step_ms, comm_ms, exposed_ms = [], [], []
        for path in metrics[: 1 if world > 1 else len(metrics)]:
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            timed = [r for r in rows if r["step"] > a.warmup]
            if len(timed) != a.steps:
                raise RuntimeError(f"{label}: {path} has {len(timed)} timed steps, expected {a.steps}")
            step_ms += [r["step_ms"] for r in timed]
            comm_ms += [r["comm_ms"] for r in timed]
            exposed_ms += [r.get("exposed_comm_ms", r["comm_ms"]) for r in timed]
        return {"step_ms": step_ms, "comm_ms": comm_ms, "exposed_ms": exposed_ms, "last_loss": timed[-1]["loss"]}

    def ddp(self, world, label):
        a = self.a
        envs = self.rank_env(world, self.next_port())
        cmd = ["python3", os.path.join(HERE, "ddp.py"), "--model", a.model, "--batch-size", str(a.batch_size),
               "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", "1",
               "--bucket-mb", str(a.bucket_mb), "--tcp-stats"]
        outs = run_ranks([cmd] * len(envs), self.workdir, label, envs)
        # Rank 0 prints: host 0 of a job, every host for the independent baselines.
        res = [json.loads(out.strip().splitlines()[-1]) for out in outs if out.strip()]
        return {"step_ms": [t for r in res for t in r["step_ms"]], "last_loss": res[0]["last_loss"],
                "tcp": res[0].get("tcp")}

    def measure(self, rnd, impl, world):
        a = self.a
        label = f"r{rnd}-{impl}-w{world}"
        before = (qdisc_counters(), nstat_counters(a.hosts), loadavg())
        if impl.startswith("ringtrain"):
            res = self.ringtrain(world, label, "off" if impl == "ringtrain-off" else "on")
        else:
            res = self.ddp(world, label)
        queues, hosts = counter_deltas(before[0], qdisc_counters(), before[1], nstat_counters(a.hosts))
        step = statistics.median(res["step_ms"])
        tokens = world * a.batch_size * a.seq_len
        # Gradient bytes each rank must send per step: reduce-scatter + all-gather (ringtrain's default
        # sharded update) or ring all-reduce (Gloo) both move 2(N-1)/N of the f32 gradient.
        payload = 2 * (world - 1) * 4 * param_count(a.model) // world
        out = {
            "round": rnd,
            "impl": impl + ("" if world > 1 else "-single"),
            "hosts": world,
            "rate": a.rate,
            "step_ms_median": round(step, 3),
            "tokens_per_s": round(tokens / step * 1e3, 1),
            "payload_bytes_per_rank_step": payload,
        }
        if world > 1:
            out["goodput_mbit_step"] = round(payload * 8 / step / 1e3, 1)
        if "comm_ms" in res:
            comm = statistics.median(res["comm_ms"])
            out["comm_ms_median"] = round(comm, 3)
            if world > 1:
                out["goodput_mbit_comm"] = round(payload * 8 / comm / 1e3, 1)
                out["exposed_comm_ms_median"] = round(statistics.median(res["exposed_ms"]), 3)
        if world > 1:
            out["wire"] = wire_summary(queues, hosts)
            if res.get("tcp"):
                out["tcp"] = res["tcp"]
        out["last_loss"] = round(res["last_loss"], 4)
        out["step_ms"] = [round(x, 2) for x in res["step_ms"]]
        if "comm_ms" in res:
            out["comm_ms"] = [round(x, 2) for x in res["comm_ms"]]
        out["queues"] = queues if world > 1 else None
        out["load_before"] = before[2]
        out["load_after"] = loadavg()
        print(json.dumps(out), flush=True)
        return out


def summarise(results, hosts, rate):
    """Medians over rounds per implementation; added_ms_per_step is the median of each round's difference
    between the multi-host and the single-rank measurement of the same implementation."""
    for impl in ("ringtrain", "ringtrain-off", "ddp"):
        multi = [r for r in results if r["impl"] == impl]
        base = "ringtrain" if impl.startswith("ringtrain") else impl
        single = {r["round"]: r for r in results if r["impl"] == base + "-single"}
        if not multi:
            continue
        added = [m["step_ms_median"] - single[m["round"]]["step_ms_median"] for m in multi if m["round"] in single]
        s = {
            "summary": impl,
            "hosts": hosts,
            "rate": rate,
            "rounds": len(multi),
            "step_ms": median([m["step_ms_median"] for m in multi]),
            "single_step_ms": median([r["step_ms_median"] for r in single.values()]),
            "added_ms_per_step": median(added),
            "tokens_per_s": median([m["tokens_per_s"] for m in multi]),
            "goodput_mbit_step": median([m["goodput_mbit_step"] for m in multi]),
        }
        if impl.startswith("ringtrain"):
            s["comm_ms"] = median([m["comm_ms_median"] for m in multi])
            s["exposed_comm_ms"] = median([m["exposed_comm_ms_median"] for m in multi])
            s["exposed_share"] = round(s["exposed_comm_ms"] / s["comm_ms"], 3) if s["comm_ms"] else None
            s["goodput_mbit_comm"] = median([m["goodput_mbit_comm"] for m in multi])
        s["egress_dropped"] = [m["wire"]["egress_dropped"] for m in multi]
        s["lost_bytes_est"] = [m["wire"]["lost_bytes_est"] for m in multi]
        s["tcp_retrans_segs"] = [m["wire"]["tcp_retrans_segs"] for m in multi]
        if impl == "ddp":
            s["tcp_bytes_retrans"] = [(m.get("tcp") or {}).get("bytes_retrans") for m in multi]
        print(json.dumps(s), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hosts", type=int, help="emulated hosts (2-4)")
    ap.add_argument("rate", help="link rate, tc syntax: 200mbit, 1gbit")
    ap.add_argument("rounds", type=int)
    ap.add_argument("--steps", type=int, default=15, help="timed steps per run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--model", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb (default: %(default)s)")
    ap.add_argument("--update", choices=["replicated", "sharded"], default="replicated",
                    help="ringtrain's update; replicated all-reduces as DDP does (default: %(default)s)")
    ap.add_argument("--overlap", default="on,off", help="ringtrain runs: on, off or on,off (default: %(default)s)")
    ap.add_argument("--single-alone", action="store_true",
                    help="run the single-rank baselines in host 0 only, not in every host at once")
    a = ap.parse_args()
    if not 2 <= a.hosts <= 4 or a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        ap.error("HOSTS must be 2-4, ROUNDS and --steps positive, --warmup >= 0")
    overlaps = [o for o in a.overlap.split(",") if o]
    if not overlaps or any(o not in ("on", "off") for o in overlaps):
        ap.error("--overlap takes on, off or on,off")
    binary = os.environ.get("RINGTRAIN_BIN", os.path.join(ROOT, "target", "release", "ringtrain"))
    if not os.access(binary, os.X_OK):
        ap.error(f"{binary} not found: run `cargo build --release` (or set RINGTRAIN_BIN)")

    # SIGTERM unwinds like Ctrl-C, so the hosts are always removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    subprocess.run([HOSTS_SH, "up", str(a.hosts), a.rate], check=True)
    try:
        with tempfile.TemporaryDirectory(prefix="rt-hosts-") as workdir:
            bench = Bench(a, workdir, binary)
            print(json.dumps({"machine": f"{os.cpu_count()} cores", "kernel": os.uname().release,
                              "binary": binary, "thread_flags": bench.thread_flags or "RAYON_NUM_THREADS=1",
                              "hosts": a.hosts, "rate": a.rate, "steps": a.steps, "warmup": a.warmup,
                              "model": a.model, "batch": a.batch_size, "seq": a.seq_len, "bucket_mb": a.bucket_mb,
                              "update": a.update, "overlap": overlaps,
                              "single_baseline": "alone" if a.single_alone else f"{a.hosts} concurrent",
                              "queue_limit_bytes": int(os.environ.get("HOSTS_LIMIT", 1514000)),
                              "link_mtu": int(os.environ.get("HOSTS_MTU", 1500)),
                              "tcp_congestion_control": host_sysctl("net.ipv4.tcp_congestion_control")}),
                  flush=True)
            results = []
            ours = ["ringtrain" if o == "on" else "ringtrain-off" for o in overlaps]
            for rnd in range(1, a.rounds + 1):
                order = [ours, ["ddp"]] if rnd % 2 else [["ddp"], ours]
                for group in order:
                    # One single-rank baseline per trainer and round.
                    base = "ringtrain" if group[0].startswith("ringtrain") else "ddp"
                    results.append(bench.measure(rnd, base, 1))
                    for impl in (group if rnd % 2 else group[::-1]):
                        results.append(bench.measure(rnd, impl, a.hosts))
            summarise(results, a.hosts, a.rate)
    finally:
        subprocess.run([HOSTS_SH, "down"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
