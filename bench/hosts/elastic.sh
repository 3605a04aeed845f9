#!/usr/bin/env bash
# Elastic jobs across emulated hosts (`train --elastic --update replicated`, `tiny`), two checks:
#
#  1. recovery: 3 hosts, one rank each; rank 2 is killed with SIGKILL after KILL_AFTER steps. The two others
#     must re-form and finish every step. Prints the time from the kill to the new group's first step,
#     `recovery_ms` (from the failed collective to the end of that step) and the difference, the detection
#     time (the QUIC idle timeout: a third of --timeout).
#  2. partition: 4 ranks on 2 hosts (2 per host); after KILL_AFTER steps host 1's switch port goes down.
#     Neither side is a strict majority, so neither may go on: every rank must exit non-zero before the last
#     step.
#
#   bench/hosts/elastic.sh [STEPS] [RATE] [KILL_AFTER]     defaults: 400 steps, 1gbit, 20
#
# Needs root. RINGTRAIN_BIN overrides the binary (default target/release/ringtrain).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
STEPS=${1:-400}
RATE=${2:-1gbit}
KILL_AFTER=${3:-20}
[[ $STEPS =~ ^[0-9]+$ ]] && ((STEPS >= 2)) || hosts_die "STEPS must be an integer of at least 2, got '$STEPS'"
[[ $KILL_AFTER =~ ^[0-9]+$ ]] && ((KILL_AFTER < STEPS)) || hosts_die "KILL_AFTER must be below STEPS"
hosts_job_setup elastic "$ROOT"
TIMEOUT=6
TRAIN=(train --model tiny --batch-size 2 --seq-len 32 --steps "$STEPS" --backend cpu --threads 1 --eval-every 0
  --update replicated --elastic --timeout "$TIMEOUT" --secret-file "$WORK/secret")

# steps_in FILE: metrics lines written so far.
steps_in() { [ -e "$1" ] && wc -l < "$1" || echo 0; }

# wait_for_steps FILE N PIDS...: until FILE has N lines, or fail if every pid has exited.
wait_for_steps() {
  local file=$1 n=$2
  shift 2
  until (($(steps_in "$file") >= n)); do
    kill -0 "$@" 2> /dev/null || hosts_die "the job ended before step $n"
    sleep 0.02
  done
}

# start_rank HOST RANK WORLD LOCAL: one rank in host HOST's namespace, in the background; sets PID (the
# waitable process) and TRAINER (the ringtrain process itself, which `ip netns exec` may run as a child).
start_rank() {
  local host=$1 rank=$2 world=$3 local_world=$4 pidfile="$WORK/$NAME-rank$2.pid"
  hosts_exec "$host" env RANK="$rank" WORLD_SIZE="$world" LOCAL_WORLD_SIZE="$local_world" \
    MASTER_ADDR="$(hosts_addr 0)" MASTER_PORT=29651 \
    bash -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$RT" "${TRAIN[@]}" --metrics "$WORK/$NAME.jsonl" \
    > "$WORK/$NAME-rank$rank.log" 2>&1 &
  PID=$!
  until [ -s "$pidfile" ]; do sleep 0.01; done
  TRAINER=$(cat "$pidfile")
}

echo "== recovery: 3 emulated hosts at $RATE, rank 2 killed (SIGKILL) after $KILL_AFTER steps, --timeout $TIMEOUT"
hosts_up 3 "$RATE"
NAME=recovery
pids=()
trainers=()
for i in 0 1 2; do
  start_rank "$i" "$i" 3 1
  pids+=("$PID")
  trainers+=("$TRAINER")
done
wait_for_steps "$WORK/recovery.jsonl" "$KILL_AFTER" "${pids[@]}"
kill -KILL "${trainers[2]}"
killed_at=$(date +%s.%N)
# Until rank 0's metrics record the change.
until grep -q '"membership"' "$WORK/recovery.jsonl"; do
  kill -0 "${pids[0]}" 2> /dev/null || { cat "$WORK/recovery-rank0.log" >&2; hosts_die "rank 0 ended without re-forming"; }
  sleep 0.01
done
seen_at=$(date +%s.%N)
failed=0
for i in 0 1; do
  wait "${pids[$i]}" || { failed=1; echo "rank $i failed; its log:" >&2; cat "$WORK/recovery-rank$i.log" >&2; }
done
wait "${pids[2]}" 2> /dev/null || true
((failed == 0)) || exit 1
python3 - "$WORK/recovery.jsonl" "$STEPS" "$killed_at" "$seen_at" << 'EOF'
import json, sys
path, steps, killed, seen = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
records = [json.loads(line) for line in open(path)]
assert records[-1]["step"] == steps, f"rank 0 stopped at step {records[-1]['step']} of {steps}"
change = next(r for r in records if r.get("membership"))
m = change["membership"]
assert m["members"] == [0, 1], m
total = (seen - killed) * 1e3
print(f"kill to the new group's first step: {total:.0f} ms; recovery_ms {m['recovery_ms']:.0f} "
      f"(of which the step itself {change['step_ms']:.0f} ms); detection about {total - m['recovery_ms']:.0f} ms")
print(f"OK: the 2 survivors re-formed (epoch {m['epoch']}, continued from step {m['resumed_from_step']}) "
      f"and finished {steps} steps")
EOF
hosts_down

echo "== partition: 4 ranks on 2 emulated hosts at $RATE (ranks 0-1 on host 0, 2-3 on host 1), host 1 cut off after $KILL_AFTER steps"
hosts_up 2 "$RATE"
NAME=partition
pids=()
for rank in 0 1 2 3; do
  start_rank $((rank / 2)) "$rank" 4 2
  pids+=("$PID")
done
wait_for_steps "$WORK/partition.jsonl" "$KILL_AFTER" "${pids[@]}"
ip -n "$HOSTS_SWITCH" link set p1 down
cut_at=$(date +%s.%N)
went_on=()
for rank in 0 1 2 3; do
  if wait "${pids[$rank]}"; then went_on+=("$rank"); fi
done
ended_at=$(date +%s.%N)
for rank in 0 1 2 3; do
  echo "rank $rank: $(grep '^error:' "$WORK/partition-rank$rank.log" | tail -1)"
done
((${#went_on[@]} == 0)) || hosts_die "rank(s) ${went_on[*]} went on after a 2 + 2 partition"
python3 -c "import sys; print(f'every rank stopped {(float(sys.argv[2]) - float(sys.argv[1])):.1f} s after the cut')" \
  "$cut_at" "$ended_at"
echo "OK: neither side of the 2 + 2 partition went on"
