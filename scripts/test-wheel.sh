#!/usr/bin/env bash
# The test suite against the built wheel, not this checkout: what a user
# installs is what is tested.
#
#   scripts/test-wheel.sh [pytest arguments]     e.g. -k transfer
#
# With no arguments, the whole suite in its four runs (scripts/pytest-runs.sh);
# MARK='not slow' keeps the fast tests only, in the same four runs.
#
# The wheel is built from a clone of the committed tree (uncommitted changes
# are not tested here), installed with its dev extra into a fresh virtualenv,
# and the suite runs in that clone, from which deferred/ is removed, so that only the installed package can be
# imported (the worker processes the tests start too). Lint and types are not
# run here: they read the source, and scripts/test.sh runs them.
#
# PYTHON picks the interpreter; DJANGO pins the Django line; PINS adds more
# requirement specifiers installed with the wheel (the oldest-releases job:
# PINS='Django==5.2 pika==1.4.0'); RABBITMQ_RELEASE=4.3 (or 4.0) runs pytest
# against that RabbitMQ release, as in scripts/test.sh. Fails, never skips, when
# RabbitMQ does not answer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts="$PWD/scripts"
# With no pytest arguments: the whole suite, in four runs (scripts/pytest-runs.sh).
whole=0
[ $# -eq 0 ] && whole=1

release=()
if [ -n "${RABBITMQ_RELEASE:-}" ]; then
    scripts/rabbitmq-release.sh "$RABBITMQ_RELEASE" setup
    release=("$PWD/scripts/rabbitmq-release.sh" "$RABBITMQ_RELEASE" run --)
else
    scripts/ensure-rabbitmq.sh
fi
# The transfer tests move jobs to a RabbitMQ 4.3 node beside the broker under
# test, which they start: its chroot is built here, where the network is.
scripts/rabbitmq-release.sh 4.3 setup
scripts/ensure-chromium.sh
python="${PYTHON:-python3}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip >/dev/null
# The wheel is built from a clone of the commit, as the tests are: the build
# writes nothing into this checkout, where another job may be building too.
git clone -q . "$work/src"
"$work/venv/bin/python" -m pip wheel -q --no-deps --wheel-dir "$work/dist" "$work/src" >/dev/null
wheel="$(ls "$work"/dist/*.whl)"
read -ra pins <<<"${PINS:-}"
"$work/venv/bin/python" -m pip install -q "$wheel[dev]" ${DJANGO:+"$DJANGO"} ${pins[@]+"${pins[@]}"} >/dev/null

rm -rf "$work/src/deferred" "$work/src/build" "$work"/src/*.egg-info
cd "$work/src"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

import deferred

where = Path(deferred.__file__).resolve()
assert Path(sys.argv[1]).resolve() in where.parents, f"deferred comes from {where}, not the wheel"
print(f"Testing the installed wheel: {where.parent}, version {deferred.__version__}")
print(
    f"Python {sys.version.split()[0]}, Django {metadata.version('Django')}, "
    f"pika {metadata.version('pika')}"
)
PY
# The demo command's test clones the committed tree and runs scripts/demo.sh on
# python3, whatever is installed here: it tests the checkout, and test.sh runs it.
WHOLE="$whole" "$scripts/pytest-runs.sh" ${release[@]+"${release[@]}"} \
    "$work/venv/bin/pytest" --ignore=tests/test_readme_commands.py "$@"
