#!/usr/bin/env bash
# The whole test suite: broker check, lint, types, then pytest against RabbitMQ.
#
#   scripts/test.sh [pytest arguments]
#
# PYTHON picks the interpreter (default python3); DJANGO pins the Django line.
# Fails, never skips, when RabbitMQ does not answer or Chromium is missing (the
# status page's browser test); as root on Debian/Ubuntu both are installed first,
# and openssl (the TLS tests make their certificates with it).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/ensure-rabbitmq.sh
scripts/ensure-chromium.sh
if ! command -v openssl >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "openssl is not installed: installing Debian's package (the TLS tests need it)..."
    apt-get install -y -qq openssl >/dev/null || { apt-get update -qq && apt-get install -y -qq openssl >/dev/null; }
fi
venv="$(scripts/bootstrap.sh "${PYTHON:-python3}")"
"$venv/bin/python" -c 'import django, sys; print(f"Python {sys.version.split()[0]}, Django {django.__version__}")'

"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy" deferred demo_project bench

"$venv/bin/pytest" "$@"
