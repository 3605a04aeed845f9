#!/usr/bin/env bash
# --sync outer against every-step on `small`: the validation loss after the same number of steps, for a
# range of --outer-every (OUTER_EVERY), outer learning rates (OUTER_LRS), momenta (OUTER_MOMENTA, default 0.9)
# and --outer-overlap (OVERLAPS, default off), 2 ranks on loopback, evaluating every EVAL_EVERY (500) steps;
# every-step sync also with each --wire format in WIRES (default none); on the built-in corpus, or on DATA
# (a `ringtrain tokenize --tokenizer byte` output directory). Prints one line per run.
#   bench/outer/sweep.sh [STEPS] [RANKS]     (build first: cargo build --release)
set -euo pipefail
steps=${1:-1000}
ranks=${2:-2}
bin=${RINGTRAIN_BIN:-target/release/ringtrain}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--model small --batch-size 8 --seq-len 128 --steps "$steps" --eval-every "${EVAL_EVERY:-500}" --eval-batches 16
  --update replicated --threads 1)
if [ -n "${DATA:-}" ]; then common+=(--data "$DATA"); fi
run() {
  local name=$1; shift
  rm -f "$out"/m*.jsonl
  local start=$SECONDS
  "$bin" launch --nproc "$ranks" -- train "${common[@]}" "$@" --metrics "$out/m.jsonl" >/dev/null 2>"$out/err"
  python3 - "$out/m.jsonl" "$name" $((SECONDS - start)) <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
vals = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
outer = [r["outer"]["loss"] for r in rows if r.get("outer")]
print(f"{sys.argv[2]:28s} val loss " + ", ".join(f"step {s}: {v:.4f}" for s, v in vals)
      + (f" | last round's mean inner loss {outer[-1]:.4f}" if outer else "") + f" | {sys.argv[3]} s")
PY
}
run "every-step"
for wire in ${WIRES:-}; do
  run "every-step wire $wire" --wire "$wire"
done
for h in ${OUTER_EVERY:-10 50 100 500}; do
  for lr in ${OUTER_LRS:-0.7}; do
    for mu in ${OUTER_MOMENTA:-0.9}; do
      for overlap in ${OVERLAPS:-off}; do
        run "outer H=$h lr=$lr mu=$mu overlap $overlap" --sync outer --outer-every "$h" --outer-lr "$lr" \
          --outer-momentum "$mu" --outer-overlap "$overlap"
      done
    done
  done
done
