#!/usr/bin/env bash
# Build the documentation site (docs/) into docs/_build/html, warnings as
# errors: a broken internal link or reference fails the build.
#
#   scripts/docs.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(scripts/bootstrap.sh "${1:-python3}")"
rm -rf docs/_build
"$venv/bin/sphinx-build" -W --keep-going -q -b html docs docs/_build/html
echo "Documentation: docs/_build/html/index.html"
