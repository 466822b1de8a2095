"""Recurring jobs against the real broker, with several worker processes.

Each test runs workers under a PREFIX of its own (``own_topology``), scheduling
``tests.tick`` every second (DEFERRED_TEST_EVERY), and reads what ran from the
file the task appends to.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.testapp.tasks import read_records

pytestmark = pytest.mark.slow

LEADS = "now schedules the recurring jobs"


def worker_env(plan, ticks: Path, every: float = 1.0, **extra: str) -> dict[str, str]:
    return {
        "DEFERRED_TEST_PREFIX": plan.prefix,
        "DEFERRED_TEST_EVERY": str(every),
        "DEFERRED_TEST_TICKS": str(ticks),
        **extra,
    }


def occurrences(path: Path) -> Counter[float]:
    return Counter(r["occurrence"] for r in read_records(str(path)))


def leader(workers):
    leading = [w for w in workers if w.proc.poll() is None and LEADS in w.output()]
    return leading


def test_three_workers_run_each_occurrence_of_a_1s_schedule_exactly_once(
    own_topology, worker_process, tmp_path
):
    ticks = tmp_path / "ticks.jsonl"
    env = worker_env(own_topology, ticks)
    # Given three workers started together
    workers = [worker_process(env=env) for _ in range(3)]
    # When they run for 20 s
    time.sleep(20)
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(30) == 0, w.output()
    # Then exactly one of them scheduled, and every occurrence ran once, no gaps
    assert sum(LEADS in w.output() for w in workers) == 1
    rows = read_records(str(ticks))
    seen = occurrences(ticks)
    assert len(seen) >= 17, sorted(seen)
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
    instants = sorted(seen)
    assert all(b - a == 1.0 for a, b in itertools.pairwise(instants)), instants
    # never early, not grossly late
    lateness = [r["at"] - r["occurrence"] for r in rows]
    assert min(lateness) >= 0 and max(lateness) < 1.0, (min(lateness), max(lateness))
    assert len({r["job"] for r in rows}) == len(rows)


def test_killing_the_scheduling_worker_loses_no_occurrence(
    own_topology, worker_process, tmp_path, capsys
):
    ticks = tmp_path / "ticks.jsonl"
    env = worker_env(own_topology, ticks)
    workers = [worker_process(env=env) for _ in range(3)]
    assert wait_for(lambda: len(leader(workers)) == 1, 10)
    time.sleep(4)
    # When the worker that schedules is SIGKILLed
    (victim,) = leader(workers)
    killed_at = time.time()
    victim.kill()
    others = [w for w in workers if w is not victim]
    # Then another one takes over within 5 s
    assert wait_for(lambda: len(leader(others)) == 1, 10)
    takeover = time.time() - killed_at
    time.sleep(10)
    for w in others:
        w.signal(signal.SIGTERM)
    for w in others:
        assert w.wait(30) == 0, w.output()
    seen = occurrences(ticks)
    instants = sorted(seen)
    gaps = [(a, b) for a, b in itertools.pairwise(instants) if b - a != 1.0]
    duplicates = {k: n for k, n in seen.items() if n > 1}
    rows = read_records(str(ticks))
    by_occurrence: dict[float, set[str]] = {}
    for r in rows:
        by_occurrence.setdefault(r["occurrence"], set()).add(r["job"])
    with capsys.disabled():
        print(
            f"\nschedule leader kill: {len(instants)} occurrences, {sum(duplicates.values())} "
            f"runs of {len(duplicates)} duplicated occurrence(s), {len(gaps)} gap(s); "
            f"takeover seen in the log after {takeover:.2f} s"
        )
    assert not gaps, gaps
    assert len(duplicates) <= 1, duplicates
    assert all(len(ids) == 1 for ids in by_occurrence.values()), "a duplicate with another id"
    assert takeover <= 5.0
