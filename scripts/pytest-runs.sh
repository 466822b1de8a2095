#!/usr/bin/env bash
# Runs COMMAND (a pytest command line, possibly behind a wrapper such as
# scripts/rabbitmq-release.sh ... run --) once, or, with WHOLE=1, the whole
# suite in three runs:
#   1. every test but the cluster's and those marked "alone", in PARALLEL
#      processes side by side (pytest-xdist), a file to a process (the tests of
#      a file may share a node they start, such as the TLS node), the files with
#      the most slow tests first (tests/conftest.py);
#   2. the tests marked "alone", one after the other: they restart the broker,
#      close every connection or raise its memory alarm, which the tests beside
#      them would feel, or hold a timing to a few milliseconds that a busy host
#      misses;
#   3. the three-node cluster's tests, one after the other: they start, kill and
#      restart nodes, and their timings need the cores.
#
#   WHOLE=1 [MARK='not slow'] [PARALLEL=3] scripts/pytest-runs.sh COMMAND...
#
# Why side by side: one process after the other, the tests mostly wait, on the
# broker and on real delays of milliseconds to seconds. Side by side they keep a
# 2-core host busy (the broker takes about one core: each topology a test
# declares and deletes costs it about 3 CPU-seconds), so more processes gain
# nothing and make timing tests miss: three, by default. Each test run gets a
# PREFIX of its own (tests/settings.py), so processes side by side share no queue.
# MARK keeps only the tests it selects (pytest -m), in every run. Every run goes
# on when one fails, so one pass shows every failure; the exit status is the
# first failing run's.
set -uo pipefail
if [ "${WHOLE:-0}" != 1 ]; then
    exec "$@"
fi
mark="${MARK:-}"
both() { # $1: this run's own selection; with MARK, both must hold
    if [ -n "$mark" ]; then echo "($mark) and ($1)"; else echo "$1"; fi
}
status=0
run() {
    local code=0
    "$@" || code=$?
    # 5: no test was selected (MARK left none in this run), which is no failure.
    [ "$code" = 5 ] && code=0
    [ "$status" = 0 ] && status=$code
}
run "$@" -n "${PARALLEL:-3}" --dist loadfile --ignore=tests/test_cluster.py -m "$(both "not alone")"
run "$@" --ignore=tests/test_cluster.py -m "$(both alone)"
if [ -n "$mark" ]; then
    run "$@" tests/test_cluster.py -m "$mark"
else
    run "$@" tests/test_cluster.py
fi
exit "$status"
