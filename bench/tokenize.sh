#!/usr/bin/env bash
# Tokenizer throughput: `ringtrain tokenize` (gpt2) against Python tiktoken's encode_ordinary_batch on the
# same generated JSONL corpus, in one run, alternating the two. Prints one JSON line per measurement with
# wall time and CPU time (user + system: on a shared machine, wall time measures the load as much as the
# code); ringtrain's peak RSS and CPU time come from /usr/bin/time -v. The corpus and shards live in a temporary folder under
# /tmp that is removed at exit.
# usage: bench/tokenize.sh [size_mb=1000] [rounds=1]   (needs: cargo; python3 with tiktoken; /usr/bin/time)
set -euo pipefail
cd "$(dirname "$0")/.."
size_mb=${1:-1000}
rounds=${2:-1}
work=$(mktemp -d /tmp/ringtrain-tokenize-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT
corpus=$work/corpus.jsonl

cargo build --release -q --bin ringtrain
echo "# machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u '+%F %H:%M') UTC; load: $(cut -d' ' -f1-3 /proc/loadavg)"

# A deterministic corpus: 20,000 English-like sentences built from a seeded word list, drawn into documents
# of 5-60 sentences (about 3.4 KB on average) until the file reaches size_mb * 10^6 bytes.
python3 - "$corpus" "$size_mb" <<'PY'
import json, random, sys
path, target = sys.argv[1], int(sys.argv[2]) * 10**6
rng = random.Random(20240520)
onsets = ["b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "w", "th", "st", "br", "ch", "sh", "pl"]
vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "ee"]
codas = ["", "n", "r", "s", "t", "nd", "ll", "ck", "ng", "rt"]
words = sorted({"".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
                for _ in range(6000)})
common = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "that", "with", "for", "on", "as", "he", "she"]
def sentence():
    n = rng.randint(5, 22)
    ws = [rng.choice(common) if rng.random() < 0.35 else rng.choice(words) for _ in range(n)]
    ws[0] = ws[0].capitalize()
    if rng.random() < 0.15:
        ws.insert(rng.randrange(1, n), str(rng.randint(1, 9999)))
    if rng.random() < 0.1:
        ws.insert(rng.randrange(1, n), rng.choice(["it's", "don't", "we'll", "café", "naïve", "—", "(see above)"]))
    return " ".join(ws) + rng.choice([".", ".", ".", "!", "?", ";", ":"])
pool = [sentence() for _ in range(20000)]
written = docs = 0
with open(path, "w", encoding="utf-8") as f:
    while written < target:
        k = rng.randint(5, 60)
        paragraphs = [" ".join(rng.choices(pool, k=rng.randint(1, 8))) for _ in range(max(1, k // 5))]
        line = json.dumps({"id": docs, "text": "\n\n".join(paragraphs)}, ensure_ascii=False) + "\n"
        f.write(line)
        written += len(line.encode("utf-8"))
        docs += 1
print(f"# corpus: {written} bytes, {docs} documents", file=sys.stderr)
PY

for round in $(seq "$rounds"); do
  rm -rf "$work/shards"
  start=$(date +%s.%N)
  /usr/bin/time -v target/release/ringtrain tokenize "$corpus" -o "$work/shards" >"$work/summary.txt" 2>"$work/time.txt"
  end=$(date +%s.%N)
  sed 's/^/# /' "$work/summary.txt"
  tokens=$(sed -n 's/.* documents, \([0-9]*\) tokens.*/\1/p' "$work/summary.txt")
  documents=$(sed -n 's/^\([0-9]*\) documents, .*/\1/p' "$work/summary.txt")
  rss_kb=$(sed -n 's/.*Maximum resident set size (kbytes): *//p' "$work/time.txt")
  cpu_s=$(sed -n 's/.*\(User\|System\) time (seconds): *//p' "$work/time.txt" | paste -sd+ | bc)
  bytes=$(stat -c %s "$corpus")
  python3 -c "import json,sys; b,d,t,s,r,c=int(sys.argv[1]),int(sys.argv[2]),int(sys.argv[3]),float(sys.argv[4]),int(sys.argv[5]),float(sys.argv[7])
print(json.dumps({'impl':'ringtrain tokenize','round':int(sys.argv[6]),'file_bytes':b,'documents':d,'tokens':t,'seconds':round(s,2),
 'mb_per_s':round(b/s/1e6,2),'tokens_per_s':round(t/s),'cpu_seconds':round(c,2),'peak_rss_mb':round(r/1024,1)}))" \
    "$bytes" "$documents" "$tokens" "$(echo "$end - $start" | bc)" "$rss_kb" "$round" "$cpu_s"
  rm -rf "$work/shards"
  python3 scripts/bench_tiktoken.py "$corpus" --threads 2 --expect-tokens "$tokens"
done
