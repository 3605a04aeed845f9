#!/usr/bin/env bash
# Turns this machine into 1-4 emulated hosts joined by a switch, each link shaped to RATE (see lib.sh and
# README.md). Needs root.
#
#   bench/hosts/hosts.sh up N RATE             create the switch and hosts rt-h0..rt-h{N-1} (10.77.0.1..N)
#   bench/hosts/hosts.sh down                  delete what `up` created (and end any job left inside)
#   bench/hosts/hosts.sh status                one JSON line per shaped queue (bytes, packets, drops)
#   bench/hosts/hosts.sh run N RATE -- CMD...  up, CMD once per host (in parallel, inside its namespace),
#                                              queue counters, then down, whatever happens
#
# In `run`, each copy of CMD gets HOST (its index), HOSTS (N), HOST_ADDR and MASTER_ADDR (host 0's address)
# in its environment, e.g.
#   bench/hosts/hosts.sh run 2 200mbit -- sh -c 'ping -c3 $MASTER_ADDR'
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

run_per_host() {
  local n=$1 i rc=0
  shift
  local pids=()
  for ((i = 0; i < n; i++)); do
    HOST=$i HOSTS=$n HOST_ADDR=$(hosts_addr "$i") MASTER_ADDR=$(hosts_addr 0) hosts_exec "$i" "$@" &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { rc=$?; echo "hosts: host $i exited with status $rc" >&2; }
  done
  return "$rc"
}

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
case $cmd in
  up)
    [ $# -eq 2 ] || usage
    # A setup that fails half-way removes what it made.
    trap '[ -n "${up_done:-}" ] || hosts_down_if_owned' EXIT
    hosts_up "$1" "$2"
    up_done=1
    echo "up: $(hosts_count) hosts at $2; run 'bench/hosts/hosts.sh down' to remove them" >&2
    ;;
  down) hosts_down ;;
  status) hosts_qdisc_json ;;
  run)
    [ $# -ge 4 ] && [ "$3" = "--" ] || usage
    n=$1 rate=$2
    shift 3
    trap hosts_down_if_owned EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    hosts_up "$n" "$rate"
    status=0
    run_per_host "$n" "$@" || status=$?
    hosts_qdisc_json
    exit "$status"
    ;;
  *) usage ;;
esac
