#!/usr/bin/env bash
# The whole test suite: broker check, lint, types, then pytest against RabbitMQ.
#
#   scripts/test.sh [pytest arguments]
#
# PYTHON picks the interpreter (default python3); DJANGO pins the Django line.
# Fails, never skips, when RabbitMQ does not answer or Chromium is missing (the
# status page's browser test); as root on Debian/Ubuntu both are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/ensure-rabbitmq.sh
scripts/ensure-chromium.sh
venv="$(scripts/bootstrap.sh "${PYTHON:-python3}")"
"$venv/bin/python" -c 'import django, sys; print(f"Python {sys.version.split()[0]}, Django {django.__version__}")'

"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy" deferred demo_project bench

"$venv/bin/pytest" "$@"
