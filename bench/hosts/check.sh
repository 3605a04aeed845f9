#!/usr/bin/env bash
# Correctness across hosts: trains `tiny` data-parallel on 2 emulated hosts (one rank per host, each in its
# own network namespace, links shaped to RATE) and the same job on loopback with `ringtrain launch --nproc 2`,
# then compares the per-step loss and gradient norm of the two runs. They must be bit-identical (the ring's
# reduction order does not depend on the transport's timing); prints both columns and exits 1 if they differ.
# With HOSTS_MTU above 1500 (jumbo frames) it also exits 1 unless host 0's frames average more than a
# standard Ethernet frame (1514 bytes): QUIC's MTU discovery must find the larger path. Needs root. Took 3-6 s
# on the 2-core VM under a load of 7-9.
#
#   bench/hosts/check.sh [STEPS] [RATE]      defaults: 6 steps, 1gbit
#   HOSTS_MTU=9000 bench/hosts/check.sh
#
# RINGTRAIN_BIN overrides the binary (default target/release/ringtrain).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
STEPS=${1:-6}
RATE=${2:-1gbit}
[[ $STEPS =~ ^[0-9]+$ ]] && ((STEPS >= 1)) || hosts_die "STEPS must be a positive integer, got '$STEPS'"
hosts_job_setup check "$ROOT"

TRAIN=(train --model tiny --batch-size 4 --seq-len 64 --steps "$STEPS" --backend cpu --eval-batches 1)

hosts_up 2 "$RATE"
echo "== loopback: ringtrain launch --nproc 2 -- ${TRAIN[*]}"
"$RT" launch --nproc 2 -- "${TRAIN[@]}" --metrics "$WORK/loopback.jsonl" > "$WORK/loopback.log" 2>&1 ||
  { cat "$WORK/loopback.log" >&2; hosts_die "the loopback run failed"; }

echo "== 2 emulated hosts at $RATE"
pids=()
for i in 0 1; do
  hosts_exec "$i" env RANK=$i WORLD_SIZE=2 MASTER_ADDR="$(hosts_addr 0)" MASTER_PORT=29650 \
    "$RT" "${TRAIN[@]}" --secret-file "$WORK/secret" --metrics "$WORK/hosts.jsonl" > "$WORK/host$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in 0 1; do
  wait "${pids[$i]}" || { failed=1; echo "host $i failed; its log:" >&2; cat "$WORK/host$i.log" >&2; }
done
((failed == 0)) || exit 1

# Host 0's egress queue since `hosts_up`: only the job's traffic (and a few neighbour lookups) crossed it.
read -r sent_bytes sent_pkts < <(hosts_tbf_counters "$(hosts_ns 0)" eth0 h0-egress |
  python3 -c 'import json, sys; q = json.load(sys.stdin); print(q["sent_bytes"], q["sent_pkts"])')
avg_frame=$((sent_bytes / (sent_pkts > 0 ? sent_pkts : 1)))
echo "host 0 sent $sent_bytes bytes in $sent_pkts frames (average $avg_frame bytes) over a $HOSTS_MTU-byte MTU"
if ((HOSTS_MTU > 1500 && avg_frame <= 1514)); then
  hosts_die "the link takes $HOSTS_MTU-byte frames, but host 0's averaged $avg_frame bytes: MTU discovery stopped at Ethernet's 1500"
fi

# The metrics writer prints floats in their shortest round-trip form, so equal text is equal bits.
python3 - "$WORK/loopback.jsonl" "$WORK/hosts.jsonl" "$STEPS" << 'EOF'
import json, sys

def steps(path):
    with open(path) as f:
        text = f.read()
    # Keep the exact text of each float, not a re-rounded copy.
    return [json.loads(line, parse_float=str) for line in text.splitlines() if line.strip()]

loop, hosts, want = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3])
print(f"{'step':>4}  {'loss (loopback)':>22} {'loss (hosts)':>22}  {'grad_norm (loopback)':>22} {'grad_norm (hosts)':>22}")
bad = 0
for a, b in zip(loop, hosts):
    same = a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    bad += not same
    print(f"{a['step']:>4}  {a['loss']:>22} {b['loss']:>22}  {a['grad_norm']:>22} {b['grad_norm']:>22}"
          + ("" if same else "  DIFFERENT"))
if len(loop) != want or len(hosts) != want:
    sys.exit(f"FAIL: expected {want} steps, got {len(loop)} (loopback) and {len(hosts)} (hosts)")
if bad:
    sys.exit(f"FAIL: {bad} of {want} steps differ between loopback and the emulated hosts")
print(f"OK: {want} steps bit-identical on loopback and on 2 emulated hosts")
EOF
