#!/usr/bin/env bash
# Run a three-node RabbitMQ cluster on loopback, beside the local broker, to try
# deferred against a cluster (quorum queues, a node going down) on one machine.
#
#   scripts/local-cluster.sh start          start the nodes that are down, cluster them, print the URLs
#   scripts/local-cluster.sh stop           stop the three nodes and remove their folder
#   scripts/local-cluster.sh status         each node's state; exits 1 unless all three run, clustered
#   scripts/local-cluster.sh kill-node N    SIGKILL node N's Erlang VM (N = 1, 2 or 3), like a crash
#   scripts/local-cluster.sh start-node N   start node N again, wait until it is back in the cluster
#   scripts/local-cluster.sh urls           the three AMQP URLs, one a line
#
# The nodes are rabbit-a@localhost, rabbit-b@localhost and rabbit-c@localhost:
# AMQP on 127.0.0.1:5681, 5682, 5683 (DEFERRED_CLUSTER_PORT moves the first),
# the management UI and HTTP API on that port + 10000 (guest / guest), Erlang
# distribution on that port + 20000. Each node has its own config, data and
# logs in a folder under DEFERRED_CLUSTER_DIR (default /tmp/deferred-cluster, or
# deferred-cluster in the folder of a `rabbitmq-release.sh VERSION run`).
# The broker already running on 5672 is never stopped or reconfigured: the
# nodes only share its epmd and its Erlang cookie (they run as the rabbitmq
# user, whose cookie the rabbitmqctl wrapper uses too). Needs the RabbitMQ
# server (scripts/ensure-rabbitmq.sh installs it) and root or the rabbitmq user.
# DEFERRED_RABBITMQ_RELEASE=4.3 (or 4.0) runs that release's nodes instead, from
# scripts/rabbitmq-release.sh's chroot, as root; `rabbitmq-release.sh VERSION run`
# sets it for the commands it runs.
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"

base_port="${DEFERRED_CLUSTER_PORT:-5681}"
# In the folder of a `rabbitmq-release.sh VERSION run` when there is one: runs
# side by side, each in its network namespace, keep apart.
cluster_dir="${DEFERRED_CLUSTER_DIR:-${DEFERRED_RABBITMQ_RUN_DIR:-/tmp}/deferred-cluster}"
letters=(a b c)
all_nodes=(1 2 3)
limit=60    # seconds a node gets to boot
marker=".deferred-local-cluster"   # `stop` removes only a folder holding this file

if ! [[ "$base_port" =~ ^[0-9]+$ ]] || [ "$base_port" -lt 1024 ] || [ "$base_port" -gt 45000 ]; then
    echo "DEFERRED_CLUSTER_PORT must be a port number between 1024 and 45000." >&2
    exit 2
fi

name() { echo "rabbit-${letters[$1-1]}@localhost"; }
amqp_port() { echo $((base_port + $1 - 1)); }
mgmt_port() { echo $((base_port + $1 - 1 + 10000)); }
dist_port() { echo $((base_port + $1 - 1 + 20000)); }
node_dir() { echo "$cluster_dir/rabbit-${letters[$1-1]}"; }
url() { echo "amqp://guest:guest@127.0.0.1:$(amqp_port "$1")/%2F"; }

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# The server and CLI to run (the local ones, or DEFERRED_RABBITMQ_RELEASE's).
# shellcheck source=scripts/rabbitmq-programs.sh
. "$(dirname "$0")/rabbitmq-programs.sh"

need_rabbitmq() {
    if [ -z "$server_bin" ] || { [ -z "$release" ] && ! command -v rabbitmqctl >/dev/null 2>&1; }; then
        echo "RabbitMQ is not installed (scripts/ensure-rabbitmq.sh installs it)." >&2
        exit 1
    fi
}

ctl() { rabbitmqctl "$@"; }

# The OS pid of node N's Erlang VM, found by the RABBITMQ_NODENAME in its
# environment (RabbitMQ 3.10 does not put the node name on the command line),
# so the main broker's VM can never match; in this network namespace only, so
# that a cluster of a run beside this one (in a namespace of its own) cannot either.
own_net="$(readlink /proc/self/ns/net)"
vm_pid() {
    local want pid
    want="RABBITMQ_NODENAME=$(name "$1")"
    for pid in $(cat "$(node_dir "$1")/pid" 2>/dev/null) $(pgrep -x beam.smp || true); do
        [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$own_net" ] || continue
        if tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ" | grep -qxF "$want"; then
            echo "$pid"
            return 0
        fi
    done
    return 1
}

# The node names are the same whatever DEFERRED_CLUSTER_DIR and _PORT say, so
# only one such cluster can run at a time: refuse to act on another one's nodes.
guard() {
    local n pid env
    for n in "${all_nodes[@]}"; do
        pid="$(vm_pid "$n")" || continue
        env="$(tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ")"
        if ! grep -qxF "RABBITMQ_MNESIA_BASE=$(node_dir "$n")/mnesia" <<< "$env" ||
            ! grep -qxF "RABBITMQ_NODE_PORT=$(amqp_port "$n")" <<< "$env"; then
            echo "$(name "$n") already runs with other settings ($(grep -E '^RABBITMQ_(MNESIA_BASE|NODE_PORT)=' <<< "$env" | tr '\n' ' '))." >&2
            echo "Stop that cluster with the DEFERRED_CLUSTER_DIR and DEFERRED_CLUSTER_PORT it was started with." >&2
            exit 1
        fi
    done
}

app_running() {
    vm_pid "$1" >/dev/null && rabbitmq-diagnostics -q -n "$(name "$1")" check_running >/dev/null 2>&1
}

# A list from `cluster_status` as node N sees it: disk_nodes (the members) or
# running_nodes. Empty when N does not answer.
cluster_list() {
    ctl -q -n "$(name "$1")" cluster_status --formatter json 2>/dev/null |
        grep -o "\"$2\":\[[^]]*\]" | grep -o '"[^"]*@[^"]*"' | tr -d '"' | tr '\n' ' ' || true
}
lists() { [[ " $1 " == *" $2 "* ]]; }

log_tail() {
    local dir log
    dir="$(node_dir "$1")"
    log="$(find "$dir/log" -name '*.log' ! -name '*_upgrade.log' -printf '%T@ %p\n' 2>/dev/null |
        sort -rn | head -n 1 | cut -d' ' -f2-)"
    echo "---- $(name "$1"): last lines of ${log:-its log (none written: can the rabbitmq user write to $dir?)} ----" >&2
    [ -z "$log" ] || tail -n 40 "$log" >&2
    if [ -s "$dir/startup.out" ]; then
        echo "---- $dir/startup.out ----" >&2
        tail -n 20 "$dir/startup.out" >&2
    fi
}

prepare() {
    local n dir
    mkdir -p "$cluster_dir"
    touch "$cluster_dir/$marker"
    for n in "${all_nodes[@]}"; do
        dir="$(node_dir "$n")"
        mkdir -p "$dir/mnesia" "$dir/log"
        cat > "$dir/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$(amqp_port "$n")
management.tcp.ip = 127.0.0.1
management.tcp.port = $(mgmt_port "$n")
EOF
        echo '[rabbitmq_management].' > "$dir/enabled_plugins"
    done
    [ -z "$chown_to" ] || chown -R "$chown_to" "$cluster_dir"
}

launch() {
    local n=$1 dir port
    dir="$(node_dir "$n")"
    for port in "$(amqp_port "$n")" "$(mgmt_port "$n")" "$(dist_port "$n")"; do
        if answers "$port"; then
            echo "Port $port is taken by another program: $(name "$n") cannot start." >&2
            exit 1
        fi
    done
    rm -f "$dir/pid"
    echo "Starting $(name "$n") (AMQP 127.0.0.1:$(amqp_port "$n"))..."
    (
        cd "$dir"
        "${as_rabbitmq[@]}" \
            RABBITMQ_NODENAME="$(name "$n")" \
            RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
            RABBITMQ_NODE_PORT="$(amqp_port "$n")" \
            RABBITMQ_DIST_PORT="$(dist_port "$n")" \
            RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
            RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config" \
            RABBITMQ_MNESIA_BASE="$dir/mnesia" \
            RABBITMQ_LOG_BASE="$dir/log" \
            RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
            RABBITMQ_PID_FILE="$dir/pid" \
            "${server[@]}" -detached > "$dir/startup.out" 2>&1
    ) || true
}

# Wait until node N has booted. `await_startup` fails at once until the new VM
# has registered with epmd, hence the loop; a VM that is gone fails early.
wait_up() {
    local n=$1 since=$SECONDS
    while [ $((SECONDS - since)) -lt "$limit" ]; do
        if vm_pid "$n" >/dev/null; then
            ctl -q -n "$(name "$n")" await_startup -t 5 >/dev/null 2>&1 && return 0
        elif [ $((SECONDS - since)) -ge 10 ]; then
            echo "$(name "$n") died while booting." >&2
            return 1
        fi
        sleep 1
    done
    echo "$(name "$n") did not boot within $limit s." >&2
    return 1
}

# A node that is up but whose app was stopped (a join that failed halfway).
revive() {
    if vm_pid "$1" >/dev/null && ! app_running "$1"; then
        echo "$(name "$1") is up with its app stopped: starting the app..."
        ctl -q -n "$(name "$1")" start_app >/dev/null 2>&1 || true
    fi
}

hard_kill() {
    local pid
    pid="$(vm_pid "$1")" || return 0
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
}

stop_node() {
    echo "Stopping $(name "$1")..."
    timeout 60 rabbitmqctl -q -n "$(name "$1")" stop >/dev/null 2>&1 || true
    for _ in $(seq 1 50); do
        vm_pid "$1" >/dev/null || return 0
        sleep 0.2
    done
    echo "$(name "$1") did not stop: killing it."
    hard_kill "$1"
}

wipe_data() {
    echo "$(name "$1") holds data from another cluster (the running one does not list it): wiping it."
    rm -rf "$(node_dir "$1")/mnesia"
    prepare
}

# The node the others join: node 1, or any running node when node 1 is down.
reference() {
    local m
    for m in "${all_nodes[@]}"; do
        [ "$m" != "$1" ] && app_running "$m" && { echo "$m"; return 0; }
    done
    return 1
}

# Make node N (running) a member of the cluster of the reference node.
join() {
    local n=$1 ref out
    ref="$(reference "$n")" || return 0
    if lists "$(cluster_list "$ref" disk_nodes)" "$(name "$n")" &&
        lists "$(cluster_list "$n" disk_nodes)" "$(name "$ref")"; then
        return 0
    fi
    echo "Joining $(name "$n") to $(name "$ref")..."
    ctl -q -n "$(name "$n")" stop_app >/dev/null
    if ! out="$(ctl -q -n "$(name "$n")" join_cluster "$(name "$ref")" 2>&1)"; then
        # Stale membership on either side: forget it and join as a new node.
        echo "The join failed (${out##*$'\n'}); resetting $(name "$n") and joining again..."
        ctl -q -n "$(name "$n")" reset >/dev/null 2>&1 || ctl -q -n "$(name "$n")" force_reset >/dev/null 2>&1 || true
        ctl -q -n "$(name "$ref")" forget_cluster_node "$(name "$n")" >/dev/null 2>&1 || true
        if ! out="$(ctl -q -n "$(name "$n")" join_cluster "$(name "$ref")" 2>&1)"; then
            echo "$out" >&2
            echo "$(name "$n") could not join $(name "$ref")." >&2
            exit 1
        fi
    fi
    ctl -q -n "$(name "$n")" start_app >/dev/null 2>&1
}

# Boot the given nodes together (nodes that were in a cluster wait for their
# peers while booting, so they must not be started one after the other).
boot() {
    local n ref members
    [ $# -gt 0 ] || return 0
    prepare
    if ref="$(reference 0)"; then
        members="$(cluster_list "$ref" disk_nodes)"
        for n in "$@"; do
            if [ -d "$(node_dir "$n")/mnesia/$(name "$n")" ] && ! lists "$members" "$(name "$n")"; then
                wipe_data "$n"
            fi
        done
    fi
    for n in "$@"; do
        vm_pid "$n" >/dev/null || launch "$n"
    done
    for n in "$@"; do
        wait_up "$n" && continue
        # A node that boots beside peers that are booting too can die syncing
        # feature flags with a peer whose registry is half built (RabbitMQ
        # 3.10: incompatible_feature_flags, badmap undefined): boot it again
        # now that the others are up.
        log_tail "$n" 2> "$(node_dir "$n")/first-boot.log"
        echo "Booting $(name "$n") once more (its first boot failed; log kept in first-boot.log)..."
        hard_kill "$n"
        launch "$n"
        wait_up "$n" && continue
        # Still refused: if a running cluster does not know it, its data is
        # stale; boot it once more from an empty folder (join() re-adds it).
        if [ "$n" != 1 ] && ref="$(reference "$n")" &&
            ! lists "$(cluster_list "$ref" disk_nodes)" "$(name "$n")"; then
            hard_kill "$n"
            wipe_data "$n"
            launch "$n"
            wait_up "$n" && continue
        fi
        log_tail "$n"
        if [ "$#" = 1 ] && ! reference "$n" >/dev/null; then
            echo "(A node that was in a cluster waits for its peers: with all nodes down, use 'start'.)" >&2
        fi
        exit 1
    done
}

# Print the nodes and the cluster; true if all three run in one cluster.
show() {
    local n state ok=0 seen="" running=""
    for n in "${all_nodes[@]}"; do
        if app_running "$n"; then
            state=running
            [ -n "$seen" ] || seen="$n"
        elif vm_pid "$n" >/dev/null; then
            state="up, app not running"
            ok=1
        else
            state=down
            ok=1
        fi
        printf '%-20s amqp 127.0.0.1:%-6s management http://127.0.0.1:%s/  %s\n' \
            "$(name "$n")" "$(amqp_port "$n")" "$(mgmt_port "$n")" "$state"
    done
    if [ -n "$seen" ]; then
        running="$(cluster_list "$seen" running_nodes)"
        echo "Cluster as $(name "$seen") sees it: running nodes: ${running% }; members: $(cluster_list "$seen" disk_nodes | sed 's/ $//')"
        for n in "${all_nodes[@]}"; do
            lists "$running" "$(name "$n")" || ok=1
        done
    else
        echo "Cluster: no node runs."
    fi
    return "$ok"
}

usage() {
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

node_arg() {
    [[ "${1:-}" =~ ^[123]$ ]] || usage
}

cmd="${1:-}"
case "$cmd" in
    start|stop|status|kill-node|start-node) guard ;;
esac
case "$cmd" in
    start)
        need_rabbitmq
        since=$SECONDS
        down=()
        for n in "${all_nodes[@]}"; do
            app_running "$n" || down+=("$n")
        done
        for n in "${down[@]}"; do revive "$n"; done
        todo=()
        for n in "${down[@]}"; do
            app_running "$n" || todo+=("$n")
        done
        boot "${todo[@]}"
        for n in 2 3; do join "$n"; done
        if [ ${#down[@]} -eq 0 ]; then
            echo "All three nodes were already running."
        else
            echo "Cluster ready in $((SECONDS - since)) s."
        fi
        show || { echo "The cluster is not complete." >&2; exit 1; }
        echo "AMQP URLs:"
        for n in "${all_nodes[@]}"; do url "$n"; done
        ;;
    stop)
        # The three together: their data goes anyway, so no order matters.
        for n in "${all_nodes[@]}"; do
            vm_pid "$n" >/dev/null && stop_node "$n" &
        done
        wait
        if [ -d "$cluster_dir" ]; then
            if [ ! -e "$cluster_dir/$marker" ]; then
                echo "$cluster_dir was not made by this script: not removing it." >&2
                exit 1
            fi
            rm -rf "$cluster_dir"
        fi
        echo "Cluster stopped; $cluster_dir removed."
        ;;
    status)
        need_rabbitmq
        show
        ;;
    kill-node)
        node_arg "${2:-}"
        n=$2
        if ! pid="$(vm_pid "$n")"; then
            echo "$(name "$n") is not running."
            exit 0
        fi
        echo "Killing $(name "$n") (pid $pid) with SIGKILL..."
        hard_kill "$n"
        for _ in $(seq 1 50); do
            answers "$(amqp_port "$n")" || break
            sleep 0.2
        done
        if answers "$(amqp_port "$n")"; then
            echo "Port $(amqp_port "$n") still answers." >&2
            exit 1
        fi
        echo "$(name "$n") is down; port $(amqp_port "$n") no longer answers."
        ;;
    start-node)
        node_arg "${2:-}"
        need_rabbitmq
        n=$2
        since=$SECONDS
        revive "$n"
        app_running "$n" || boot "$n"
        join "$n"
        for _ in $(seq 1 30); do
            ref="$(reference "$n")" || ref="$n"
            lists "$(cluster_list "$ref" running_nodes)" "$(name "$n")" && break
            sleep 1
        done
        running="$(cluster_list "$n" running_nodes)"
        if ! lists "$running" "$(name "$n")"; then
            echo "$(name "$n") runs but is not in the cluster." >&2
            exit 1
        fi
        echo "$(name "$n") is running in the cluster ($((SECONDS - since)) s); running nodes: ${running% }"
        url "$n"
        ;;
    urls)
        for n in "${all_nodes[@]}"; do url "$n"; done
        ;;
    *)
        usage
        ;;
esac
