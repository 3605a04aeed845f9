#!/usr/bin/env bash
# --sync outer against every-step sync across emulated hosts (one rank per host, links shaped to RATE):
# tokens/s of each, beside N x the tokens/s of one rank alone on host 0 (the same per-rank batch), and the
# validation loss each reaches after STEPS steps; every-step sync also with the gradients sent as bf16 and
# int8 (`--wire`), and outer mode also with `--outer-overlap on`. Needs root (see bench/hosts/README.md).
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
echo "== one rank alone on host 0"
hosts_exec 0 "$RT" "${TRAIN[@]}" --metrics "$WORK/single.jsonl" > "$WORK/single.log" 2>&1 ||
  { cat "$WORK/single.log" >&2; hosts_die "the single rank failed"; }
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

single, _, single_val, _ = read("single")
print(f"{n} hosts at {rate}, small 8 x 128 per rank, {steps} steps; one rank alone {single:,.0f} tokens/s, "
      f"so N x single = {n * single:,.0f}")
runs = [("every", "every-step")] + [(f"every-{w}", f"every {w}") for w in wires]
for h in hs:
    runs += [(f"outer-{h}", f"outer H={h}"), (f"outer-overlap-{h}", f"overlap H={h}")]
for name, label in runs:
    median, mean, val, sent = read(name)
    print(f"{label:12s} {mean:,.0f} tokens/s over the steps ({mean / (n * single):.2f}x N x single; median step "
          f"{median:,.0f}), val loss {val:.4f}, sent {sent / 1e6:.3f} MB/step per rank")
print(f"one rank alone: val loss {single_val:.4f} (its global batch is 1/{n} of the others')")
PY
