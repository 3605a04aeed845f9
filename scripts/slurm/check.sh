#!/usr/bin/env bash
# Slurm for real: starts a private single-node Slurm cluster (munged, slurmctld, slurmd from Debian's
# `slurm-wlm` and `munge`), then
#   1. runs `srun -n 3 ringtrain train ...` to completion and checks that the three ranks trained as one job;
#   2. runs the same job with rank 2 killed (SIGKILL) mid-training and checks that srun exits non-zero and
#      that the surviving ranks name rank 2.
# Exits 0 when both behave so, 1 otherwise. Needs root (slurmd runs jobs as root here) and, where the packages
# are missing, apt-get.
#
#   scripts/slurm/check.sh [STEPS]        default 30
#
# RINGTRAIN_BIN overrides the binary (default target/release/ringtrain, else target/debug/ringtrain).
# Everything the script starts lives in one temporary folder: its own munge key and socket, its own
# slurm.conf with free ports, state and logs. On exit it stops exactly the daemons it started (by their pid
# files) and removes the folder; the machine's own munge and Slurm set-up, if any, are not touched.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
STEPS=${1:-30}
[[ $STEPS =~ ^[0-9]+$ ]] && ((STEPS >= 10)) || { echo "slurm-check: STEPS must be an integer >= 10, got '$STEPS'" >&2; exit 2; }
die() { echo "slurm-check: $*" >&2; exit 1; }

RT=${RINGTRAIN_BIN:-}
if [ -z "$RT" ]; then
  for candidate in "$ROOT/target/release/ringtrain" "$ROOT/target/debug/ringtrain"; do
    [ -x "$candidate" ] && { RT=$candidate; break; }
  done
fi
[ -n "$RT" ] && [ -x "$RT" ] || die "no ringtrain binary: run 'cargo build --release' (or set RINGTRAIN_BIN)"
[ "$(id -u)" = 0 ] || die "needs root: slurmd starts the job's processes"

if ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || die "srun or munged missing, and no apt-get to install slurm-wlm and munge"
  echo "== installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }
fi

WORK=$(mktemp -d /tmp/ringtrain-slurm.XXXXXX)
chmod 700 "$WORK"
stop_daemons() {
  local pidfile pid
  for pidfile in "$WORK/slurmd.pid" "$WORK/slurmctld.pid" "$WORK/munged.pid"; do
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}
cleanup() {
  stop_daemons
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A free TCP port on this host (bound then released; the daemons start within a second).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

HOST=$(hostname -s)
CPUS=$(nproc)
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/munge"
chmod 700 "$WORK/munge"

echo "== munged (private key and socket)"
head -c 1024 /dev/urandom > "$WORK/munge/munge.key"
chmod 400 "$WORK/munge/munge.key"
munged --force --key-file="$WORK/munge/munge.key" --socket="$WORK/munge/socket" \
  --pid-file="$WORK/munged.pid" --log-file="$WORK/munged.log" --seed-file="$WORK/munge/seed" ||
  die "munged did not start: $(cat "$WORK/munged.log" 2>/dev/null)"

CTLD_PORT=$(free_port)
SLURMD_PORT=$(free_port)
cat > "$WORK/slurm.conf" <<EOF
ClusterName=ringtrain-check
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$WORK/munge/socket
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=check Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
export SLURM_CONF=$WORK/slurm.conf

echo "== slurmctld and slurmd (ports $CTLD_PORT, $SLURMD_PORT)"
slurmctld -i -f "$SLURM_CONF" || die "slurmctld did not start: $(tail -5 "$WORK/slurmctld.log" 2>/dev/null)"
slurmd -f "$SLURM_CONF" || die "slurmd did not start: $(tail -5 "$WORK/slurmd.log" 2>/dev/null)"
for _ in $(seq 100); do
  sinfo -h -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)' && break
  sleep 0.2
done
sinfo -h -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)' ||
  die "the node never became idle: $(sinfo 2>&1; tail -5 "$WORK/slurmctld.log" "$WORK/slurmd.log")"
sinfo

# Every rank gets the same secret and master port through srun's environment; the master host is the job's
# first node, which the ranks take from SLURM_JOB_NODELIST.
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$WORK/secret"
export RINGTRAIN_SECRET
RINGTRAIN_SECRET=$(cat "$WORK/secret")
TRAIN=(train --model tiny --batch-size 4 --seq-len 64 --backend cpu --threads 1 --eval-batches 1 --timeout 10)

echo "== srun -n 3 ringtrain ${TRAIN[*]} --steps $STEPS"
export MASTER_PORT
MASTER_PORT=$(free_port)
started=$(date +%s%N)
srun -n 3 --overcommit --kill-on-bad-exit=1 -l "$RT" "${TRAIN[@]}" --steps "$STEPS" --metrics "$WORK/good.jsonl" \
  > "$WORK/good.log" 2>&1 || { cat "$WORK/good.log" >&2; die "srun -n 3 failed"; }
good_ms=$((($(date +%s%N) - started) / 1000000))
grep -E 'world 3|world size 3|3 ranks' "$WORK/good.log" | head -3 || true
lines=$(wc -l < "$WORK/good.jsonl")
[ "$lines" -eq "$STEPS" ] || { cat "$WORK/good.log" >&2; die "rank 0 wrote $lines metrics lines, expected $STEPS"; }
python3 - "$WORK/good.jsonl" <<'EOF' || die "the metrics do not describe one 3-rank job"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert all(r["world_size"] == 3 for r in rows), "world_size is not 3 on every step"
tokens = [r["tokens"] for r in rows]
assert tokens[0] == 3 * 4 * 64 and tokens[-1] == len(rows) * 3 * 4 * 64, f"global tokens {tokens[0]}..{tokens[-1]}"
print(f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} over {len(rows)} steps, {tokens[-1]} global tokens")
EOF
echo "ok: srun -n 3 trained one job to completion in ${good_ms} ms"

echo "== srun -n 3 with rank 2 killed mid-training"
MASTER_PORT=$(free_port)
# Rank 2 runs under a shell that kills it with SIGKILL after 3 s of training; exec keeps the pid. No
# --kill-on-bad-exit here: the survivors must notice the loss themselves and name the lost rank.
KILLER='if [ "$SLURM_PROCID" = 2 ]; then ( sleep 3; kill -9 $$ ) & fi; exec "$@"'
started=$(date +%s%N)
set +e
srun -n 3 --overcommit -l sh -c "$KILLER" sh "$RT" "${TRAIN[@]}" --steps 100000 \
  > "$WORK/bad.log" 2>&1
rc=$?
set -e
bad_ms=$((($(date +%s%N) - started) / 1000000))
grep -Ei 'error|killed|rank 2' "$WORK/bad.log" | head -8 || true
[ "$rc" -ne 0 ] || { cat "$WORK/bad.log" >&2; die "srun exited 0 although rank 2 was killed"; }
grep -Eq '^[01]: .*rank 2' "$WORK/bad.log" || { cat "$WORK/bad.log" >&2; die "no surviving rank named rank 2"; }
echo "ok: srun exited $rc ${bad_ms} ms after the start (rank 2 killed after 3 s); a survivor named rank 2"
