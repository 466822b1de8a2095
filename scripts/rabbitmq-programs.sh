# Sourced by scripts/local-cluster.sh and scripts/tls-node.sh: which RabbitMQ
# server and CLI their extra nodes run.
#
# By default the local installation's: the server as the rabbitmq user (its
# folders must belong to it: chown_to), the CLI through Debian's wrappers,
# which switch to that user themselves. With DEFERRED_RABBITMQ_RELEASE=4.3 (or
# 4.0), that release from scripts/rabbitmq-release.sh's chroot, as root.
# Sets: server (the command that starts a node), server_bin (empty when there
# is none), as_rabbitmq (the command prefix the server runs under), chown_to,
# release; and defines rabbitmqctl and rabbitmq-diagnostics for that release.

server_bin=/usr/lib/rabbitmq/bin/rabbitmq-server
[ -x "$server_bin" ] || server_bin="$(command -v rabbitmq-server || true)"
server=("$server_bin")
as_rabbitmq=(env)
chown_to=""
release="${DEFERRED_RABBITMQ_RELEASE:-}"
release_script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/rabbitmq-release.sh"
if [ -n "$release" ]; then
    server=("$release_script" "$release" exec rabbitmq-server)
    server_bin="${server[0]}"
elif [ "$(id -u)" = 0 ] && id rabbitmq >/dev/null 2>&1; then
    as_rabbitmq=(runuser -u rabbitmq -- env "HOME=$(getent passwd rabbitmq | cut -d: -f6)")
    chown_to=rabbitmq:rabbitmq
fi

rabbitmqctl() {
    if [ -n "$release" ]; then
        "$release_script" "$release" exec rabbitmqctl "$@"
    else
        command rabbitmqctl "$@"
    fi
}

rabbitmq-diagnostics() {
    if [ -n "$release" ]; then
        "$release_script" "$release" exec rabbitmq-diagnostics "$@"
    else
        command rabbitmq-diagnostics "$@"
    fi
}
