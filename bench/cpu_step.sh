#!/usr/bin/env bash
# CPU training-step benchmark: ringtrain's CPU backend against PyTorch fp32 on the same shapes and thread
# counts, in one run, with two references: transformers' eager attention and its default, SDPA (torch's
# scaled_dot_product_attention). Each round runs every (threads, model) point for all three, ringtrain
# first in odd rounds and last in even ones, so background load hits all alike. Prints one JSON line per
# measurement, then a table of medians over the rounds (of each run's mean ms/step).
# usage: bench/cpu_step.sh [rounds] [out.jsonl]   (needs: cargo; python3 with torch + transformers)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
out=${2:-$(mktemp --suffix=.jsonl)}
steps=20
warmup=3
cargo build --release -q
echo "# machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u '+%F %H:%M') UTC; commit $(git rev-parse --short HEAD)"
: >"$out"
ringtrain() {
  target/release/ringtrain bench step --backend cpu --model "$1" --batch-size "$2" --seq-len "$3" \
    --threads "$4" --steps $steps --warmup-steps $warmup 2>/dev/null |
    python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d.update(model=sys.argv[1], threads=int(sys.argv[2])); print(json.dumps(d))' "$1" "$4"
}
pytorch() {
  python3 scripts/bench_torch_cpu.py --model "$1" --batch-size "$2" --seq-len "$3" --threads "$4" \
    --steps $steps --warmup $warmup --attention eager
}
pytorch_sdpa() {
  python3 scripts/bench_torch_cpu.py --model "$1" --batch-size "$2" --seq-len "$3" --threads "$4" \
    --steps $steps --warmup $warmup --attention sdpa
}
for round in $(seq "$rounds"); do
  for threads in 1 2; do
    for spec in "tiny 8 64" "small 8 128"; do
      set -- $spec
      if ((round % 2)); then order="ringtrain pytorch pytorch_sdpa"; else order="pytorch_sdpa pytorch ringtrain"; fi
      for impl in $order; do
        $impl "$1" "$2" "$3" "$threads" | tee -a "$out"
      done
    done
  done
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
key = lambda r: (r["model"], r["batch"], r["seq"], r["threads"])
print(f"\n{'model':6} {'B x T':8} {'thr':>3} {'ringtrain ms':>13} {'eager ms':>9} {'sdpa ms':>8} {'vs eager':>9} {'vs sdpa':>8}"
      f"  (medians of {len(rows)//12} rounds; ratio = PyTorch ms / ringtrain ms)")
for k in sorted({key(r) for r in rows}, key=lambda k: (k[0] != "tiny", k[3])):
    ms = lambda impl: statistics.median(r["ms_per_step"] for r in rows if key(r) == k and r["impl"] == impl)
    rt, eager, sdpa = ms("ringtrain"), ms("pytorch-eager-cpu"), ms("pytorch-sdpa-cpu")
    print(f"{k[0]:6} {k[1]}x{k[2]:<6} {k[3]:>3} {rt:13.2f} {eager:9.2f} {sdpa:8.2f} {eager / rt:9.2f} {sdpa / rt:8.2f}")
print(f"raw lines: {sys.argv[1]}")
EOF
