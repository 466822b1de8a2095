#!/usr/bin/env bash
# Run a RabbitMQ node that speaks only TLS, beside the local broker, to try
# deferred's amqps:// support on one machine (the test suite starts it itself).
#
#   scripts/tls-node.sh start     make the certificates, start the node, print what to use
#   scripts/tls-node.sh stop      stop the node and remove its folder
#   scripts/tls-node.sh status    exits 0 when the node runs
#
# The node is rabbit-tls@localhost: AMQPS on 127.0.0.1:5691 (DEFERRED_TLS_PORT moves
# it), no plain AMQP listener, the management API over HTTPS on that port + 10000,
# Erlang distribution on that port + 20000. It requires a client certificate
# (mutual TLS): `fail_if_no_peer_cert`. Under DEFERRED_TLS_DIR (default
# /tmp/deferred-tls, or deferred-tls in the folder of a `rabbitmq-release.sh
# VERSION run`, so that runs side by side keep apart) it keeps its config, data, logs and certs/: ca.pem (the CA
# that signed the server's and the client's certificates), client.pem and
# client.key, and other-ca.pem (a CA that signed nothing of this node's).
# Needs the RabbitMQ server, openssl, and root or the rabbitmq user.
# DEFERRED_RABBITMQ_RELEASE=4.3 (or 4.0) runs that release instead (see
# scripts/local-cluster.sh).
set -euo pipefail

export PATH="$PATH:/usr/sbin:/sbin"

port="${DEFERRED_TLS_PORT:-5691}"
dir="${DEFERRED_TLS_DIR:-${DEFERRED_RABBITMQ_RUN_DIR:-/tmp}/deferred-tls}"
node="rabbit-tls@localhost"
limit=60
marker=".deferred-tls-node"

if ! [[ "$port" =~ ^[0-9]+$ ]] || [ "$port" -lt 1024 ] || [ "$port" -gt 45000 ]; then
    echo "DEFERRED_TLS_PORT must be a port number between 1024 and 45000." >&2
    exit 2
fi
mgmt_port=$((port + 10000))
dist_port=$((port + 20000))

# The server and CLI to run (the local ones, or DEFERRED_RABBITMQ_RELEASE's).
# shellcheck source=scripts/rabbitmq-programs.sh
. "$(dirname "$0")/rabbitmq-programs.sh"

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# The OS pid of this node's Erlang VM, found by the node name in its environment,
# in this network namespace only: a run beside this one (in a namespace of its
# own) has a TLS node of the same name.
own_net="$(readlink /proc/self/ns/net)"
vm_pid() {
    local pid
    for pid in $(cat "$dir/pid" 2>/dev/null) $(pgrep -x beam.smp || true); do
        [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "$own_net" ] || continue
        if tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ" | grep -qxF "RABBITMQ_NODENAME=$node"; then
            echo "$pid"
            return 0
        fi
    done
    return 1
}

running() { vm_pid >/dev/null && rabbitmq-diagnostics -q -n "$node" check_running >/dev/null 2>&1; }

certificates() {
    local certs="$dir/certs"
    mkdir -p "$certs"
    (
        cd "$certs"
        # CAs and certificates as strict verifiers want them (Python 3.13 turns
        # on VERIFY_X509_STRICT): key usage, basic constraints, key identifiers.
        for name in ca other-ca; do
            openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=deferred test $name" \
                -addext "basicConstraints=critical,CA:TRUE" \
                -addext "keyUsage=critical,keyCertSign,cRLSign" \
                -addext "subjectKeyIdentifier=hash" \
                -keyout "$name.key" -out "$name.pem" 2>/dev/null
        done
        leaf='basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n'
        printf "${leaf}subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n" > server.ext
        openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
            -keyout server.key -out server.csr 2>/dev/null
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
            -extfile server.ext -out server.pem 2>/dev/null
        printf "${leaf}extendedKeyUsage=clientAuth\n" > client.ext
        openssl req -newkey rsa:2048 -nodes -subj "/CN=deferred client" \
            -keyout client.key -out client.csr 2>/dev/null
        openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
            -extfile client.ext -out client.pem 2>/dev/null
        rm -f ./*.csr ./*.ext ./*.srl
        # The test suite reads the client's key; the node reads the server's.
        chmod 644 ./*.pem ./*.key
    )
}

start() {
    if running; then
        echo "$node already runs (AMQPS 127.0.0.1:$port)."
        return 0
    fi
    [ -n "$server_bin" ] || { echo "RabbitMQ is not installed." >&2; exit 1; }
    command -v openssl >/dev/null || { echo "openssl is not installed." >&2; exit 1; }
    for p in "$port" "$mgmt_port" "$dist_port"; do
        if answers "$p"; then
            echo "Port $p is taken by another program: $node cannot start." >&2
            exit 1
        fi
    done
    rm -rf "$dir"
    mkdir -p "$dir/mnesia" "$dir/log"
    touch "$dir/$marker"
    certificates
    local certs="$dir/certs"
    cat > "$dir/rabbitmq.conf" <<EOF
listeners.tcp = none
listeners.ssl.default = 127.0.0.1:$port
ssl_options.cacertfile = $certs/ca.pem
ssl_options.certfile = $certs/server.pem
ssl_options.keyfile = $certs/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
management.ssl.ip = 127.0.0.1
management.ssl.port = $mgmt_port
management.ssl.cacertfile = $certs/ca.pem
management.ssl.certfile = $certs/server.pem
management.ssl.keyfile = $certs/server.key
EOF
    echo '[rabbitmq_management].' > "$dir/enabled_plugins"
    [ -z "$chown_to" ] || chown -R "$chown_to" "$dir"
    echo "Starting $node (AMQPS 127.0.0.1:$port)..."
    (
        cd "$dir"
        "${as_rabbitmq[@]}" \
            RABBITMQ_NODENAME="$node" \
            RABBITMQ_DIST_PORT="$dist_port" \
            RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
            RABBITMQ_MNESIA_BASE="$dir/mnesia" \
            RABBITMQ_LOG_BASE="$dir/log" \
            RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
            RABBITMQ_PID_FILE="$dir/pid" \
            "${server[@]}" -detached > "$dir/startup.out" 2>&1
    ) || true
    local since=$SECONDS
    while [ $((SECONDS - since)) -lt "$limit" ]; do
        if vm_pid >/dev/null; then
            if rabbitmqctl -q -n "$node" await_startup -t 5 >/dev/null 2>&1; then
                echo "$node runs: amqps://guest:guest@localhost:$port/%2F"
                echo "CA $certs/ca.pem, client certificate $certs/client.pem and key $certs/client.key"
                return 0
            fi
        elif [ $((SECONDS - since)) -ge 10 ]; then
            break
        fi
        sleep 1
    done
    echo "$node did not start; the end of its log:" >&2
    find "$dir/log" -name '*.log' -exec tail -n 30 {} + >&2 2>/dev/null || true
    tail -n 20 "$dir/startup.out" >&2 2>/dev/null || true
    stop
    exit 1
}

stop() {
    local pid
    if pid="$(vm_pid)"; then
        rabbitmqctl -q -n "$node" stop >/dev/null 2>&1 || true
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    # Only a folder this script made is removed.
    if [ -f "$dir/$marker" ]; then
        rm -rf "$dir"
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) running ;;
    *)
        echo "usage: $0 start|stop|status" >&2
        exit 2
        ;;
esac
