#!/usr/bin/env bash
# CPU training-step benchmark: ringtrain's CPU backend against PyTorch eager fp32 on the same cores, in one
# run, alternating the two so that background load hits both alike. Prints one JSON line per measurement.
# usage: bench/cpu_step.sh [rounds]   (needs: cargo; python3 with torch + transformers for the reference)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
threads=$(nproc)
cargo build --release -q
echo "# machine: $(lscpu | sed -n 's/^Model name: *//p'), ${threads} cores; $(date -u +%F)"
for round in $(seq "$rounds"); do
  for spec in "tiny 4 64" "small 4 128"; do
    set -- $spec
    RAYON_NUM_THREADS=$threads target/release/ringtrain bench step --model "$1" --batch-size "$2" --seq-len "$3" --steps 20 --warmup-steps 3 2>/dev/null
    python3 scripts/bench_torch_cpu.py --model "$1" --batch-size "$2" --seq-len "$3" --steps 20 --warmup 3 --threads "$threads"
  done
done
