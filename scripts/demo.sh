#!/usr/bin/env bash
# Run the demo: broker, database, topology, then the worker and the web server together.
#
#   scripts/demo.sh            then open http://127.0.0.1:8000/
#                              (status page: /deferred/, as admin / admin)
#
# PORT changes the web port; DEFERRED_BROKER_URL and DATABASE_URL are read by
# demo_project/settings.py. Ctrl-C stops both processes (the worker finishes
# its running jobs first).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/ensure-rabbitmq.sh
venv="$(scripts/bootstrap.sh "${PYTHON:-python3}")"
py="$venv/bin/python"
export DJANGO_SETTINGS_MODULE=demo_project.settings

"$py" manage.py migrate --noinput
# A staff account for the admin and the status page (local demo only).
"$py" manage.py shell -v 0 -c "
from django.contrib.auth.models import User
if not User.objects.filter(username='admin').exists():
    User.objects.create_superuser('admin', '', 'admin')
"
"$py" manage.py declare_delay_topology
"$py" manage.py run_deferred_worker --concurrency 4 &
worker=$!
stop() { kill -TERM "$worker" 2>/dev/null && wait "$worker" 2>/dev/null || true; }
trap stop EXIT
trap 'exit 130' INT TERM

echo "Demo running: open http://127.0.0.1:${PORT:-8000}/  (Ctrl-C to stop)"
echo "Status page: http://127.0.0.1:${PORT:-8000}/deferred/  (log in as admin / admin)"
"$py" manage.py runserver --noreload "127.0.0.1:${PORT:-8000}"
