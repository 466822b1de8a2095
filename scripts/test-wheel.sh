#!/usr/bin/env bash
# The whole test suite against the built wheel, not this checkout: what a user
# installs is what is tested.
#
#   scripts/test-wheel.sh [pytest arguments]
#
# Lint and types run on this checkout first (they read the source). Then the
# wheel is built, installed with its dev extra into a fresh virtualenv, and the
# suite runs in a clone of the committed tree from which deferred/ is removed,
# so that only the installed package can be imported (the worker processes the
# tests start too). PYTHON picks the interpreter, DJANGO pins the Django line.
# Fails, never skips, when RabbitMQ does not answer.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/ensure-rabbitmq.sh
scripts/ensure-chromium.sh
python="${PYTHON:-python3}"
venv="$(scripts/bootstrap.sh "$python")"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy" deferred demo_project bench

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m build -q --wheel --outdir "$work/dist" . >/dev/null 2>&1
wheel="$(ls "$work"/dist/*.whl)"
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$work/venv/bin/python" -m pip install -q "$wheel[dev]" ${DJANGO:+"$DJANGO"} >/dev/null

git clone -q . "$work/src"
rm -rf "$work/src/deferred"
cd "$work/src"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import sys
from pathlib import Path

import deferred

where = Path(deferred.__file__).resolve()
assert Path(sys.argv[1]).resolve() in where.parents, f"deferred comes from {where}, not the wheel"
print(f"Testing the installed wheel: {where.parent}, version {deferred.__version__}")
PY
"$work/venv/bin/python" -c 'import django, sys; print(f"Python {sys.version.split()[0]}, Django {django.__version__}")'
"$work/venv/bin/pytest" "$@"
