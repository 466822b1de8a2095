#!/usr/bin/env bash
# Runs COMMAND (a pytest command line, possibly behind a wrapper such as
# scripts/rabbitmq-release.sh ... run --) once, or, with WHOLE=1, three times:
# the test files from a to r, those from s to z, then the three-node cluster's
# tests alone.
#
#   WHOLE=1 scripts/pytest-runs.sh COMMAND...
#
# Why three runs: the cluster tests start, kill and restart RabbitMQ nodes, and
# take a third of the whole suite's time (twice as long on RabbitMQ 4.3 as on
# 3.10), and the rest took 16 minutes in one run on a loaded host; split, each
# run stays within CI's 15 minutes. Every run goes on when one fails, so one
# pass shows every failure; the exit status is the first failing run's.
set -uo pipefail
if [ "${WHOLE:-0}" != 1 ]; then
    exec "$@"
fi
later=()
for file in tests/test_[s-z]*.py; do
    [ "$file" = tests/test_cluster.py ] || later+=("$file")
done
ignored=()
for file in "${later[@]}"; do
    ignored+=("--ignore=$file")
done
status=0
"$@" --ignore=tests/test_cluster.py "${ignored[@]}" || status=$?
code=0
"$@" "${later[@]}" || code=$?
[ "$status" = 0 ] && status=$code
code=0
"$@" tests/test_cluster.py || code=$?
[ "$status" = 0 ] && status=$code
exit "$status"
