#!/usr/bin/env bash
# Run the demo: broker, database, topology, then the worker and the web server together.
#
#   scripts/demo.sh            then open http://127.0.0.1:8000/
#                              (status page: /deferred/, as admin / admin)
#
# PORT changes the web port (8000); DEFERRED_BROKER_URL and DATABASE_URL are read
# by demo_project/settings.py. Ctrl-C, or SIGTERM to this script, stops both
# processes (the worker finishes its running jobs first). The demo gets a
# virtualenv of its own (.venv-demo) with what it needs only: deferred and
# django-environ, not the development tools.
set -euo pipefail
cd "$(dirname "$0")/.."

port="${PORT:-8000}"
scripts/ensure-rabbitmq.sh
venv="$(VENV=.venv-demo EXTRAS=demo scripts/bootstrap.sh "${PYTHON:-python3}")"
py="$venv/bin/python"
export DJANGO_SETTINGS_MODULE=demo_project.settings

# Before anything starts: a taken port would only show up after the worker ran.
# SO_REUSEADDR, as runserver binds: the connections of a demo just stopped
# (TIME_WAIT) do not count, a server listening there does.
if ! "$py" -c "
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(('127.0.0.1', int(sys.argv[1])))
except OSError:
    sys.exit(1)
" "$port"; then
    echo "Port $port is taken (another demo, or another server?). Stop it, or pick another" \
        "port: PORT=8001 scripts/demo.sh" >&2
    exit 1
fi

"$py" manage.py migrate --noinput
# A staff account for the admin and the status page (local demo only).
"$py" manage.py shell -v 0 -c "
from django.contrib.auth.models import User
if not User.objects.filter(username='admin').exists():
    User.objects.create_superuser('admin', '', 'admin')
"
"$py" manage.py declare_delay_topology

worker="" server=""
stop() {
    trap - INT TERM EXIT
    # The web server at once; the worker finishes its running jobs (SIGTERM).
    [ -n "$server" ] && kill -TERM "$server" 2>/dev/null || true
    [ -n "$worker" ] && kill -TERM "$worker" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

"$py" manage.py run_deferred_worker --concurrency 4 &
worker=$!
"$py" manage.py runserver --noreload "127.0.0.1:$port" &
server=$!
# Say it runs once it answers (runserver checks the project first). The probe
# runs in the background: a signal to this script alone (kill -INT PID) that
# came while bash waited for a foreground child would only be acted on if that
# child died of it too, whereas the wait builtin returns at once for the trap.
(
    for _ in $(seq 1 100); do
        if "$py" -c "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 0.2)" "$port" 2>/dev/null; then
            echo "Demo running: open http://127.0.0.1:$port/  (Ctrl-C to stop)"
            echo "Status page: http://127.0.0.1:$port/deferred/  (log in as admin / admin)"
            break
        fi
        kill -0 "$server" 2>/dev/null || break
        sleep 0.2
    done
) &
wait "$!" || true
# Until either process ends (or a signal comes: wait returns at once for the trap).
wait -n "$worker" "$server" || true
