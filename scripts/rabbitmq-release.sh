#!/usr/bin/env bash
# Run another RabbitMQ release (Debian's package, in a chroot) beside the
# system broker, which is never stopped or reconfigured.
#
#   scripts/rabbitmq-release.sh VERSION setup          build the release's chroot (once; kept)
#   scripts/rabbitmq-release.sh VERSION start          start a node on loopback beside the system broker
#   scripts/rabbitmq-release.sh VERSION stop           stop that node and remove its folder
#   scripts/rabbitmq-release.sh VERSION status         exits 0 when that node runs
#   scripts/rabbitmq-release.sh VERSION run -- CMD...  CMD in a private network namespace where
#                                                      this release is the broker on 127.0.0.1:5672
#   scripts/rabbitmq-release.sh VERSION exec PROG...   one of the release's programs (rabbitmqctl,
#                                                      rabbitmq-queues, rabbitmq-diagnostics,
#                                                      rabbitmq-plugins, rabbitmq-server)
#
# VERSION is 4.3 (Debian sid's package, Erlang 29) or 4.0 (Debian 13 trixie's,
# Erlang 27). `setup` makes a `debootstrap --variant=minbase` chroot under
# DEFERRED_RABBITMQ_CACHE (default ~/.cache/deferred-rabbitmq) and installs
# rabbitmq-server there without recommends; every other command runs it first.
#
# `start` runs node rabbit-VV@localhost (VV = 43 or 40): AMQP on 127.0.0.1:56VV,
# the management API on that port + 10000, distribution on that port + 20000,
# and its own epmd on that port - 1000, with its data, logs and config under
# /tmp/deferred-rabbitmq-VERSION (inside `run`'s namespace, under its folder:
# the host may run its own). `VERSION exec rabbitmqctl ...` talks to it.
#
# `run` gives CMD a network namespace of its own (`unshare --net`), where
# 127.0.0.1:5672 is free, starts rabbit@localhost there with the management API
# on 15672, puts wrappers for rabbitmqctl, rabbitmq-queues, rabbitmq-diagnostics
# and rabbitmq-plugins first on PATH, and exports DEFERRED_RABBITMQ_RELEASE so
# that scripts/local-cluster.sh and scripts/tls-node.sh start this release too.
# The node stops and its folder goes when CMD ends, however it ends; CMD's exit
# status is the script's. CMD has no network but loopback: install first.
#
# Settings for `start` and `run`, in the environment:
#   RABBITMQ_MANAGEMENT=0       no management plugin (default 1: enabled)
#   RABBITMQ_DENY_DEPRECATED=1  deny every deprecated feature the release knows
#   RABBITMQ_CONF_EXTRA='k = v' more rabbitmq.conf lines (e.g. consumer_timeout = 5000)
#
# Fails (never skips) when the chroot cannot be built or the node does not boot.
# Needs root (chroot, mount and network namespaces) and debootstrap, which it
# installs from Debian's packages when missing. The bind mounts (/dev, /proc,
# /sys, /tmp) live in a private mount namespace: nothing shows on the host.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
here="$(cd "$(dirname "$0")" && pwd)"
self="$here/$(basename "$0")"

usage() {
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

version="${1:-}"
command="${2:-}"
[ -n "$version" ] && [ -n "$command" ] || usage
shift 2
case "$version" in
    4.3) suite=sid ;;
    4.0) suite=trixie ;;
    *) echo "Unknown RabbitMQ release '$version': 4.3 or 4.0." >&2; exit 2 ;;
esac
short="${version/./}"
cache="${DEFERRED_RABBITMQ_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deferred-rabbitmq}"
root="$cache/rabbitmq-$version"
mirror="${DEFERRED_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
limit=90   # seconds a node gets to boot
# The chroot's HOME for node and CLI alike: one Erlang cookie for both.
chroot_home=/var/lib/rabbitmq

# ------------------------------------------------------------------ the chroot

need_root() {
    if [ "$(id -u)" != 0 ]; then
        echo "scripts/rabbitmq-release.sh needs root (chroot and namespaces)." >&2
        exit 1
    fi
}

# apt inside the chroot: sid's Release file is often past its Valid-Until date.
chroot_apt() {
    unshare --mount --fork -- bash -c '
        set -e
        r=$1; shift
        mount --bind /proc "$r/proc"; mount --rbind /dev "$r/dev"; mount --bind /sys "$r/sys"
        exec chroot "$r" env DEBIAN_FRONTEND=noninteractive apt-get -q \
            -o Acquire::Check-Valid-Until=false "$@"
    ' _ "$1" "${@:2}"
}

installed_version() {
    chroot "$1" dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null || true
}

setup() {
    need_root
    [ -x "$root/usr/lib/rabbitmq/bin/rabbitmq-server" ] && return 0
    if ! command -v debootstrap >/dev/null 2>&1; then
        command -v apt-get >/dev/null 2>&1 || { echo "debootstrap is missing and apt-get is not here to install it." >&2; exit 1; }
        echo "Installing Debian's debootstrap package..."
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
    fi
    mkdir -p "$cache"
    exec 9>"$cache/.lock-$version"
    flock 9
    [ -x "$root/usr/lib/rabbitmq/bin/rabbitmq-server" ] && return 0
    local work="$root.building" since=$SECONDS got
    rm -rf "$work"
    echo "Building a Debian $suite chroot for RabbitMQ $version in $root..."
    if ! debootstrap --variant=minbase "$suite" "$work" "$mirror" > "$cache/debootstrap-$version.log" 2>&1; then
        tail -n 20 "$cache/debootstrap-$version.log" >&2
        echo "debootstrap of Debian $suite failed (log: $cache/debootstrap-$version.log)." >&2
        exit 1
    fi
    cp /etc/resolv.conf "$work/etc/resolv.conf" 2>/dev/null || true
    # minbase writes no /etc/hosts: the nodes are named @localhost.
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$work/etc/hosts"
    # Nothing may start services inside the chroot while installing.
    printf '#!/bin/sh\nexit 101\n' > "$work/usr/sbin/policy-rc.d"
    chmod +x "$work/usr/sbin/policy-rc.d"
    chroot_apt "$work" update -qq
    chroot_apt "$work" install -y -qq --no-install-recommends rabbitmq-server >/dev/null
    got="$(installed_version "$work")"
    case "$got" in
        "$version".*) ;;
        *) echo "Debian $suite now has rabbitmq-server '$got', not $version.x." >&2; exit 1 ;;
    esac
    mv "$work" "$root"
    echo "RabbitMQ $got ready in $root ($((SECONDS - since)) s, $(du -sh "$root" | cut -f1))."
}

# ------------------------------------------------------------------ programs

# Run one of the release's programs in the chroot, in a mount namespace of its
# own with /dev, /proc, /sys and /tmp bound in (node folders live under /tmp).
# The environment goes through, so RABBITMQ_* settings reach the node.
run_program() {
    local program=$1
    shift
    case "$program" in
        rabbitmqctl|rabbitmq-queues|rabbitmq-diagnostics|rabbitmq-plugins|rabbitmq-server|rabbitmq-streams|rabbitmq-upgrade|epmd) ;;
        *) echo "Not a RabbitMQ program: $program." >&2; exit 2 ;;
    esac
    local path="/usr/lib/rabbitmq/bin/$program"
    [ "$program" = epmd ] && path=/usr/bin/epmd
    exec unshare --mount --fork -- bash -c '
        set -e
        r=$1; home=$2; path=$3; shift 3
        for d in proc sys tmp; do mount --bind "/$d" "$r/$d"; done
        mount --rbind /dev "$r/dev"
        cd "$r"
        exec chroot "$r" env HOME="$home" \
            RABBITMQ_PLUGINS_DIR="$(ls -d "$r"/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins | sed "s|^$r||")" \
            "$path" "$@"
    ' _ "$root" "$chroot_home" "$path" "$@"
}

# ------------------------------------------------------------------ one node

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# Write node's folder: config, enabled plugins. $1 folder, $2 AMQP port,
# $3 management port.
write_config() {
    local dir=$1 amqp=$2 mgmt=$3 feature
    mkdir -p "$dir/data" "$dir/log"
    {
        echo "listeners.tcp.local = 127.0.0.1:$amqp"
        echo "loopback_users = none"
        if [ "${RABBITMQ_MANAGEMENT:-1}" = 1 ]; then
            echo "management.tcp.ip = 127.0.0.1"
            echo "management.tcp.port = $mgmt"
        fi
        if [ "${RABBITMQ_DENY_DEPRECATED:-0}" = 1 ]; then
            for feature in $(deprecated_features); do
                echo "deprecated_features.permit.$feature = false"
            done
        fi
        [ -z "${RABBITMQ_CONF_EXTRA:-}" ] || printf '%s\n' "$RABBITMQ_CONF_EXTRA"
    } > "$dir/rabbitmq.conf"
    if [ "${RABBITMQ_MANAGEMENT:-1}" = 1 ]; then
        echo '[rabbitmq_management].' > "$dir/enabled_plugins"
    else
        echo '[].' > "$dir/enabled_plugins"
    fi
    echo "$version" > "$dir/.deferred-rabbitmq-release"
}

# The deprecated features this release knows (their names in rabbitmq.conf).
deprecated_features() {
    case "$version" in
        4.3) echo "global_qos queue_master_locator amqp_address_v1 amqp_filter_set_bug transient_nonexcl_queues management_metrics_collection" ;;
        4.0) echo "global_qos queue_master_locator amqp_address_v1 ram_node_type transient_nonexcl_queues management_metrics_collection" ;;
    esac
}

# Start node $1 with folder $2, AMQP port $3, distribution port $4; in the
# background, detached from this shell.
launch() {
    local node=$1 dir=$2 amqp=$3 dist=$4
    env RABBITMQ_NODENAME="$node" \
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
        RABBITMQ_NODE_PORT="$amqp" \
        RABBITMQ_DIST_PORT="$dist" \
        RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
        RABBITMQ_MNESIA_BASE="$dir/data" \
        RABBITMQ_LOG_BASE="$dir/log" \
        RABBITMQ_PID_FILE="$dir/pid" \
        setsid "$self" "$version" exec rabbitmq-server > "$dir/startup.out" 2>&1 < /dev/null &
}

# The OS pid of node $1's Erlang VM whose data lives in folder $2, in this
# network namespace, found in its environment: nodes of other network
# namespaces may bear the same name.
vm_pid() {
    local pid env own
    own="$(readlink /proc/self/ns/net)"
    for pid in $(pgrep -x beam.smp || true); do
        [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$own" ] || continue
        env="$(tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ")" || continue
        if grep -qxF "RABBITMQ_NODENAME=$1" <<< "$env" && grep -qxF "RABBITMQ_MNESIA_BASE=$2/data" <<< "$env"; then
            echo "$pid"
            return 0
        fi
    done
    return 1
}

# Wait until node $1 (folder $2) has booted.
wait_up() {
    local node=$1 dir=$2 since=$SECONDS
    while [ $((SECONDS - since)) -lt "$limit" ]; do
        if vm_pid "$node" "$dir" >/dev/null; then
            ctl -q -n "$node" await_startup -t 5 >/dev/null 2>&1 && return 0
        elif [ $((SECONDS - since)) -ge 15 ]; then
            break
        fi
        sleep 1
    done
    echo "RabbitMQ $version ($node) did not boot within $limit s. Last lines of its logs:" >&2
    tail -n 30 "$dir/startup.out" >&2 || true
    find "$dir/log" -name '*.log' -exec tail -n 30 {} + >&2 2>/dev/null || true
    return 1
}

# Stop node $1 (folder $2): politely, then with SIGKILL after 10 s.
stop_node() {
    local node=$1 dir=$2 pid
    timeout 60 "$self" "$version" exec rabbitmqctl -q -n "$node" stop >/dev/null 2>&1 || true
    for _ in $(seq 1 50); do
        vm_pid "$node" "$dir" >/dev/null || return 0
        sleep 0.2
    done
    pid="$(vm_pid "$node" "$dir")" && kill -KILL "$pid" 2>/dev/null || true
}

ctl() { "$self" "$version" exec rabbitmqctl "$@"; }

# ------------------------------------------------------------------ start / stop beside the system broker

side_port=$((5600 + short))          # 5643 for 4.3, 5640 for 4.0
side_node="rabbit-$short@localhost"
# Inside `run`'s namespace, in its folder: /tmp is shared with the host's node.
side_dir="${DEFERRED_RABBITMQ_RUN_DIR:-/tmp}/deferred-rabbitmq-$version"
side_epmd=$((side_port - 1000))

side_env() {
    export ERL_EPMD_PORT="$side_epmd"
    export RABBITMQ_SERVER_START_ARGS="-start_epmd false"
    export RABBITMQ_CTL_ERL_ARGS="-start_epmd false"
}

start_side() {
    setup
    side_env
    if vm_pid "$side_node" "$side_dir" >/dev/null; then
        echo "RabbitMQ $version already runs: amqp://guest:guest@127.0.0.1:$side_port/%2F"
        return 0
    fi
    local port
    for port in "$side_port" "$((side_port + 10000))" "$((side_port + 20000))" "$side_epmd"; do
        if answers "$port"; then
            echo "Port $port is taken by another program: RabbitMQ $version cannot start." >&2
            exit 1
        fi
    done
    rm -rf "$side_dir"
    write_config "$side_dir" "$side_port" "$((side_port + 10000))"
    ERL_EPMD_PORT="$side_epmd" setsid "$self" "$version" exec epmd -address 127.0.0.1 -daemon
    launch "$side_node" "$side_dir" "$side_port" "$((side_port + 20000))"
    wait_up "$side_node" "$side_dir" || { stop_side >/dev/null; exit 1; }
    echo "RabbitMQ $version runs: amqp://guest:guest@127.0.0.1:$side_port/%2F" \
        "(management http://127.0.0.1:$((side_port + 10000))/, node $side_node, epmd port $side_epmd)."
}

stop_side() {
    side_env
    vm_pid "$side_node" "$side_dir" >/dev/null && stop_node "$side_node" "$side_dir"
    "$self" "$version" exec epmd -kill >/dev/null 2>&1 || true
    if [ -e "$side_dir/.deferred-rabbitmq-release" ]; then
        rm -rf "$side_dir"
    fi
    echo "RabbitMQ $version stopped."
}

# ------------------------------------------------------------------ run CMD against this release

# What CMD may have left running in this network namespace (a local cluster or
# a TLS node whose test run was killed): their VMs and epmd go with it, and
# the folders they ran from when those are marked as made by our scripts.
stop_strays() {
    local own pid base folder
    own="$(readlink /proc/self/ns/net)"
    for pid in $(pgrep -x beam.smp || true) $(pgrep -x epmd || true); do
        [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$own" ] || continue
        base="$(tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ" | sed -n 's/^RABBITMQ_MNESIA_BASE=//p')"
        kill -KILL "$pid" 2>/dev/null || true
        [ -n "$base" ] || continue
        # The folder holding the node's data, or the one above (a cluster's).
        for folder in "$(dirname "$base")" "$(dirname "$(dirname "$base")")"; do
            if [ -e "$folder/.deferred-local-cluster" ] || [ -e "$folder/.deferred-tls-node" ]; then
                rm -rf "$folder"
            fi
        done
    done
}

# Inside the new network namespace: loopback up, the node started, CMD run,
# everything stopped and removed whatever happens.
run_inside() {
    ip link set lo up
    local status=0
    run_node=rabbit@localhost
    run_dir="$(mktemp -d /tmp/deferred-rabbitmq-run.XXXXXX)"
    local dir="$run_dir" node="$run_node"
    write_config "$dir" 5672 15672
    mkdir -p "$dir/bin"
    for program in rabbitmqctl rabbitmq-queues rabbitmq-diagnostics rabbitmq-plugins rabbitmq-streams rabbitmq-upgrade; do
        cat > "$dir/bin/$program" <<EOF
#!/bin/sh
# RabbitMQ $version's $program, run in its chroot; rabbit@localhost unless told.
RABBITMQ_NODENAME="\${RABBITMQ_NODENAME:-$node}" exec "$self" "$version" exec $program "\$@"
EOF
        chmod +x "$dir/bin/$program"
    done
    cleanup() {
        stop_node "$run_node" "$run_dir"
        stop_strays
        rm -rf "$run_dir"
    }
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    launch "$node" "$dir" 5672 25672
    wait_up "$node" "$dir"
    echo "RabbitMQ $(installed_version "$root") runs on 127.0.0.1:5672 in a private network namespace" \
        "(management plugin: $([ "${RABBITMQ_MANAGEMENT:-1}" = 1 ] && echo on || echo off)," \
        "deprecated features denied: $([ "${RABBITMQ_DENY_DEPRECATED:-0}" = 1 ] && echo all || echo none))."
    export PATH="$dir/bin:$PATH"
    export DEFERRED_RABBITMQ_RELEASE="$version" DEFERRED_RABBITMQ_RUN_DIR="$dir"
    "$@" || status=$?
    return "$status"
}

case "$command" in
    setup) setup ;;
    start) start_side ;;
    stop) stop_side ;;
    status)
        side_env
        if vm_pid "$side_node" "$side_dir" >/dev/null && ctl -q -n "$side_node" status >/dev/null 2>&1; then
            echo "RabbitMQ $version runs: amqp://guest:guest@127.0.0.1:$side_port/%2F"
        else
            echo "RabbitMQ $version does not run."
            exit 1
        fi
        ;;
    exec)
        [ $# -ge 1 ] || usage
        [ -x "$root/usr/lib/rabbitmq/bin/rabbitmq-server" ] || setup >&2
        run_program "$@"
        ;;
    run)
        [ "${1:-}" = -- ] && shift
        [ $# -ge 1 ] || usage
        setup
        exec unshare --net --fork -- "$self" "$version" __inside "$@"
        ;;
    __inside) run_inside "$@" ;;
    *) usage ;;
esac
