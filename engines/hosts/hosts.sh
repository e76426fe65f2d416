#!/usr/bin/env bash
# Test hosts on one machine: a head and hosts h1..hN in network namespaces, joined by a bridge, for trying and
# testing multi-node runs (MPI jobs, the notebook cluster, Slurm) without a cluster.
#
#   engines/hosts/hosts.sh up N [--rate RATE] [--owner PID]
#                                               # hosts h1..hN and a head (RATE: a tc rate such as 10gbit, 1gbit;
#                                               # PID: taken down by themselves when that process ends)
#   engines/hosts/hosts.sh run HOST CMD...      # run CMD on HOST (head, h1..hN), in the current directory
#   engines/hosts/hosts.sh kill HOST            # the host dies: its link goes down, all its processes are killed
#   engines/hosts/hosts.sh revive HOST          # a killed host comes back (link up, nothing running: a reboot)
#   engines/hosts/hosts.sh rate RATE            # change every link's rate limit (RATE, or unlimited)
#   engines/hosts/hosts.sh pids HOST            # the processes running on HOST, one pid a line
#   engines/hosts/hosts.sh address HOST         # HOST's address on the bridge
#   engines/hosts/hosts.sh status               # hosts, addresses, link rate, processes per host
#   engines/hosts/hosts.sh down                 # remove everything up made (safe to run twice)
#
# Every host is a network namespace with its own hostname (a UTS namespace), its own mount namespace and a
# veth link to a bridge that lives in the head's namespace; the head is where launchers and controllers run
# (engines/hosts/mpiexec runs mpiexec there). Hosts find each other by name through /etc/netns/<ns>/hosts.
# Nothing is added to the machine's own network namespace: every address is on an interface inside these
# namespaces, and there is no route out of them. With --rate, a tc token-bucket filter (tbf) limits every
# host's link in both directions (netem, for latency, is not assumed to exist).
#
# Disks, as on a cluster: $DIR/shared is one directory every host sees (a shared file system), and
# $DIR/scratch is node-local: the same path on every host, each host seeing its own disk behind it (a bind
# mount in the host's mount namespace; the root namespace sees an empty directory). Each host also has its
# own /dev/shm. All hosts share this machine's CPU cores.
#
# Needs root, iproute2 (ip, tc) and util-linux (unshare, nsenter). Environment: MPI4DL_HOSTS_DIR (state,
# disks; default /tmp/mpi4dl-hosts), MPI4DL_HOSTS_PREFIX (namespace names <prefix>-head, <prefix>-h1, ...;
# default m4d), MPI4DL_HOSTS_SUBNET (first three octets; default 10.213.0): two sets of hosts can be up at
# once under different directories and prefixes; MPI4DL_HOSTS_OWNER (as --owner: a program that brings hosts up
# for itself, such as the test suite or a benchmark, has them removed even when it is killed).
set -Eeuo pipefail

DIR=${MPI4DL_HOSTS_DIR:-/tmp/mpi4dl-hosts}
PREFIX=${MPI4DL_HOSTS_PREFIX:-m4d}
SUBNET=${MPI4DL_HOSTS_SUBNET:-10.213.0}
STATE=$DIR/state
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
BRIDGE=br0           # in the head's namespace; hosts' links are eth0, the bridge ports are named after the host

die() { echo "hosts.sh: $*" >&2; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "run as root (network namespaces need it)"
    for tool in ip tc unshare nsenter; do
        command -v "$tool" >/dev/null || die "$tool not found: install iproute2 and util-linux"
    done
}

ns_of() { echo "$PREFIX-$1"; }
address_of() {   # head: .1, hK: .(10+K)
    if [ "$1" = head ]; then echo "$SUBNET.1"; else echo "$SUBNET.$((10 + ${1#h}))"; fi
}
holder_pid() { cat "$DIR/pids/$1.pid" 2>/dev/null || true; }

load_state() {
    [ -f "$STATE" ] || die "no test hosts are up under $DIR (run: $0 up N)"
    # shellcheck source=/dev/null
    . "$STATE"
}

known_host() {
    local host=$1
    [ "$host" = head ] && return 0
    [[ "$host" =~ ^h[0-9]+$ ]] && [ "${host#h}" -ge 1 ] && [ "${host#h}" -le "$HOSTS" ]
}

# tc's burst for a rate: 10 ms of traffic, at least 64 KiB (one GSO packet).
burst_for() {
    local rate=$1 number unit bits
    [[ "$rate" =~ ^([0-9]+)([kmg]?bit)$ ]] || die "--rate $rate: give a rate such as 100mbit, 1gbit, 10gbit"
    number=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[2]}
    case $unit in
        bit) bits=$number ;; kbit) bits=$((number * 1000)) ;; mbit) bits=$((number * 1000000)) ;;
        gbit) bits=$((number * 1000000000)) ;;
    esac
    local bytes=$((bits / 8 / 100))
    echo $((bytes > 65536 ? bytes : 65536))
}

no_ipv6() {   # IPv4 only: no link-local IPv6 addresses on the namespace's interfaces
    ip netns exec "$1" sh -c 'echo 1 >/proc/sys/net/ipv6/conf/all/disable_ipv6; echo 1 >/proc/sys/net/ipv6/conf/default/disable_ipv6'
}

limit_link() {   # limit_link NS DEV RATE: a token bucket on DEV's egress (RATE unlimited: none)
    tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
    if [ "$3" != unlimited ]; then
        tc -n "$1" qdisc add dev "$2" root tbf rate "$3" burst "$(burst_for "$3")" latency 100ms
    fi
}

limit_all() {   # every host's link, both ways
    for i in $(seq 1 "$HOSTS"); do
        limit_link "$(ns_of "h$i")" eth0 "$1"          # from the host
        limit_link "$(ns_of head)" "h$i" "$1"          # to the host
    done
}

set_rate() {
    load_state
    local rate=${1:-}
    [ -n "$rate" ] || die "rate: give a rate such as 1gbit, 10gbit, or unlimited"
    [ "$rate" = unlimited ] || burst_for "$rate" >/dev/null
    limit_all "$rate"
    sed -i "s/^RATE=.*/RATE=$rate/" "$STATE"
    echo "link rate $rate on h1..h$HOSTS"
}

# One long-lived process per host holds its UTS and mount namespaces: hostname, /etc/hosts, its network's sysfs,
# /dev/shm and node-local disk. It runs `hosts.sh _init HOST` inside them.
start_holder() {
    local host=$1
    setsid nsenter --net="/run/netns/$(ns_of "$host")" unshare --uts --mount --propagation private -- \
        bash "$SELF" _init "$host" </dev/null >"$DIR/pids/$host.log" 2>&1 &
    for _ in $(seq 1 100); do
        [ -s "$DIR/pids/$host.pid" ] && return 0
        sleep 0.05
    done
    die "host $host did not start: $(cat "$DIR/pids/$host.log" 2>/dev/null)"
}

init_host() {   # inside the host's fresh namespaces
    local host=$1 ns
    ns=$(ns_of "$host")
    hostname "$host"
    # sysfs of this network namespace (its interfaces), keeping the cgroup tree under it (slurmd looks there)
    if [ -d /sys/fs/cgroup ]; then mount --rbind /sys/fs/cgroup "$DIR/.cgroup"; fi
    umount -l /sys
    mount -t sysfs sysfs /sys
    if mountpoint -q "$DIR/.cgroup"; then mount --move "$DIR/.cgroup" /sys/fs/cgroup; fi
    mount --bind "/etc/netns/$ns/hosts" /etc/hosts
    mount -t tmpfs -o mode=1777 tmpfs /dev/shm
    if [ "$host" != head ]; then mount --bind "$DIR/.disks/$host" "$DIR/scratch"; fi
    echo $$ >"$DIR/pids/$host.pid.new"
    mv "$DIR/pids/$host.pid.new" "$DIR/pids/$host.pid"
    exec sleep infinity
}

write_hosts_file() {   # /etc/netns/<ns>/hosts: the host's /etc/hosts (as `ip netns exec` would bind it too)
    local host=$1 file
    mkdir -p "/etc/netns/$(ns_of "$host")"
    file=/etc/netns/$(ns_of "$host")/hosts
    {
        echo "127.0.0.1 localhost"
        echo "$(address_of head) head"
        for i in $(seq 1 "$HOSTS"); do echo "$(address_of "h$i") h$i"; done
    } >"$file"
}

up() {
    need_root
    local count=${1:-}
    shift || true
    RATE=unlimited
    local owner=${MPI4DL_HOSTS_OWNER:-}
    while [ $# -gt 0 ]; do
        case $1 in
            --owner) owner=${2:?--owner needs a process id}; shift 2 ;;
            --owner=*) owner=${1#--owner=}; shift ;;
            --rate) RATE=${2:?--rate needs a value such as 1gbit}; burst_for "$RATE" >/dev/null; shift 2 ;;
            --rate=*) RATE=${1#--rate=}; burst_for "$RATE" >/dev/null; shift ;;
            *) die "up: unknown argument $1 (usage: $0 up N [--rate RATE] [--owner PID])" ;;
        esac
    done
    if [ -n "$owner" ]; then
        [[ "$owner" =~ ^[0-9]+$ ]] && kill -0 "$owner" 2>/dev/null || die "--owner $owner: no such process"
    fi
    [[ "$count" =~ ^[0-9]+$ ]] && [ "$count" -ge 1 ] && [ "$count" -le 200 ] || die "up N: N hosts, 1 to 200"
    [ -f "$STATE" ] && die "test hosts are already up under $DIR ($0 status; $0 down first)"
    if [[ "$(ip netns list)" =~ (^|$'\n')"$PREFIX-" ]]; then
        die "namespaces $PREFIX-* exist without state in $DIR: run $0 down (same MPI4DL_HOSTS_* settings)"
    fi
    HOSTS=$count
    trap 'echo "hosts.sh: up failed; removing what it made" >&2; down >/dev/null 2>&1 || true' ERR INT TERM
    mkdir -p "$DIR/pids" "$DIR/shared" "$DIR/scratch" "$DIR/.cgroup"
    chmod 1777 "$DIR/shared"
    printf 'HOSTS=%s\nPREFIX=%s\nSUBNET=%s\nRATE=%s\n' "$HOSTS" "$PREFIX" "$SUBNET" "$RATE" >"$STATE"
    local head
    head=$(ns_of head)
    ip netns add "$head"
    no_ipv6 "$head"
    ip -n "$head" link set lo up
    ip -n "$head" link add "$BRIDGE" type bridge
    ip -n "$head" addr add "$(address_of head)/24" dev "$BRIDGE"
    ip -n "$head" link set "$BRIDGE" up
    write_hosts_file head
    for i in $(seq 1 "$HOSTS"); do
        local host=h$i ns
        ns=$(ns_of "$host")
        ip netns add "$ns"
        no_ipv6 "$ns"
        ip -n "$ns" link set lo up
        # both ends are made inside the namespaces: no interface ever appears in the machine's own
        ip link add eth0 netns "$ns" type veth peer name "$host" netns "$head"
        ip -n "$head" link set "$host" master "$BRIDGE" up
        ip -n "$ns" addr add "$(address_of "$host")/24" dev eth0
        ip -n "$ns" link set eth0 up
        mkdir -p "$DIR/.disks/$host"
        write_hosts_file "$host"
    done
    limit_all "$RATE"
    start_holder head
    for i in $(seq 1 "$HOSTS"); do start_holder "h$i"; done
    if [ -n "$owner" ]; then
        setsid bash "$SELF" _watch "$owner" </dev/null >/dev/null 2>&1 &
    fi
    trap - ERR INT TERM
    local here
    here=$(cd "$(dirname "$0")" && pwd)
    echo "test hosts up: head + h1..h$HOSTS on $SUBNET.0/24, link rate $RATE"
    echo "  shared directory:      $DIR/shared (every host)"
    echo "  node-local directory:  $DIR/scratch (each host its own)"
    echo "  launch:                $here/mpiexec -n <ranks> <command>   (ranks round-robin over h1..h$HOSTS)"
    echo "  a shell on a host:     $0 run h1 bash"
    if [ -n "$owner" ]; then echo "  taken down when process $owner ends"; fi
}

watch_owner() {   # in a session of its own: take the hosts down once their owner has ended (unless down came first)
    local owner=$1
    while [ -f "$STATE" ] && kill -0 "$owner" 2>/dev/null; do sleep 1; done
    if [ -f "$STATE" ]; then down; fi
}

pids_in() {   # every process whose network namespace is the host's
    ip netns pids "$(ns_of "$1")" 2>/dev/null || true
}

pids() {
    load_state
    known_host "$1" || die "no host $1 (head, h1..h$HOSTS)"
    local holder
    holder=$(holder_pid "$1")
    pids_in "$1" | grep -vx "$holder" || true
}

run() {
    load_state
    local host=${1:-}
    shift || true
    known_host "$host" || die "no host '$host' (head, h1..h$HOSTS)"
    [ $# -gt 0 ] || die "run $host: which command?"
    local holder
    holder=$(holder_pid "$host")
    [ -n "$holder" ] && kill -0 "$holder" 2>/dev/null || die "host $host is not running (down, or never started)"
    exec nsenter --target "$holder" --net --uts --mount -- env -C "$PWD" "$@"
}

kill_host() {
    load_state
    local host=${1:-}
    known_host "$host" && [ "$host" != head ] || die "kill: no host '$host' (h1..h$HOSTS)"
    # The link first, as a crash: peers get no goodbye (no TCP reset), they only stop hearing from it.
    ip -n "$(ns_of "$host")" link set eth0 down
    local victims count=0
    victims=$(pids "$host")
    for pid in $victims; do kill -9 "$pid" 2>/dev/null && count=$((count + 1)) || true; done
    echo "$host: link down, $count processes killed (off the network until $0 revive $host)"
}

revive() {
    load_state
    local host=${1:-}
    known_host "$host" && [ "$host" != head ] || die "revive: no host '$host' (h1..h$HOSTS)"
    ip -n "$(ns_of "$host")" link set eth0 up
    echo "$host: link up"
}

status() {
    load_state
    echo "test hosts under $DIR: head + h1..h$HOSTS, $SUBNET.0/24, link rate $RATE"
    for host in head $(seq -f 'h%g' 1 "$HOSTS"); do
        local link=up
        if [ "$host" != head ] && [[ "$(ip -n "$(ns_of "$host")" link show eth0 2>/dev/null)" != *"state UP"* ]]; then
            link=down
        fi
        printf '  %-5s %-14s link %-4s %s processes\n' "$host" "$(address_of "$host")" "$link" \
            "$(pids "$host" | grep -c . || true)"
    done
}

stop_processes() {   # SIGTERM, then SIGKILL, every process in the namespace
    local ns=$1 left
    left=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$left" ] && return 0
    # shellcheck disable=SC2086
    kill $left 2>/dev/null || true
    for _ in $(seq 1 30); do
        left=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -9 $left 2>/dev/null || true
    for _ in $(seq 1 30); do
        [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] && return 0
        sleep 0.1
    done
}

down() {
    need_root
    if [ -f "$STATE" ]; then . "$STATE"; fi      # the prefix up used
    local namespaces removed=0
    namespaces=$(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX-\(head\|h[0-9]\+\)$" || true)
    for ns in $namespaces; do stop_processes "$ns"; done
    for ns in $namespaces; do
        ip netns del "$ns" 2>/dev/null || true      # its veth ends and the bridge go with it
        removed=$((removed + 1))
    done
    rm -rf /etc/netns/"$PREFIX"-head /etc/netns/"$PREFIX"-h[0-9]*
    rmdir /etc/netns 2>/dev/null || true            # only when nothing else lives there
    if [ -d "$DIR" ]; then
        rm -rf "$DIR/pids" "$DIR/.disks" "$DIR/state"
        rmdir "$DIR/scratch" "$DIR/.cgroup" 2>/dev/null || true
        if [ -d "$DIR/shared" ] && [ -n "$(ls -A "$DIR/shared")" ]; then
            echo "kept $DIR/shared ($(find "$DIR/shared" -type f | wc -l) files): remove it yourself when done"
        else
            rmdir "$DIR/shared" 2>/dev/null || true
            rmdir "$DIR" 2>/dev/null || true
        fi
    fi
    echo "test hosts down ($removed namespaces removed)"
}

case "${1:-}" in
    _init) load_state; init_host "$2" ;;
    _watch) watch_owner "$2" ;;
    up) shift; up "$@" ;;
    down) down ;;
    run) shift; run "$@" ;;
    kill) need_root; kill_host "${2:-}" ;;
    revive) need_root; revive "${2:-}" ;;
    rate) need_root; set_rate "${2:-}" ;;
    pids) load_state; pids "${2:-}" ;;
    address) load_state; known_host "${2:-}" || die "no host '${2:-}' (head, h1..h$HOSTS)"; address_of "$2" ;;
    status) status ;;
    *) die "usage: $0 up N [--rate RATE] [--owner PID] | down | run HOST CMD... | kill HOST | revive HOST | rate RATE | pids HOST |" \
           "address HOST | status" ;;
esac
