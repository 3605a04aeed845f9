#!/usr/bin/env python3
"""The sim's network model against real ringtrain runs on emulated hosts: calibrate on 2 hosts at 1 Gbit/s,
predict 3 and 4 hosts at 200 Mbit/s and 1 Gbit/s without refitting.

    python3 bench/hosts/validate.py [--rounds 3] [--steps 15] [--warmup 5] [--model small] [--bucket-mb 1]

Needs root (bench/hosts/hosts.sh) and release binaries: `cargo build --release -p ringtrain -p ringtrain-sim`
(RINGTRAIN_BIN and RINGTRAIN_SIM_BIN override target/release/). Every training run has one rank per host, one
compute thread per rank, the CPU backend, `--overlap on`, the trainer's default sharded update and the same
`--bucket-mb`; the first --warmup steps are not timed.

Each round visits the configurations in turn (the order reverses every other round, so slow drift of the
machine's load spreads over all of them), bringing the hosts up at each rate and removing them after:
  2 x 1gbit   calibration: the training job; a single-rank job alone in host 0 (the compute the prediction
              is given); a small-message all-reduce over loopback and a UDP echo between two hosts (alpha)
  N x RATE    for N in 3, 4 and RATE in 200mbit, 1gbit: the training job; at 1gbit also N single-rank jobs at
              once, one per host (the compute of one rank while N ranks share the cores), and likewise 2
Then, from the medians over rounds:
  alpha  per ring hop: half the loopback all-reduce time of a 1 KiB message at 2 ranks (2 hops: the QUIC
         ring's software latency) + half the UDP round trip between hosts 0 and 1 (the emulated link)
  beta   the link rate times the payload share of the wire bytes (gradient bytes the ring must send over all
         steps / bytes that left the hosts' queues) measured in the 2 x 1gbit job: QUIC, UDP, IP and
         Ethernet headers, acknowledgements and setup traffic are the rest
  gamma  CPU seconds per byte sent, fitted (bisection) so that the sim's communication time at 2 x 1gbit
         equals the measured median comm_ms there
  compute  the single-rank step alone, split into forward / backward / update by the sim's own per-layer
         timing of the same model on the CPU backend (only the shares are taken from it)
  cores  not fitted: every emulated host runs on this machine, so the network gets `shared-cores=` this
         machine's core count (os.cpu_count()), and the sim slows compute and bounds the step accordingly
  rank CPU per byte  the CPU the 2 x 1gbit job used beyond 2 single-rank jobs run at once, per gradient
         byte sent (getrusage of the ranks): what communication costs the shared cores, on all of a rank's
         threads (`rank-cpu-per-byte=`), where gamma is only the sender's serial share
and runs `ringtrain-sim --timing-only` for every configuration with those numbers (and, for comparison,
without the shared cores, as if every host had cores of its own). Prints one JSON line per
measurement, one with the calibration, one per configuration with prediction, measurement and error, and
a Markdown table. The error of the 2 x 1gbit row is a fit residual, not a held-out check.
"""
import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import (HOSTS_SH, PRESETS, Bench, counter_deltas, loadavg, nstat_counters, ns,  # noqa: E402
                     param_count, qdisc_counters, wire_summary)

ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
CALIBRATION = (2, "1gbit")
HELD_OUT = [(3, "200mbit"), (3, "1gbit"), (4, "200mbit"), (4, "1gbit")]
RATE_BPS = {"200mbit": 200e6, "1gbit": 1e9}
ECHO_PORT = 9109
ECHO_PINGS = 200
GOAL = 0.15

# The UDP echo between two hosts: a server in host 1, a client in host 0 that prints the median round trip.
ECHO_SERVER = f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", {ECHO_PORT}))
for _ in range({ECHO_PINGS} + 20):
    data, peer = s.recvfrom(64)
    s.sendto(data, peer)
"""
ECHO_CLIENT = f"""
import socket, statistics, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1.0)
rtts = []
for i in range({ECHO_PINGS} + 20):
    t = time.perf_counter()
    s.sendto(b"x" * 16, (sys.argv[1], {ECHO_PORT}))
    s.recvfrom(64)
    if i >= 20:
        rtts.append(time.perf_counter() - t)
print(statistics.median(rtts))
"""


def median(xs):
    return statistics.median(xs) if xs else None


def children_cpu_s():
    """CPU seconds (user + system) of this process's waited-for children so far: the ranks of every job."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Hosts:
    """The emulated hosts this script brought up: `down` removes them only when `up` succeeded here, so a
    run refused because other hosts are up leaves those alone."""

    owned = False

    @classmethod
    def up(cls, hosts, rate):
        subprocess.run([HOSTS_SH, "up", str(hosts), rate], check=True)
        cls.owned = True

    @classmethod
    def down(cls):
        if cls.owned:
            subprocess.run([HOSTS_SH, "down"], check=False)
            cls.owned = False


def udp_rtt_s():
    """Median round trip of a 16-byte UDP datagram from host 0 to host 1 and back (userspace to userspace)."""
    server = subprocess.Popen(["ip", "netns", "exec", ns(1), "python3", "-c", ECHO_SERVER])
    try:
        time.sleep(0.3)
        out = subprocess.run(["ip", "netns", "exec", ns(0), "python3", "-c", ECHO_CLIENT, "10.77.0.2"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"UDP echo between hosts 0 and 1 failed: {out.stderr.strip()}")
        return float(out.stdout.strip())
    finally:
        server.kill()
        server.wait()


def quic_small_allreduce_s(binary):
    """Time of a 1 KiB all-reduce between 2 ranks over QUIC on loopback (`ringtrain bench allreduce`)."""
    out = subprocess.run([binary, "bench", "allreduce", "--nproc", "2", "--size", "1KiB", "--iters", "200"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, RAYON_NUM_THREADS="1"))
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] == "1" and parts[1] == "KiB":
            return float(parts[3]) * 1e-6
    raise RuntimeError(f"`ringtrain bench allreduce` printed no 1 KiB row:\n{out.stdout}{out.stderr}")


class Runs:
    """The measurements: training jobs through compare.Bench, and the alpha probes."""

    def __init__(self, a, workdir, binary):
        self.a = a
        self.binary = binary
        # compare.Bench reads these fields; hosts and single_alone change per measurement.
        self.opts = types.SimpleNamespace(hosts=2, single_alone=True, model=a.model, batch_size=a.batch_size,
                                          seq_len=a.seq_len, warmup=a.warmup, steps=a.steps,
                                          bucket_mb=a.bucket_mb, update="sharded")
        self.bench = Bench(self.opts, workdir, binary)
        self.results = []

    def record(self, rnd, kind, hosts, rate, **fields):
        row = {"round": rnd, "kind": kind, "hosts": hosts, "rate": rate, **fields}
        print(json.dumps(row), flush=True)
        self.results.append(row)

    def train(self, rnd, hosts, rate):
        self.opts.hosts = hosts
        before = (qdisc_counters(), nstat_counters(hosts), loadavg())
        cpu = children_cpu_s()
        res = self.bench.ringtrain(hosts, f"r{rnd}-train-{hosts}x{rate}", "on")
        cpu = children_cpu_s() - cpu
        queues, per_host = counter_deltas(before[0], qdisc_counters(), before[1], nstat_counters(hosts))
        wire = wire_summary(queues, per_host)
        # Gradient bytes the ring must send over the whole run, all hosts: reduce-scatter + all-gather each
        # move 2(N-1)/N of the f32 gradient per rank and step; warm-up steps included, as in the counters.
        payload = hosts * 2 * (hosts - 1) * 4 * param_count(self.a.model) // hosts * (self.a.warmup + self.a.steps)
        self.record(rnd, "train", hosts, rate, step_ms=median(res["step_ms"]), comm_ms=median(res["comm_ms"]),
                    exposed_ms=median(res["exposed_ms"]), payload_bytes=payload,
                    wire_bytes=wire["egress_sent_bytes"], cpu_s=cpu,
                    dropped=wire["egress_dropped"] + wire["switch_dropped"],
                    step_ms_all=[round(x, 2) for x in res["step_ms"]], load_before=before[2], load_after=loadavg())

    def single(self, rnd, copies, rate):
        """`copies` independent single-rank jobs at once, one per host (1: host 0 alone)."""
        self.opts.hosts = copies
        self.opts.single_alone = copies == 1
        load = loadavg()
        cpu = children_cpu_s()
        res = self.bench.ringtrain(1, f"r{rnd}-single-{copies}", "on")
        cpu = children_cpu_s() - cpu
        self.record(rnd, "single", copies, rate, step_ms=median(res["step_ms"]), cpu_s=cpu, load_before=load,
                    load_after=loadavg())

    def alpha_probes(self, rnd, rate):
        self.record(rnd, "alpha", 2, rate, udp_rtt_us=udp_rtt_s() * 1e6,
                    quic_1kib_allreduce_us=quic_small_allreduce_s(self.binary) * 1e6)

    def round(self, rnd, configs):
        for hosts, rate in configs:
            Hosts.up(hosts, rate)
            try:
                if (hosts, rate) == CALIBRATION:
                    self.single(rnd, 1, rate)
                    self.alpha_probes(rnd, rate)
                self.train(rnd, hosts, rate)
                if rate == "1gbit":
                    self.single(rnd, hosts, rate)
            finally:
                Hosts.down()


# ---- the sim ----------------------------------------------------------------------------------------------

PREDICTED = re.compile(r"compute ([\d.]+) ms \| communication ([\d.]+) ms \| exposed communication ([\d.]+) ms \| "
                       r"step ([\d.]+) ms")
PROFILE = re.compile(r"forward ([\d.]+) ms \| backward ([\d.]+) ms \| update ([\d.]+) ms")


class Sim:
    def __init__(self, binary, a):
        self.binary = binary
        self.a = a

    def base_cmd(self, workers, network):
        a = self.a
        return [self.binary, "--timing-only", "--workers", str(workers), "--model", a.model, "--batch-size",
                str(a.batch_size), "--seq-len", str(a.seq_len), "--bucket-mb", str(a.bucket_mb), "--update",
                "sharded", "--network", network]

    def run(self, cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, RAYON_NUM_THREADS="1"))
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr}")
        return out.stdout

    def compute_shares(self):
        """Forward / backward / update shares of one rank's compute, from the sim's per-layer timing."""
        out = self.run(self.base_cmd(1, "latency=1us,bandwidth=1Gbit"))
        m = PROFILE.search(out)
        if not m:
            raise RuntimeError(f"no compute profile in the sim's output:\n{out}")
        f, b, u = (float(x) for x in m.groups())
        total = f + b + u
        return {"forward": f / total, "backward": b / total, "update": u / total, "sim_total_ms": total}

    @staticmethod
    def network(alpha_s, beta_bytes_s, gamma_s_per_byte, shared_cores=None, rank_cpu_s_per_byte=None):
        cores = f",shared-cores={shared_cores}" if shared_cores else ""
        if shared_cores and rank_cpu_s_per_byte is not None:
            cores += f",rank-cpu-per-byte={rank_cpu_s_per_byte * 1e9:.4f}ns"
        return (f"latency={alpha_s * 1e6:.3f}us,bandwidth={beta_bytes_s / 1e6:.4f}MB,"
                f"cpu-per-byte={gamma_s_per_byte * 1e9:.4f}ns{cores}")

    @staticmethod
    def compute_flag(step_ms, shares):
        return (f"forward={step_ms * shares['forward']:.3f},backward={step_ms * shares['backward']:.3f},"
                f"update={step_ms * shares['update']:.3f}")

    def predict(self, workers, network, compute):
        cmd = self.base_cmd(workers, network) + ["--compute-ms", compute]
        out = self.run(cmd)
        m = PREDICTED.search(out)
        if not m:
            raise RuntimeError(f"no prediction in the sim's output:\n{out}")
        c, comm, exposed, step = (float(x) for x in m.groups())
        return {"compute_ms": c, "comm_ms": comm, "exposed_ms": exposed, "step_ms": step, "command": cmd}


def fit_gamma(sim, alpha, beta, compute, target_comm_ms, cores):
    """gamma such that the sim's communication at 2 ranks equals the measured comm_ms (it grows with gamma)."""
    lo, hi = 0.0, 200e-9
    if sim.predict(2, Sim.network(alpha, beta, lo, cores), compute)["comm_ms"] >= target_comm_ms:
        return 0.0
    for _ in range(24):
        mid = (lo + hi) / 2
        if sim.predict(2, Sim.network(alpha, beta, mid, cores), compute)["comm_ms"] < target_comm_ms:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def err(pred, meas):
    return (pred - meas) / meas if meas else None


def pct(x):
    return "—" if x is None else f"{x * 100:+.0f}%"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15, help="timed steps per run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    ap.add_argument("--model", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    a = ap.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        ap.error("--rounds and --steps must be positive, --warmup >= 0")
    binary = os.environ.get("RINGTRAIN_BIN", os.path.join(ROOT, "target", "release", "ringtrain"))
    sim_binary = os.environ.get("RINGTRAIN_SIM_BIN", os.path.join(ROOT, "target", "release", "ringtrain-sim"))
    for b in (binary, sim_binary):
        if not os.access(b, os.X_OK):
            ap.error(f"{b} not found: run `cargo build --release -p ringtrain -p ringtrain-sim`")
    sim = Sim(sim_binary, a)
    shares = sim.compute_shares()

    configs = [CALIBRATION, *HELD_OUT]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    print(json.dumps({"binary": binary, "sim": sim_binary, "model": a.model, "batch": a.batch_size,
                      "seq": a.seq_len, "steps": a.steps, "warmup": a.warmup, "bucket_mb": a.bucket_mb,
                      "update": "sharded", "overlap": "on", "rounds": a.rounds, "host": socket.gethostname(),
                      "cores": os.cpu_count(), "load": loadavg(), "compute_shares": shares}), flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="rt-validate-") as workdir:
            runs = Runs(a, workdir, binary)
            for rnd in range(1, a.rounds + 1):
                runs.round(rnd, configs if rnd % 2 else configs[::-1])
    finally:
        Hosts.down()
    results = runs.results

    def med(kind, hosts, key, rate=None):
        return median([r[key] for r in results if r["kind"] == kind and r["hosts"] == hosts
                       and (rate is None or r["rate"] == rate)])

    # ---- calibration on 2 x 1gbit ----
    chosts, crate = CALIBRATION
    alpha = (med("alpha", 2, "quic_1kib_allreduce_us") / 2 + med("alpha", 2, "udp_rtt_us") / 2) * 1e-6
    payload_share = med("train", chosts, "payload_bytes", crate) / med("train", chosts, "wire_bytes", crate)
    single_alone = med("single", 1, "step_ms")
    compute = Sim.compute_flag(single_alone, shares)
    measured_comm = med("train", chosts, "comm_ms", crate)
    beta_cal = RATE_BPS[crate] / 8 * payload_share
    cores = os.cpu_count()
    gamma = fit_gamma(sim, alpha, beta_cal, compute, measured_comm, cores)
    rank_cpu = max(0.0, med("train", chosts, "cpu_s", crate) - med("single", chosts, "cpu_s")) / med(
        "train", chosts, "payload_bytes", crate)
    calibration = {"calibration": f"{chosts}x{crate}", "alpha_us": round(alpha * 1e6, 2),
                   "payload_share": round(payload_share, 4), "gamma_ns_per_byte": round(gamma * 1e9, 3),
                   "beta_MB_s": {r: round(RATE_BPS[r] / 8 * payload_share / 1e6, 2) for r in RATE_BPS},
                   "single_alone_step_ms": round(single_alone, 2), "compute_ms": compute, "shared_cores": cores,
                   "rank_cpu_ns_per_byte": round(rank_cpu * 1e9, 3),
                   "measured_comm_ms_fitted": round(measured_comm, 2)}
    print(json.dumps(calibration), flush=True)

    # ---- prediction for every configuration, no refitting ----
    rows = []
    for hosts, rate in configs:
        beta = RATE_BPS[rate] / 8 * payload_share
        p = sim.predict(hosts, Sim.network(alpha, beta, gamma, cores, rank_cpu), compute)
        own_cores = Sim.network(alpha, beta, gamma)
        p_own = sim.predict(hosts, own_cores, compute)
        train = [r for r in results if r["kind"] == "train" and r["hosts"] == hosts and r["rate"] == rate]
        m = {k: median([r[k] for r in train]) for k in ("step_ms", "comm_ms", "exposed_ms")}
        # Diagnostics, not part of the prediction: the prediction without shared cores (each host its own
        # cores), one rank's step while N single-rank jobs share the cores, the sim given that compute
        # instead (without shared cores), the compute inside the job (step minus exposed communication), and
        # the CPU the job spent beyond N single-rank jobs, per gradient byte sent.
        contended = med("single", hosts, "step_ms")
        p_cont = sim.predict(hosts, own_cores, Sim.compute_flag(contended, shares))
        extra_cpu = median([r["cpu_s"] for r in train]) - med("single", hosts, "cpu_s")
        row = {"config": f"{hosts}x{rate}", "held_out": (hosts, rate) != CALIBRATION,
               "measured": {k: round(v, 1) for k, v in m.items()},
               "measured_step_per_round": [round(r["step_ms"], 1) for r in train],
               "predicted": {k: round(p[k], 1) for k in ("step_ms", "comm_ms", "exposed_ms")},
               "error": {k: round(err(p[k], m[k]), 3) for k in ("step_ms", "comm_ms", "exposed_ms")},
               "within_goal": abs(err(p["step_ms"], m["step_ms"])) <= GOAL,
               "predicted_step_without_shared_cores": round(p_own["step_ms"], 1),
               "error_step_without_shared_cores": round(err(p_own["step_ms"], m["step_ms"]), 3),
               "single_with_n_running_ms": round(contended, 1),
               "predicted_step_with_that_compute": round(p_cont["step_ms"], 1),
               "error_step_with_that_compute": round(err(p_cont["step_ms"], m["step_ms"]), 3),
               "job_compute_ms": round(m["step_ms"] - m["exposed_ms"], 1),
               "comm_cpu_ns_per_byte": round(extra_cpu / train[0]["payload_bytes"] * 1e9, 2),
               "dropped": [r["dropped"] for r in train], "sim_command": " ".join(p["command"])}
        print(json.dumps(row), flush=True)
        rows.append(row)

    print(f"\nmeasured {time.strftime('%H:%M', time.gmtime(started))}–{time.strftime('%H:%M', time.gmtime())} UTC, "
          f"load now {loadavg()}; single rank alone {single_alone:.1f} ms/step; alpha {alpha * 1e6:.1f} us, "
          f"payload share {payload_share:.3f}, gamma {gamma * 1e9:.2f} ns/byte; shared cores {cores}, rank CPU "
          f"{rank_cpu * 1e9:.2f} ns/byte")
    print("| hosts × rate | measured step / comm / exposed | step per round | predicted step / comm / exposed "
          "| error step / comm / exposed | step within 15% | without shared cores: predicted step, error "
          "| one rank with N running | predicted step with that, error | compute in the job | comm CPU ns/byte |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        m, p, e = r["measured"], r["predicted"], r["error"]
        label = r["config"].replace("x", " × ") + ("" if r["held_out"] else " (fit)")
        print(f"| {label} | {m['step_ms']:.1f} / {m['comm_ms']:.1f} / {m['exposed_ms']:.1f} | "
              f"{', '.join(f'{x:.0f}' for x in r['measured_step_per_round'])} | "
              f"{p['step_ms']:.1f} / {p['comm_ms']:.1f} / {p['exposed_ms']:.1f} | "
              f"{pct(e['step_ms'])} / {pct(e['comm_ms'])} / {pct(e['exposed_ms'])} | "
              f"{'yes' if r['within_goal'] else 'no'} | "
              f"{r['predicted_step_without_shared_cores']:.1f}, {pct(r['error_step_without_shared_cores'])} | "
              f"{r['single_with_n_running_ms']:.1f} | "
              f"{r['predicted_step_with_that_compute']:.1f}, {pct(r['error_step_with_that_compute'])} | "
              f"{r['job_compute_ms']:.1f} | {r['comm_cpu_ns_per_byte']:.1f} |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        sys.exit(f"validate: {' '.join(map(str, e.cmd))} exited with status {e.returncode} (its message is above)")
    except RuntimeError as e:
        sys.exit(f"validate: {e}")
