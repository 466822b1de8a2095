#!/usr/bin/env bash
# The whole test suite: broker check, lint, types, then pytest against RabbitMQ.
#
#   scripts/test.sh [pytest arguments]
#
# PYTHON picks the interpreter (default python3); DJANGO pins the Django line.
# RABBITMQ_RELEASE=4.3 (or 4.0) runs pytest against that RabbitMQ release instead
# of the local broker, in a network namespace of its own (scripts/rabbitmq-release.sh;
# RABBITMQ_MANAGEMENT and RABBITMQ_DENY_DEPRECATED pass through to it).
# Fails, never skips, when RabbitMQ does not answer or Chromium is missing (the
# status page's browser test); as root on Debian/Ubuntu both are installed first,
# and openssl (the TLS tests make their certificates with it).
set -euo pipefail
cd "$(dirname "$0")/.."

# With no pytest arguments: the whole suite, in four runs (scripts/pytest-runs.sh).
whole=0
[ $# -eq 0 ] && whole=1
if [ -n "${RABBITMQ_RELEASE:-}" ]; then
    scripts/rabbitmq-release.sh "$RABBITMQ_RELEASE" setup
    # Its namespace has no network: the demo command's test, which installs
    # the demo from a clone, runs against the local broker only.
    run=(scripts/rabbitmq-release.sh "$RABBITMQ_RELEASE" run --)
    set -- --ignore=tests/test_readme_commands.py "$@"
else
    scripts/ensure-rabbitmq.sh
    run=()
fi
# The transfer tests move jobs to a RabbitMQ 4.3 node beside the broker under
# test, which they start: its chroot is built here, where the network is.
scripts/rabbitmq-release.sh 4.3 setup
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

WHOLE="$whole" scripts/pytest-runs.sh ${run[@]+"${run[@]}"} "$venv/bin/pytest" "$@"
