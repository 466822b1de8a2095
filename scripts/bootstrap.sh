#!/usr/bin/env bash
# Create (or refresh) the virtualenv for a Python interpreter and print its path.
#
#   scripts/bootstrap.sh [PYTHON]     e.g. scripts/bootstrap.sh python3.12
#
# DJANGO, if set, pins the Django release line (e.g. 'Django>=5.2,<6');
# EXTRAS picks the optional dependencies (default: dev); VENV names the
# virtualenv's folder (default: .venv, or .venv-X.Y for another Python).
# Reinstalls only when pyproject.toml, the interpreter or DJANGO changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${1:-python3}"
version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "deferred needs Python 3.11 or newer; $python is $version." >&2
    exit 1
}
venv=".venv"
[ "$version" = "$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ] || venv=".venv-$version"
venv="${VENV:-$venv}"

extras="${EXTRAS:-dev}"
stamp="$(cat pyproject.toml; echo "$version ${DJANGO:-} $extras")"
stamp="$(printf '%s' "$stamp" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "Installing into $venv (Python $version)..." >&2
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q --upgrade -e ".[$extras]" ${DJANGO:+"$DJANGO"} >&2
    echo "$stamp" > "$venv/.stamp"
fi
echo "$venv"
