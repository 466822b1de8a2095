#!/usr/bin/env bash
# Runs COMMAND (a pytest command line, possibly behind a wrapper such as
# scripts/rabbitmq-release.sh ... run --) once, or, with WHOLE=1, twice: the
# suite without the three-node cluster's tests, then those tests alone.
#
#   WHOLE=1 scripts/pytest-runs.sh COMMAND...
#
# Why two runs: the cluster tests start, kill and restart RabbitMQ nodes, and
# take a third of the whole suite's time (twice as long on RabbitMQ 4.3 as on
# 3.10); split, each run stays within CI's 15 minutes. The second run goes on
# when the first fails, so one pass shows every failure; the exit status is the
# first run's failure, else the second's.
set -uo pipefail
if [ "${WHOLE:-0}" != 1 ]; then
    exec "$@"
fi
"$@" --ignore=tests/test_cluster.py
first=$?
"$@" tests/test_cluster.py
second=$?
[ "$first" != 0 ] && exit "$first"
exit "$second"
