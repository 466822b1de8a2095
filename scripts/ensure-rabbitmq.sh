#!/usr/bin/env bash
# Make sure a RabbitMQ broker answers before the demo or the tests start.
#
# The broker is the one DEFERRED_BROKER_URL names (default: localhost:5672).
# A local broker that does not answer is started; when RabbitMQ is not
# installed at all and we are root on Debian/Ubuntu, it is installed from the
# distribution's packages first. Exits non-zero if no broker answers in the end.
set -euo pipefail

urls="${DEFERRED_BROKER_URL:-amqp://guest:guest@127.0.0.1:5672/%2F}"
host_port() {
    local hostport="${1#*://}"
    hostport="${hostport#*@}"
    hostport="${hostport%%/*}"
    hostport="${hostport%%\?*}"
    host="${hostport%%:*}"
    port=5672
    [[ "$hostport" == *:* ]] && port="${hostport##*:}"
    return 0
}

answers() { (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; }

# A comma-separated list is a cluster: any node that answers will do. Its
# nodes are not started here (for the local one: scripts/local-cluster.sh start).
if [[ "$urls" == *,* ]]; then
    IFS=, read -ra list <<< "$urls"
    for one in "${list[@]}"; do
        host_port "$one"
        if answers; then
            echo "RabbitMQ answers on $host:$port, a node of DEFERRED_BROKER_URL."
            exit 0
        fi
    done
    echo "No node of DEFERRED_BROKER_URL answers (the local cluster: scripts/local-cluster.sh start)." >&2
    exit 1
fi
host_port "$urls"

if answers; then
    echo "RabbitMQ answers on $host:$port."
    exit 0
fi

case "$host" in
    127.0.0.1|localhost|::1) ;;
    *) echo "RabbitMQ at $host:$port (DEFERRED_BROKER_URL) does not answer." >&2; exit 1 ;;
esac

if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "RabbitMQ is not installed: installing Debian's rabbitmq-server package..."
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq rabbitmq-server >/dev/null
    else
        echo "RabbitMQ is not installed. Install it (e.g. 'sudo apt-get install rabbitmq-server'" >&2
        echo "on Debian/Ubuntu), or set DEFERRED_BROKER_URL to a broker that runs." >&2
        exit 1
    fi
fi
export PATH="$PATH:/usr/sbin"

if ! answers; then
    echo "Starting RabbitMQ on $host:$port..."
    if [ "$(id -u)" = 0 ] || [ "$(id -un)" = rabbitmq ]; then
        rabbitmq-server -detached || true
    elif command -v sudo >/dev/null 2>&1; then
        sudo rabbitmq-server -detached || true
    else
        echo "Cannot start RabbitMQ without root: start it yourself." >&2
        exit 1
    fi
fi

for _ in $(seq 1 120); do
    if answers; then
        # The port opens near the end of boot; this waits for the rest.
        rabbitmqctl await_startup >/dev/null 2>&1 || sleep 2
        echo "RabbitMQ answers on $host:$port."
        exit 0
    fi
    sleep 1
done
echo "RabbitMQ did not answer on $host:$port within 2 minutes." >&2
exit 1
