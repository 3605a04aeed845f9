#!/usr/bin/env bash
# The two-level ring on 2 emulated hosts of 2 ranks each: each host is a network namespace holding two
# ranks (`RANK` 2i and 2i+1), links shaped to RATE. Nothing tells the ranks which host they are on but their
# network namespace, so the check also proves that ranks are grouped by namespace, not by the machine they
# share. For each round it trains MODEL with `--collective flat` and with `--collective hierarchical`, and
# one worker on the same global batch on loopback, then
#   - requires the hierarchical run to say `two-level ring (2 hosts x 2 ranks)` and the flat one not to;
#   - runs with `--verify-every 1`, so any replica that differs from the others fails the run;
#   - requires the hierarchical losses within 1e-5 of the one worker's;
#   - prints the median tokens/s of both runs (steps after the first WARMUP) and their ratio.
# With ALLREDUCE=SIZES (e.g. 4KiB,64MiB) it also runs `ringtrain bench allreduce` on the same 4 ranks, flat
# and hierarchical, and prints both tables.
# With SIM=1 each round also trains one rank alone in host 0 (the compute the prediction is given), and the
# sim (RINGTRAIN_SIM_BIN, default target/release/ringtrain-sim) predicts both steps from it: `--compute-ms`
# is that step split by the sim's own per-layer shares, `--network` is SIM_NETWORK (default: the emulated
# link at RATE with the "With shared cores" calibration's gamma and rank CPU per byte, shared memory's
# measured terms inside a host, and this machine's cores split over the 2 hosts). Prints each prediction
# beside the measured median step and the error.
# Exits 1 if a check fails. Needs root and iproute2.
#
#   bench/hosts/two_level.sh [STEPS] [RATE] [ROUNDS] [MODEL]    defaults: 6 steps, 1gbit, 1 round, tiny
#   WARMUP=3 BATCH=4 SEQ=64 bench/hosts/two_level.sh 15 1gbit 3 small
#
# RINGTRAIN_BIN overrides the binary (default target/release/ringtrain).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
STEPS=${1:-6}
RATE=${2:-1gbit}
ROUNDS=${3:-1}
MODEL=${4:-tiny}
WARMUP=${WARMUP:-2}
BATCH=${BATCH:-4}
SEQ=${SEQ:-64}
for v in STEPS ROUNDS BATCH SEQ WARMUP; do
  [[ ${!v} =~ ^[0-9]+$ ]] && ((${!v} >= 1)) || hosts_die "$v must be a positive integer, got '${!v}'"
done
((WARMUP < STEPS)) || hosts_die "WARMUP ($WARMUP) must be below STEPS ($STEPS)"
hosts_job_setup two-level "$ROOT"

TRAIN=(train --model "$MODEL" --seq-len "$SEQ" --steps "$STEPS" --backend cpu --eval-batches 0)

hosts_up 2 "$RATE"
port=29700
for ((round = 1; round <= ROUNDS; round++)); do
  for collective in flat hierarchical; do
    port=$((port + 1))
    echo "== round $round: --collective $collective, 2 hosts x 2 ranks at $RATE"
    pids=()
    for rank in 0 1 2 3; do
      hosts_exec $((rank / 2)) env RANK=$rank WORLD_SIZE=4 LOCAL_RANK=$((rank % 2)) LOCAL_WORLD_SIZE=2 \
        MASTER_ADDR="$(hosts_addr 0)" MASTER_PORT=$port \
        "$RT" "${TRAIN[@]}" --threads 1 --batch-size "$BATCH" --collective "$collective" --verify-every 1 \
        --secret-file "$WORK/secret" --metrics "$WORK/$collective.$round.jsonl" \
        > "$WORK/$collective.$round.rank$rank.log" 2>&1 &
      pids+=($!)
    done
    failed=0
    for rank in 0 1 2 3; do
      wait "${pids[$rank]}" || {
        failed=1
        echo "rank $rank failed; its log:" >&2
        cat "$WORK/$collective.$round.rank$rank.log" >&2
      }
    done
    ((failed == 0)) || exit 1
    grep -h "ringtrain:" "$WORK/$collective.$round.rank0.log" | head -1
  done
  if [ -n "${SIM:-}" ]; then
    echo "== round $round: one rank alone in host 0 (the sim's compute)"
    hosts_exec 0 "$RT" "${TRAIN[@]}" --threads 1 --batch-size "$BATCH" --metrics "$WORK/single.$round.jsonl" \
      > "$WORK/single.$round.log" 2>&1 || { cat "$WORK/single.$round.log" >&2; hosts_die "the single-rank run failed"; }
  fi
  grep -q "two-level ring (2 hosts x 2 ranks)" "$WORK/hierarchical.$round.rank0.log" ||
    hosts_die "--collective hierarchical did not run a two-level ring of 2 hosts x 2 ranks"
  if grep -q "two-level ring" "$WORK/flat.$round.rank0.log"; then
    hosts_die "--collective flat ran a two-level ring"
  fi
done

if [ -n "${ALLREDUCE:-}" ]; then
  for collective in flat hierarchical; do
    port=$((port + 1))
    echo "== bench allreduce --size $ALLREDUCE --collective $collective, 2 hosts x 2 ranks at $RATE"
    pids=()
    for rank in 0 1 2 3; do
      hosts_exec $((rank / 2)) env RINGTRAIN_BENCH_RANK=$rank MASTER_ADDR="$(hosts_addr 0)" MASTER_PORT=$port \
        RINGTRAIN_SECRET="$(cat "$WORK/secret")" \
        "$RT" bench allreduce --nproc 4 --size "$ALLREDUCE" --iters "${ITERS:-10}" --collective "$collective" \
        > "$WORK/allreduce.$collective.rank$rank.log" 2>&1 &
      pids+=($!)
    done
    for rank in 0 1 2 3; do
      wait "${pids[$rank]}" || { cat "$WORK/allreduce.$collective.rank$rank.log" >&2; hosts_die "bench allreduce rank $rank failed"; }
    done
    grep -v "^[[:space:]]*$" "$WORK/allreduce.$collective.rank0.log" | grep -E "^#|^ " || true
  done
fi

echo "== one worker on the global batch (loopback)"
"$RT" "${TRAIN[@]}" --threads 2 --batch-size $((4 * BATCH)) --metrics "$WORK/one.jsonl" > "$WORK/one.log" 2>&1 ||
  { cat "$WORK/one.log" >&2; hosts_die "the one-worker run failed"; }

SIM_BIN=${RINGTRAIN_SIM_BIN:-$ROOT/target/release/ringtrain-sim}
if [ -n "${SIM:-}" ] && [ ! -x "$SIM_BIN" ]; then
  hosts_die "$SIM_BIN not found: run 'cargo build --release -p ringtrain-sim' (or set RINGTRAIN_SIM_BIN)"
fi
# gamma 4.8 ns and rank CPU 9 ns per byte between hosts: the "With shared cores" calibration (BENCHMARKS.md);
# inside a host shared memory's measured latency and CPU per byte (sim/src/netmodel/network.rs).
CORES_PER_HOST=$(($(nproc) / 2 > 0 ? $(nproc) / 2 : 1))
case $RATE in
  *gbit) LINK=${RATE%gbit}Gbit ;;
  *mbit) LINK=${RATE%mbit}Mbit ;;
  *) LINK=$RATE ;;
esac
SIM_NETWORK=${SIM_NETWORK:-latency=50us,bandwidth=$LINK,cpu-per-byte=4.8ns,hosts-of=2,intra-latency=32us,intra-bandwidth=1000GB,intra-cpu-per-byte=0.21ns,shared-cores=$CORES_PER_HOST,rank-cpu-per-byte=9ns}

SIM=${SIM:-} SIM_BIN=$SIM_BIN SIM_NETWORK=$SIM_NETWORK BATCH=$BATCH SEQ=$SEQ \
python3 - "$WORK" "$ROUNDS" "$STEPS" "$WARMUP" "$RATE" "$MODEL" << 'EOF'
import json, os, re, statistics, subprocess, sys

work, rounds, steps, warmup, rate, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]

def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and '"loss"' in line]

one = records(f"{work}/one.jsonl")
tps = {"flat": [], "hierarchical": []}
bad = 0
for r in range(1, rounds + 1):
    for c in tps:
        recs = records(f"{work}/{c}.{r}.jsonl")
        if len(recs) != steps:
            sys.exit(f"FAIL: {c} round {r}: {len(recs)} steps recorded, expected {steps}")
        tps[c].append(statistics.median(x["tokens_per_s"] for x in recs[warmup:]))
    for a, b in zip(records(f"{work}/hierarchical.{r}.jsonl"), one):
        if abs(a["loss"] - b["loss"]) > 1e-5:
            bad += 1
            print(f"step {a['step']}: hierarchical loss {a['loss']} against one worker's {b['loss']}")
flat, hier = statistics.median(tps["flat"]), statistics.median(tps["hierarchical"])
print(f"{model} at {rate}, {rounds} round(s), median tokens/s of steps {warmup + 1}..{steps}:")
print(f"  flat ring       {flat:10.0f}   per round {[round(x) for x in tps['flat']]}")
print(f"  two-level ring  {hier:10.0f}   per round {[round(x) for x in tps['hierarchical']]}")
print(f"  two-level / flat = {hier / flat:.2f}x")
if os.environ.get("SIM"):
    def sim(*args):
        cmd = [os.environ["SIM_BIN"], "--timing-only", "--model", model, "--batch-size", os.environ["BATCH"],
               "--seq-len", os.environ["SEQ"], *args]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, RAYON_NUM_THREADS="1"))
        if out.returncode != 0:
            sys.exit(f"FAIL: {' '.join(cmd)}:\n{out.stderr}")
        return cmd, out.stdout
    _, out = sim("--workers", "1", "--network", "latency=1us,bandwidth=1Gbit")
    f, b, u = (float(x) for x in re.search(r"forward ([\d.]+) ms \| backward ([\d.]+) ms \| update ([\d.]+) ms", out).groups())
    single = statistics.median(x["step_ms"] for r in range(1, rounds + 1) for x in records(f"{work}/single.{r}.jsonl")[warmup:])
    total = f + b + u
    compute = f"forward={single * f / total:.3f},backward={single * b / total:.3f},update={single * u / total:.3f}"
    print(f"one rank alone: {single:.1f} ms per step (the sim's compute: {compute})")
    for c in ("flat", "hierarchical"):
        measured = statistics.median(x["step_ms"] for r in range(1, rounds + 1) for x in records(f"{work}/{c}.{r}.jsonl")[warmup:])
        cmd, out = sim("--workers", "4", "--network", os.environ["SIM_NETWORK"], "--collective", c, "--compute-ms", compute)
        predicted = float(re.search(r"step ([\d.]+) ms", out).group(1))
        print(f"  {c:13s} measured {measured:7.1f} ms, predicted {predicted:7.1f} ms: {100 * (predicted - measured) / measured:+.0f}%")
    print(f"  sim: {' '.join(cmd[:-1])} <compute>")
if bad:
    sys.exit(f"FAIL: {bad} steps of the two-level run differ from one worker by more than 1e-5")
print(f"OK: the two-level ring grouped the ranks by namespace, kept replicas identical and matched one worker within 1e-5")
EOF
