#!/usr/bin/env bash
# --sync outer against every-step sync across emulated hosts (one rank per host, links shaped to RATE):
# tokens/s of each, beside N x the single-rank tokens/s measured as bench/hosts/compare.py measures it (a
# single-rank job in every host at once: the same per-rank batch and the same busy cores), and the
# validation loss each reaches after STEPS steps; every-step sync also with the gradients sent as bf16 and
# int8 (`--wire`), and outer mode also with `--outer-overlap on`. Where torch and transformers import, also
# PyTorch DDP (bench/hosts/ddp.py over Gloo, DDP_STEPS timed steps, default 100, and its own single-rank
# baseline measured the same way): tokens/s only, on random tokens. Needs root (bench/hosts/README.md).
#
#   bench/outer/hosts.sh [HOSTS] [RATE] [STEPS] [H]     defaults: 2 hosts, 50mbit, 200 steps, H = 50
#
# tokens/s is the median of the steps' own figures after the first tenth (outer mode: whole rounds of H
# steps, so its outer steps count at their share). RINGTRAIN_BIN overrides the binary; WIRES (default
# "bf16 int8") the compact formats run; OUTER_EVERY (default H) the values of --outer-every run, each
# plain and overlapped; DATA a corpus directory (`ringtrain tokenize --tokenizer byte` output) instead of
# the built-in one.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=../hosts/lib.sh
. "$ROOT/bench/hosts/lib.sh"
N=${1:-2}
RATE=${2:-50mbit}
STEPS=${3:-200}
H=${4:-50}
OUTER_EVERY=${OUTER_EVERY:-$H}
for h in $OUTER_EVERY; do
  ((STEPS % h == 0)) || hosts_die "STEPS ($STEPS) must be a multiple of every H ($h)"
done
hosts_job_setup outer "$ROOT"
TRAIN=(train --model small --batch-size 8 --seq-len 128 --steps "$STEPS" --eval-every "$STEPS" --eval-batches 16
  --update replicated --threads 1 --backend cpu)
if [ -n "${DATA:-}" ]; then TRAIN+=(--data "$DATA"); fi

hosts_up "$N" "$RATE"
job() { # NAME FLAGS...
  local name=$1 pids=() i
  shift
  for ((i = 0; i < N; i++)); do
    hosts_exec "$i" env RANK=$i WORLD_SIZE="$N" MASTER_ADDR="$(hosts_addr 0)" MASTER_PORT=29660 \
      "$RT" "${TRAIN[@]}" "$@" --secret-file "$WORK/secret" --metrics "$WORK/$name.jsonl" > "$WORK/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < N; i++)); do
    wait "${pids[$i]}" || { cat "$WORK/$name.$i.log" >&2; hosts_die "$name: host $i failed"; }
  done
}
# singles NAME CMD...: CMD as a single-rank job in every host at once, each {i} in its arguments replaced by
# the host's index; host I's output in NAME.I.out.
singles() {
  local name=$1 pids=() i
  shift
  for ((i = 0; i < N; i++)); do
    hosts_exec "$i" env WORLD_SIZE=1 RANK=0 RAYON_NUM_THREADS=1 "${@//\{i\}/$i}" > "$WORK/$name.$i.out" \
      2> "$WORK/$name.$i.log" &
    pids+=($!)
  done
  for ((i = 0; i < N; i++)); do
    wait "${pids[$i]}" || { cat "$WORK/$name.$i.log" >&2; hosts_die "$name: host $i failed"; }
  done
}
echo "== a single-rank job in each of the $N hosts at once"
singles single "$RT" "${TRAIN[@]}" --metrics "$WORK/single.{i}.jsonl"
echo "== every-step sync on $N hosts at $RATE"
job every
WIRES=${WIRES-bf16 int8}
for wire in $WIRES; do
  echo "== every-step sync with --wire $wire on $N hosts at $RATE"
  job "every-$wire" --wire "$wire"
done
for h in $OUTER_EVERY; do
  echo "== --sync outer --outer-every $h on $N hosts at $RATE"
  job "outer-$h" --sync outer --outer-every "$h"
  echo "== --sync outer --outer-every $h --outer-overlap on on $N hosts at $RATE"
  job "outer-overlap-$h" --sync outer --outer-every "$h" --outer-overlap on
done

DDP=()
if python3 -c "import torch, transformers" 2> /dev/null; then
  DDP=(python3 "$ROOT/bench/hosts/ddp.py" --model small --batch-size 8 --seq-len 128 --steps "${DDP_STEPS:-100}"
    --warmup 10 --threads 1 --bucket-mb 1)
  echo "== PyTorch DDP: a single-rank job in each host at once, then one rank per host over Gloo"
  singles ddp-single "${DDP[@]}"
  pids=()
  for ((i = 0; i < N; i++)); do
    hosts_exec "$i" env RANK=$i WORLD_SIZE="$N" MASTER_ADDR="$(hosts_addr 0)" MASTER_PORT=29670 \
      GLOO_SOCKET_IFNAME=eth0 RAYON_NUM_THREADS=1 "${DDP[@]}" > "$WORK/ddp.$i.out" 2> "$WORK/ddp.$i.log" &
    pids+=($!)
  done
  for ((i = 0; i < N; i++)); do
    wait "${pids[$i]}" || { cat "$WORK/ddp.$i.log" >&2; hosts_die "ddp: host $i failed"; }
  done
else
  echo "== PyTorch DDP left out: torch and transformers do not import (scripts/requirements.txt)"
fi

python3 - "$WORK" "$N" "$RATE" "$STEPS" "$OUTER_EVERY" $WIRES << 'PY'
import json, statistics, sys
work, n, rate, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
hs, wires = sys.argv[5].split(), sys.argv[6:]

def read(name):
    rows = [json.loads(line) for line in open(f"{work}/{name}.jsonl")]
    tail = rows[len(rows) // 10:]
    tps = statistics.median(r["tokens_per_s"] for r in tail)
    val = next((r["val_loss"] for r in reversed(rows) if r.get("val_loss") is not None), float("nan"))
    sent = sum(r.get("sent_bytes", 0) for r in rows) / len(rows)
    # Outer mode: a round's tokens over its steps' time, so the outer step weighs in.
    ms = sum(r["step_ms"] for r in tail)
    tokens = sum(r["tokens_per_s"] * r["step_ms"] / 1e3 for r in tail)
    return tps, tokens / (ms / 1e3), val, sent

singles = [read(f"single.{i}") for i in range(n)]
single = statistics.mean(s[1] for s in singles)
single_val = singles[0][2]
print(f"{n} hosts at {rate}, small 8 x 128 per rank, {steps} steps; a single-rank job in each host at once "
      f"made {single:,.0f} tokens/s each (" + ", ".join(f"{s[1]:,.0f}" for s in singles)
      + f"), so N x single = {n * single:,.0f}")
runs = [("every", "every-step")] + [(f"every-{w}", f"every {w}") for w in wires]
for h in hs:
    runs += [(f"outer-{h}", f"outer H={h}"), (f"outer-overlap-{h}", f"overlap H={h}")]
for name, label in runs:
    median, mean, val, sent = read(name)
    print(f"{label:12s} {mean:,.0f} tokens/s over the steps ({mean / (n * single):.2f}x N x single; median step "
          f"{median:,.0f}), val loss {val:.4f}, sent {sent / 1e6:.3f} MB/step per rank")
print(f"a single rank: val loss {single_val:.4f} (its global batch is 1/{n} of the others')")

def ddp(name):
    """The JSON line each host printed (the ranks other than a job's rank 0 print nothing)."""
    outs = [open(f"{work}/{name}.{i}.out").read().strip() for i in range(n)]
    return [json.loads(out.splitlines()[-1]) for out in outs if out]
try:
    ddp_single = ddp("ddp-single")
    ddp_job = ddp("ddp")[0]
except FileNotFoundError:
    sys.exit(0)
each = statistics.mean(r["tokens_per_s"] for r in ddp_single)
print(f"PyTorch DDP  {ddp_job['tokens_per_s']:,.0f} tokens/s ({ddp_job['tokens_per_s'] / (n * single):.2f}x "
      f"ringtrain's N x single; {ddp_job['tokens_per_s'] / (n * each):.2f}x DDP's own N x single, "
      f"{each:,.0f} tokens/s each), {ddp_job['ms_per_step_median']:.1f} ms/step median over "
      f"{len(ddp_job['step_ms'])} steps")
PY
