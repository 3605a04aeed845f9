#!/usr/bin/env bash
# CPU cost of one 64 MiB f32 all-reduce on loopback, for ringtrain (QUIC, or `ringtrain-shm`: shared
# memory), PyTorch Gloo (TCP) and nexar (QUIC): each command runs twice, with LO and HI iterations, and the difference of their CPU seconds (user +
# system, all processes) divided by HI - LO is the CPU time of one all-reduce, free of start-up costs (Python's
# torch import, TLS handshakes). Unlike bandwidth, this figure barely moves when other work shares the cores.
#
#   bench/allreduce/cpu_cost.sh [LO] [HI]    (defaults 5 and 105; bench/allreduce/run.sh builds the binaries)
#   IMPLS="ringtrain" RINGTRAIN_BIN=path/to/other/ringtrain bench/allreduce/cpu_cost.sh   (one build only)
#   IMPLS="ringtrain-shm ringtrain gloo" bench/allreduce/cpu_cost.sh                     (shared memory)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LO=${1:-5}
HI=${2:-105}
NEXAR_TARGET=${NEXAR_TARGET:-/tmp/ringtrain-nexar-target}
RT=${RINGTRAIN_BIN:-$ROOT/target/release/ringtrain}
NX=$NEXAR_TARGET/release/ringtrain-bench-nexar
BYTES=67108864
IMPLS=${IMPLS:-ringtrain gloo nexar}

# CPU seconds (user + system of the command and its children).
cpu_of() {
  # This (sub)shell's own ticks plus those of its waited-for children; read through a fixed pid, because
  # every $(...) below is a new subshell with its own.
  local me=$BASHPID t0 t1
  t0=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$me/stat")
  "$@" >/dev/null 2>&1
  t1=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$me/stat")
  echo $(( t1 - t0 ))
}

tick=$(getconf CLK_TCK)
echo "== $(date -u +%FT%TZ)  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; ${LO} vs ${HI} iterations"
printf '%-14s %3s %18s %22s\n' impl N "cpu ms / allreduce" "cpu s per GB of busbw"
for n in 2 4; do
  for impl in $IMPLS; do
    case $impl in
      ringtrain) cmd=("$RT" bench allreduce --nproc "$n" --size 64MiB --transport quic --iters) ;;
      ringtrain-shm) cmd=("$RT" bench allreduce --nproc "$n" --size 64MiB --transport shm --iters) ;;
      gloo) cmd=(python3 "$ROOT/bench/allreduce/gloo.py" "$n" "$BYTES") ;;
      nexar) cmd=("$NX" "$n" "$BYTES") ;;
    esac
    lo=$(cpu_of "${cmd[@]}" "$LO")
    hi=$(cpu_of "${cmd[@]}" "$HI")
    awk -v impl="$impl" -v n="$n" -v d="$((hi - lo))" -v k="$((HI - LO))" -v tick="$tick" -v b="$BYTES" 'BEGIN {
      ms = d / tick / k * 1000
      gb = b * 2 * (n - 1) / n / 1e9
      printf "%-14s %3d %18.1f %22.2f\n", impl, n, ms, ms / 1000 / gb
    }'
  done
done
echo "load at end: $(uptime | sed 's/.*load average: //')"
