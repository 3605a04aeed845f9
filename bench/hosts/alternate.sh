#!/usr/bin/env bash
# Alternates ringtrain builds (or settings) on the same 2 emulated hosts: one 2-rank job per build per round,
# `small` at batch 64 x 128, one compute thread per rank, then each build's medians over rounds of its median
# step, comm and exposed comm (ms). For A/B checks of transport or trainer changes, where the
# single-rank baselines are the same code and compare.py's DDP runs are not needed. Needs root.
#
#   bench/hosts/alternate.sh RATE ROUNDS LABEL=BINARY[:VAR=VALUE,...] ...
#   e.g. bench/hosts/alternate.sh 200mbit 5 before=/tmp/ringtrain-before after=target/release/ringtrain
#
# Environment: BUCKET_MB (default 0.125), UPDATE (replicated), OVERLAP (on), STEPS (10 timed, after 3
# warm-up), HOSTS_MTU as in lib.sh. Each job's metrics and logs stay in a temporary folder, named at the end.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 3 ] || { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
rate=$1 rounds=$2
shift 2
for spec in "$@"; do
  bin=${spec#*=}
  bin=${bin%%:*}
  [ "$spec" != "${spec#*=}" ] && [ -x "$bin" ] || { echo "alternate: '$spec' is not LABEL=BINARY (executable)" >&2; exit 2; }
done
work=$(mktemp -d)
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/secret"
chmod 600 "$work/secret"
"$HERE/hosts.sh" up 2 "$rate"
trap '"$HERE/hosts.sh" down' EXIT
port=29800
for ((r = 1; r <= rounds; r++)); do
  for spec in "$@"; do
    label=${spec%%=*} rest=${spec#*=}
    bin=${rest%%:*} vars=()
    [ "$rest" != "$bin" ] && IFS=, read -r -a vars <<< "${rest#*:}"
    port=$((port + 1))
    pids=()
    for i in 0 1; do
      ip netns exec "rt-h$i" env RANK=$i WORLD_SIZE=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=$port RAYON_NUM_THREADS=1 \
        "${vars[@]}" "$bin" train --model small --batch-size 64 --seq-len 128 --steps $((3 + ${STEPS:-10})) \
        --backend cpu --secret-file "$work/secret" --metrics "$work/$label.r$r.h$i.jsonl" --eval-batches 1 \
        --bucket-mb "${BUCKET_MB:-0.125}" --update "${UPDATE:-replicated}" --overlap "${OVERLAP:-on}" --threads 1 \
        > "$work/$label.r$r.h$i.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || { echo "alternate: $label round $r failed, see $work" >&2; exit 1; }; done
  done
done
python3 - "$work" "$@" <<'PY'
import glob, json, statistics, sys
work = sys.argv[1]
for spec in sys.argv[2:]:
    label = spec.split("=")[0]
    rounds = []
    paths = glob.glob(f"{work}/{label}.r*.h0.jsonl")
    for path in sorted(paths, key=lambda p: int(p.rsplit(".r", 1)[1].split(".")[0])):
        timed = [json.loads(l) for l in open(path) if l.strip()]
        timed = [t for t in timed if t["step"] > 3]
        rounds.append([statistics.median(t[k] for t in timed) for k in ("step_ms", "comm_ms", "exposed_comm_ms")])
    med = [statistics.median(r[i] for r in rounds) for i in range(3)]
    print(f"{label}: step {med[0]:.1f} comm {med[1]:.1f} exposed {med[2]:.1f} ms (medians of {len(rounds)} rounds);"
          f" steps per round {' '.join(f'{r[0]:.1f}' for r in rounds)}")
PY
echo "alternate: metrics and logs in $work"
