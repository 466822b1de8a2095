#!/usr/bin/env bash
# Run the benchmarks and regenerate docs/bench/ (results.json, README.md, plots).
#
#   scripts/bench.sh            the full run (about an hour: 1M pending jobs, every configuration)
#   scripts/bench.sh --quick    small sizes, under 5 minutes
#   scripts/bench.sh --only sustained,scale   some scenarios; the others' results are kept
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/ensure-rabbitmq.sh
venv="$(EXTRAS=dev,bench scripts/bootstrap.sh "${PYTHON:-python3}")"
PYTHONPATH=. DJANGO_SETTINGS_MODULE=bench.settings "$venv/bin/python" -m bench "$@"
