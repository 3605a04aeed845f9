# Emulated hosts on one Linux machine: sourced by hosts.sh, compare.sh and check.sh (needs root, iproute2).
#
# Topology (nothing is created in the root network namespace):
#
#   netns rt-h0  eth0 10.77.0.1/24 --veth-- p0 ┐
#   netns rt-h1  eth0 10.77.0.2/24 --veth-- p1 ├ bridge br0 in netns rt-sw (the switch)
#   ...                                        ┘
#
# Every link direction is a token bucket (`tbf`) at RATE: the host side of each veth is the host NIC's
# egress queue, the switch side is the switch port's egress queue toward that host. See README.md for the
# queue settings and why.
#
# Ownership: `hosts_up` refuses to start when any rt-sw / rt-h* namespace exists, records what it created in
# $HOSTS_STATE, and `hosts_down` deletes exactly the namespaces recorded there (deleting a namespace deletes
# its veth ends and the bridge with it).

HOSTS_PREFIX=rt
HOSTS_SWITCH=${HOSTS_PREFIX}-sw
HOSTS_SUBNET=10.77.0
HOSTS_MAX=4
HOSTS_STATE=${HOSTS_STATE:-/run/ringtrain-hosts.state}
# Link MTU: an Ethernet frame's payload; HOSTS_MTU=9000 emulates a network with jumbo frames.
HOSTS_MTU=${HOSTS_MTU:-1500}
# Queue of each direction, bytes: 1000 full frames, Linux's default txqueuelen (see README.md).
HOSTS_LIMIT=${HOSTS_LIMIT:-1514000}

hosts_ns() { echo "${HOSTS_PREFIX}-h$1"; }
hosts_addr() { echo "${HOSTS_SUBNET}.$(($1 + 1))"; }

hosts_die() {
  echo "hosts: $*" >&2
  exit 1
}

# RATE (tc syntax: 200mbit, 1gbit, 500kbit) in bits per second.
hosts_rate_bps() {
  local r=${1,,}
  case $r in
    *gbit) echo $((${r%gbit} * 1000000000)) ;;
    *mbit) echo $((${r%mbit} * 1000000)) ;;
    *kbit) echo $((${r%kbit} * 1000)) ;;
    *bit) echo "${r%bit}" ;;
    *) return 1 ;;
  esac
}

# Token-bucket depth in bytes: one millisecond at the link rate, at least ten full frames. A real link
# never sends faster than its rate, so the burst is kept small; it must hold at least one frame, and a few
# more let the shaper keep up when its timer fires late on a loaded machine.
hosts_burst() {
  local bps=$1 b
  b=$((bps / 8 / 1000))
  ((b < 10 * (HOSTS_MTU + 14))) && b=$((10 * (HOSTS_MTU + 14)))
  echo "$b"
}

hosts_require_root() {
  [ "$(id -u)" = 0 ] || hosts_die "needs root (network namespaces, veth, tc)"
  command -v ip > /dev/null && command -v tc > /dev/null || hosts_die "needs iproute2 (ip, tc)"
}

# Names this harness would create that exist already: the harness never adopts or deletes them.
hosts_existing() {
  local ns
  for ns in $(ip netns list | awk '{print $1}'); do
    case $ns in "$HOSTS_SWITCH" | "${HOSTS_PREFIX}"-h[0-9]*) echo "$ns" ;; esac
  done
}

hosts_shape() { # NS DEV RATE BURST
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$3" burst "$4" limit "$HOSTS_LIMIT"
}

# hosts_up N RATE: the switch and N hosts; every direction shaped to RATE.
hosts_up() {
  local n=$1 rate=$2 bps burst i ns
  hosts_require_root
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= HOSTS_MAX)) || hosts_die "hosts must be 1..$HOSTS_MAX, got '$n'"
  bps=$(hosts_rate_bps "$rate") && ((bps > 0)) || hosts_die "rate '$rate': expected e.g. 200mbit or 1gbit"
  [[ $HOSTS_MTU =~ ^[0-9]+$ ]] && ((HOSTS_MTU >= 1280 && HOSTS_MTU <= 9000)) ||
    hosts_die "HOSTS_MTU '$HOSTS_MTU' must be between 1280 and 9000 bytes"
  [[ $HOSTS_LIMIT =~ ^[0-9]+$ ]] && ((HOSTS_LIMIT >= HOSTS_MTU + 14)) ||
    hosts_die "HOSTS_LIMIT '$HOSTS_LIMIT' must be a byte count of at least one frame"
  local existing
  existing=$(hosts_existing)
  if [ -n "$existing" ]; then
    hosts_die "these namespaces exist already: $(echo "$existing" | tr '\n' ' ')
  if an earlier run left them, remove them with: bench/hosts/hosts.sh down
  (or by hand: $(for e in $existing; do printf 'ip netns del %s; ' "$e"; done))"
  fi
  [ -e "$HOSTS_STATE" ] && hosts_die "$HOSTS_STATE exists: another run may be up; bench/hosts/hosts.sh down removes it"
  burst=$(hosts_burst "$bps")
  : > "$HOSTS_STATE"
  # From here on this shell owns what the state file lists (see hosts_down_if_owned).
  HOSTS_OWNED=1
  ip netns add "$HOSTS_SWITCH" && echo "$HOSTS_SWITCH" >> "$HOSTS_STATE" ||
    hosts_die "cannot create network namespace $HOSTS_SWITCH: needs CAP_SYS_ADMIN and CAP_NET_ADMIN (a container
  has them only when started with --privileged or --cap-add SYS_ADMIN --cap-add NET_ADMIN)"
  ip -n "$HOSTS_SWITCH" link add br0 type bridge
  ip -n "$HOSTS_SWITCH" link set br0 up
  for ((i = 0; i < n; i++)); do
    ns=$(hosts_ns "$i")
    ip netns add "$ns" && echo "$ns" >> "$HOSTS_STATE" || hosts_die "cannot create $ns"
    # No IPv6 chatter (router solicitations, DAD) on the measured links.
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
    ip -n "$ns" link set lo up
    ip -n "$HOSTS_SWITCH" link add "p$i" mtu "$HOSTS_MTU" type veth peer name eth0 netns "$ns"
    ip -n "$HOSTS_SWITCH" link set "p$i" master br0 up
    ip -n "$ns" link set eth0 mtu "$HOSTS_MTU" up
    ip -n "$ns" addr add "$(hosts_addr "$i")/24" dev eth0
    hosts_shape "$ns" eth0 "$rate" "$burst"
    hosts_shape "$HOSTS_SWITCH" "p$i" "$rate" "$burst"
  done
  hosts_wait_reachable "$n"
}

# Every host is reachable from host 0: a datagram to the discard port makes host 0 resolve the host's
# address, and a resolved (REACHABLE) neighbour entry proves the path through the switch. (No ping needed.)
hosts_wait_reachable() {
  local n=$1 i tries addr
  for ((i = 1; i < n; i++)); do
    addr=$(hosts_addr "$i")
    tries=0
    until hosts_exec 0 bash -c "echo > /dev/udp/$addr/9" 2> /dev/null && sleep 0.1 &&
      ip -n "$(hosts_ns 0)" neigh show "$addr" | grep -q REACHABLE; do
      tries=$((tries + 1))
      ((tries < 20)) || hosts_die "host $i ($addr) does not answer host 0"
      sleep 0.2
    done
  done
}

# hosts_down: ends the processes still inside the recorded namespaces (only this harness's jobs run
# there), then deletes the namespaces. Safe to call twice.
hosts_down() {
  [ -e "$HOSTS_STATE" ] || return 0
  local ns pid
  while read -r ns; do
    [ -n "$ns" ] || continue
    ip netns list | awk '{print $1}' | grep -qx "$ns" || continue
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill "$pid" 2> /dev/null || true; done
  done < "$HOSTS_STATE"
  sleep 0.2
  while read -r ns; do
    [ -n "$ns" ] || continue
    ip netns list | awk '{print $1}' | grep -qx "$ns" || continue
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -9 "$pid" 2> /dev/null || true; done
    ip netns del "$ns" || echo "hosts: could not delete namespace $ns" >&2
  done < "$HOSTS_STATE"
  rm -f "$HOSTS_STATE"
}

# hosts_down for exit traps: only when this shell's hosts_up got as far as creating the state file, so a
# run refused because another run is up leaves that run alone.
hosts_down_if_owned() {
  [ -z "${HOSTS_OWNED:-}" ] || hosts_down
}

# Hosts currently up (from the state file).
hosts_count() {
  [ -e "$HOSTS_STATE" ] || { echo 0; return; }
  grep -c "^${HOSTS_PREFIX}-h" "$HOSTS_STATE" || true
}

# hosts_exec I CMD...: CMD inside host I.
hosts_exec() {
  local i=$1
  shift
  ip netns exec "$(hosts_ns "$i")" "$@"
}

# One JSON object per shaped queue, from `tc -s qdisc`: cumulative since `hosts_up`.
#   {"queue":"h0-egress","sent_bytes":..,"sent_pkts":..,"dropped":..,"overlimits":..}
hosts_qdisc_json() {
  local n i
  n=$(hosts_count)
  for ((i = 0; i < n; i++)); do
    hosts_tbf_counters "$(hosts_ns "$i")" eth0 "h$i-egress"
    hosts_tbf_counters "$HOSTS_SWITCH" "p$i" "sw-p$i-to-h$i"
  done
}

hosts_tbf_counters() { # NS DEV LABEL
  ip netns exec "$1" tc -s qdisc show dev "$2" | awk -v q="$3" '
    /^ Sent / {
      gsub(/[(),]/, " ");
      printf "{\"queue\":\"%s\",\"sent_bytes\":%s,\"sent_pkts\":%s,\"dropped\":%s,\"overlimits\":%s}\n",
             q, $2, $4, $7, $9; exit }'
}

# The preamble of a job script (check.sh, two_level.sh): RT, the ringtrain binary (RINGTRAIN_BIN, else ROOT's
# release build); WORK, a work directory named after NAME, removed at exit together with the hosts this
# script brought up; and a fresh cluster secret in $WORK/secret.
hosts_job_setup() { # NAME ROOT
  RT=${RINGTRAIN_BIN:-$2/target/release/ringtrain}
  [ -x "$RT" ] || hosts_die "$RT not found: run 'cargo build --release' (or set RINGTRAIN_BIN)"
  WORK=$(mktemp -d "/tmp/rt-hosts-$1.XXXXXX")
  trap 'hosts_down_if_owned; rm -rf "$WORK"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$WORK/secret"
  chmod 600 "$WORK/secret"
}
