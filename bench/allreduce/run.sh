#!/usr/bin/env bash
# Same-run comparison of all-reduce on one host: ringtrain over shared memory and over QUIC, PyTorch Gloo
# (TCP) and nexar (QUIC),
# alternating implementations, for N=2 and N=4. 64 MiB of f32 for bandwidth (busbw), 4 KiB for latency.
#
#   bench/allreduce/run.sh [ROUNDS] [ITERS_BIG] [ITERS_SMALL]
#
# Builds ringtrain (release) and the standalone nexar harness (bench/allreduce/nexar, its own workspace;
# target dir $NEXAR_TARGET, default /tmp/ringtrain-nexar-target); SKIP_NEXAR=1 leaves nexar out. Prints every
# table and the load average.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
ROUNDS=${1:-2}
IT_BIG=${2:-10}
IT_SMALL=${3:-200}
NEXAR_TARGET=${NEXAR_TARGET:-/tmp/ringtrain-nexar-target}
RT=${RINGTRAIN_BIN:-$ROOT/target/release/ringtrain}
NX=$NEXAR_TARGET/release/ringtrain-bench-nexar
if [ -z "${NO_BUILD:-}" ]; then
  (cd "$ROOT" && cargo build --release --bin ringtrain)
  if [ -z "${SKIP_NEXAR:-}" ]; then
    (cd "$ROOT/bench/allreduce/nexar" && CARGO_TARGET_DIR=$NEXAR_TARGET cargo build --release)
  fi
fi
echo "== $(date -u +%FT%TZ)  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
for round in $(seq 1 "$ROUNDS"); do
  for n in 2 4; do
    echo; echo "=== round $round, N=$n  load: $(uptime | sed 's/.*load average: //')"
    echo "--- ringtrain (shm) 64MiB"; "$RT" bench allreduce --nproc "$n" --size 64MiB --iters "$IT_BIG" --transport shm
    echo "--- ringtrain (QUIC) 64MiB"; "$RT" bench allreduce --nproc "$n" --size 64MiB --iters "$IT_BIG" --transport quic
    echo "--- gloo (TCP) 64MiB"; python3 "$ROOT/bench/allreduce/gloo.py" "$n" 67108864 "$IT_BIG"
    if [ -z "${SKIP_NEXAR:-}" ]; then echo "--- nexar (QUIC) 64MiB"; "$NX" "$n" 67108864 "$IT_BIG"; fi
    echo "--- ringtrain (shm) 4KiB"; "$RT" bench allreduce --nproc "$n" --size 4KiB --iters "$IT_SMALL" --transport shm
    echo "--- ringtrain (QUIC) 4KiB"; "$RT" bench allreduce --nproc "$n" --size 4KiB --iters "$IT_SMALL" --transport quic
    echo "--- gloo (TCP) 4KiB"; python3 "$ROOT/bench/allreduce/gloo.py" "$n" 4096 "$IT_SMALL"
    if [ -z "${SKIP_NEXAR:-}" ]; then echo "--- nexar (QUIC) 4KiB"; "$NX" "$n" 4096 "$IT_SMALL"; fi
  done
done
echo; echo "load at end: $(uptime | sed 's/.*load average: //')"
