#!/usr/bin/env bash
# Build the sdist and the wheel as a release would, check their metadata, and
# install the wheel (not this checkout) into a fresh virtualenv: the version,
# the templates and py.typed must be in it, and the demo project must pass
# Django's checks and render the status page's template with it.
#
#   scripts/package-check.sh [PYTHON]
#
# DJANGO, if set, pins the Django release line installed with the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${1:-python3}"
venv="$(scripts/bootstrap.sh "$python")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$venv/bin/python" -m build -q --outdir "$work/dist" . >/dev/null 2>&1
"$venv/bin/twine" check --strict "$work"/dist/*
wheel="$(ls "$work"/dist/*.whl)"

"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$work/venv/bin/python" -m pip install -q "$wheel" django-environ ${DJANGO:+"$DJANGO"} >/dev/null

# The demo without the source tree: only the installed wheel can be imported.
mkdir "$work/site"
cp -r manage.py demo_project "$work/site/"
cd "$work/site"
version="$(grep -m1 '^__version__' "$OLDPWD/deferred/__init__.py" | cut -d'"' -f2)"
DJANGO_SETTINGS_MODULE=demo_project.settings "$work/venv/bin/python" - "$work/venv" "$version" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

import django

django.setup()
import deferred
from django.template.loader import get_template

venv, version = Path(sys.argv[1]).resolve(), sys.argv[2]
where = Path(deferred.__file__).resolve()
assert venv in where.parents, f"deferred imported from {where}, not the wheel"
assert deferred.__version__ == version == metadata.version("django-deferred"), deferred.__version__
assert (where.parent / "py.typed").exists(), "py.typed is missing from the wheel"
for name in ("deferred/status.html", "deferred/purge_confirm.html", "admin/index.html"):
    get_template(name)
print(f"wheel {version} ok: {where.parent}, Django {django.get_version()}")
PY
"$work/venv/bin/python" manage.py check --fail-level WARNING
