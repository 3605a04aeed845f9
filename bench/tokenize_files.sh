#!/usr/bin/env bash
# `ringtrain tokenize` memory over many inputs: peak RSS and throughput on 1,000 small text files, a few
# large ones, and a mix of both (plus JSONL files), each a deterministic corpus under /tmp removed at exit.
# Prints one JSON line per corpus and binary with a digest of the shards (sha256 of the concatenated .bin
# files), so two builds can be checked to write the same bytes.
# usage: bench/tokenize_files.sh [binary=target/release/ringtrain] [second binary to compare]
#   (needs: python3, /usr/bin/time, sha256sum; builds the release binary when no binary is given)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  cargo build --release -q --bin ringtrain
fi
binaries=("${1:-target/release/ringtrain}")
[ $# -ge 2 ] && binaries+=("$2")
work=$(mktemp -d /tmp/ringtrain-tokenize-files.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "# machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u '+%F %H:%M') UTC; load: $(cut -d' ' -f1-3 /proc/loadavg)"

# small/: 1,000 text files of about 1 KB; large/: 3 text files of 40 MB; mixed/: 500 small text files,
# 2 large ones and 200 JSONL files of 10 documents each.
python3 - "$work" <<'PY'
import json, os, random, sys
root = sys.argv[1]
rng = random.Random(20261204)
words = ["the", "a", "of", "and", "ring", "rank", "step", "loss", "token", "shard", "café", "naïve", "it's",
         "gradient", "bucket", "worker", "host", "2026", "—", "(see above)", "日本", "🙂"]
def text(n_bytes):
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words) + rng.choice([" ", " ", " ", "\n", ". ", ", "])
        out.append(w); size += len(w.encode())
    return "".join(out)
def write(path, s):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(s)
big = text(40 * 10**6)
for i in range(1000):
    write(f"{root}/small/doc{i:04d}.txt", text(rng.randint(600, 1500)))
for i in range(3):
    write(f"{root}/large/big{i}.txt", big[i:] + big[:i])
for i in range(500):
    write(f"{root}/mixed/a{i:04d}.txt", text(rng.randint(600, 1500)))
for i in range(2):
    write(f"{root}/mixed/b{i}.txt", big[i * 7:] + big[:i * 7])
for i in range(200):
    write(f"{root}/mixed/c{i:04d}.jsonl", "".join(json.dumps({"text": text(rng.randint(200, 3000))}) + "\n" for _ in range(10)))
PY

for corpus in small large mixed; do
  mapfile -t inputs < <(find "$work/$corpus" -type f | sort)
  bytes=$(cat "${inputs[@]}" | wc -c)
  for bin in "${binaries[@]}"; do
    out="$work/out"
    rm -rf "$out"
    start=$(date +%s.%N)
    /usr/bin/time -v "$bin" tokenize "${inputs[@]}" -o "$out" >"$work/summary.txt" 2>"$work/time.txt" ||
      { cat "$work/time.txt" >&2; exit 1; }
    end=$(date +%s.%N)
    rss_kb=$(sed -n 's/.*Maximum resident set size (kbytes): *//p' "$work/time.txt")
    digest=$(cat "$out"/*.bin | sha256sum | cut -c1-16)
    python3 -c "import json,sys; b,r,s=int(sys.argv[1]),int(sys.argv[2]),float(sys.argv[3])
print(json.dumps({'corpus':sys.argv[4],'files':int(sys.argv[5]),'input_bytes':b,'binary':sys.argv[6],'seconds':round(s,2),
 'mb_per_s':round(b/s/1e6,2),'peak_rss_mb':round(r/1024,1),'shards_sha256':sys.argv[7]}))" \
      "$bytes" "$rss_kb" "$(echo "$end - $start" | bc)" "$corpus" "${#inputs[@]}" "$bin" "$digest"
  done
done
