#!/usr/bin/env bash
# Runs COMMAND (a pytest command line, possibly behind a wrapper such as
# scripts/rabbitmq-release.sh ... run --) once, or, with WHOLE=1, the whole
# suite in four runs:
#   1. every test but the cluster's and those marked "alone" or "quiet", in
#      PARALLEL processes side by side (pytest-xdist), a file to a process (the
#      tests of a file may share a node they start, such as the TLS node), the
#      longest files first (tests/conftest.py);
#   2. the tests marked "quiet", one after the other, with nothing beside them:
#      they hold a timing to a few milliseconds that a busy host misses;
#   3. the tests marked "alone", one after the other: they restart the broker,
#      close every connection or raise its memory alarm, which the tests beside
#      them would feel;
#   4. beside run 3, the three-node cluster's tests, one after the other: they
#      start, kill and restart nodes of their own, which run 3 does not touch.
#      Run 3 mostly waits on its broker's restarts (a quarter of the host's
#      cores busy), so the two together take little more than the cluster's.
#
#   WHOLE=1 [MARK='not slow'] [PARALLEL=3] scripts/pytest-runs.sh COMMAND...
#
# Why side by side: one process after the other, the tests mostly wait, on the
# broker and on real delays of milliseconds to seconds. Side by side they keep a
# 2-core host busy (the broker takes about one core), so more processes gain
# nothing and make timing tests miss: three, by default. Each test run gets a
# PREFIX of its own (tests/settings.py), so processes side by side share no queue;
# behind scripts/rabbitmq-release.sh each run even has a broker of its own.
# MARK keeps only the tests it selects (pytest -m), in every run. Every run goes
# on when one fails, so one pass shows every failure; the exit status is the
# first failing run's (run 3's before run 4's).
set -uo pipefail
if [ "${WHOLE:-0}" != 1 ]; then
    exec "$@"
fi
mark="${MARK:-}"
both() { # $1: this run's own selection; with MARK, both must hold
    if [ -n "$mark" ]; then echo "($mark) and ($1)"; else echo "$1"; fi
}
status=0
note() { # $1: a run's exit code
    local code=$1
    # 5: no test was selected (MARK left none in this run), which is no failure.
    [ "$code" = 5 ] && code=0
    [ "$status" = 0 ] && status=$code
}
run() {
    local code=0
    "$@" || code=$?
    note "$code"
}
run "$@" -n "${PARALLEL:-3}" --dist loadfile --ignore=tests/cluster/test_cluster.py \
    -m "$(both "not alone and not quiet")"
run "$@" --ignore=tests/cluster/test_cluster.py -m "$(both quiet)"
# Run 3 writes to a file while run 4 writes here; its output follows run 4's.
alone_log="$(mktemp)"
trap 'rm -f "$alone_log"' EXIT
"$@" --ignore=tests/cluster/test_cluster.py -m "$(both alone)" >"$alone_log" 2>&1 &
alone=$!
cluster_code=0
if [ -n "$mark" ]; then
    "$@" tests/cluster/test_cluster.py -m "$mark" || cluster_code=$?
else
    "$@" tests/cluster/test_cluster.py || cluster_code=$?
fi
alone_code=0
wait "$alone" || alone_code=$?
echo "== The tests marked \"alone\" (run beside the cluster's):"
cat "$alone_log"
note "$alone_code"
note "$cluster_code"
exit "$status"
