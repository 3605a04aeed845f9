#!/usr/bin/env bash
# Runs test binaries of the ringtrain crate ROUNDS times in a row beside a CPU load (one busy loop per
# core, started and stopped by this script), to find timing-dependent failures. Stops at the first
# failure, keeping its output; prints how long the rounds took. The binaries are built once and copied, so
# the rounds are unaffected by edits or builds meanwhile. Tests run from the repository root, as cargo runs
# them.
# usage: scripts/repeat_under_load.sh ROUNDS TEST [TEST ...]     e.g. scripts/repeat_under_load.sh 20 quic ring
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:?usage: scripts/repeat_under_load.sh ROUNDS TEST [TEST ...]}
shift
[ $# -gt 0 ] || { echo "name at least one test binary (tests/NAME.rs)" >&2; exit 2; }
test_args=()
for t in "$@"; do test_args+=(--test "$t"); done
# Build once and run copies of the test binaries, so that edits and builds meanwhile change nothing here.
work=$(mktemp -d /tmp/ringtrain-repeat.XXXXXX)
cargo test -q -p ringtrain "${test_args[@]}" --no-run --message-format=json |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' |
  while read -r exe; do cp "$exe" "$work/"; done
log="$work/log"
load_pids=()
stop_load() { [ ${#load_pids[@]} -eq 0 ] || kill "${load_pids[@]}" 2>/dev/null || true; }
trap stop_load EXIT
for _ in $(seq "$(nproc)"); do
  sh -c 'while :; do :; done' &
  load_pids+=($!)
done
run_round() {
  local exe
  for exe in "$work"/*; do
    [ -f "$exe" ] && [ -x "$exe" ] || continue
    "$exe" -q || return 1
  done
}
start=$(date +%s)
for round in $(seq "$rounds"); do
  if ! run_round >"$log" 2>&1; then
    echo "round $round of $rounds FAILED after $(($(date +%s) - start)) s; output in $log"
    grep -E "panicked|FAILED|failed" "$log" | head -20
    exit 1
  fi
  echo "round $round passed ($(($(date +%s) - start)) s so far)"
done
rm -rf "$work"
echo "$rounds rounds of $* passed beside $(nproc) busy loops in $(($(date +%s) - start)) s"
