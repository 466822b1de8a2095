"""Recurring jobs against the real broker, with several worker processes.

Each test runs workers under a PREFIX of its own (``own_topology``), scheduling
``tests.tick`` every second (DEFERRED_TEST_EVERY), and reads what ran from the
file the task appends to.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
from django.core.management import CommandError

from tests.conftest import topology_of_its_own, wait_for
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
    # Then exactly one of them scheduled (until they stop: then the lease moves on)
    assert sum(LEADS in w.output() for w in workers) == 1
    stop_all(workers)
    # and every occurrence ran once, with no gaps
    rows = read_records(str(ticks))
    seen = occurrences(ticks)
    assert len(seen) >= 17, sorted(seen)
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
    instants = sorted(seen)
    assert all(b - a == 1.0 for a, b in itertools.pairwise(instants)), instants
    # never early, not grossly late
    lateness = [r["at"] - r["occurrence"] for r in rows]
    assert min(lateness) >= 0 and max(lateness) < 3.0, (min(lateness), max(lateness))
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


def stop_all(workers) -> None:
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(30) == 0, w.output()


def test_restarting_every_worker_at_once_neither_doubles_nor_drops_a_chain(
    own_topology, worker_process, tmp_path
):
    ticks = tmp_path / "ticks.jsonl"
    env = worker_env(own_topology, ticks)
    first = [worker_process(env=env) for _ in range(2)]
    time.sleep(5)
    # When every worker stops together, and new ones start at once
    stop_all(first)
    second = [worker_process(env=env) for _ in range(2)]
    time.sleep(8)
    stop_all(second)
    # Then the chain goes on: no occurrence twice, none missing
    seen = occurrences(ticks)
    instants = sorted(seen)
    assert max(seen.values()) == 1, {k: n for k, n in seen.items() if n > 1}
    assert all(b - a == 1.0 for a, b in itertools.pairwise(instants)), instants
    assert len(instants) >= 11


def test_a_changed_schedule_goes_on_from_what_was_planned(own_topology, worker_process, tmp_path):
    ticks = tmp_path / "ticks.jsonl"
    before = worker_process(env=worker_env(own_topology, ticks, every=1.0))
    time.sleep(4)
    stop_all([before])
    changed_at = time.time()
    after = worker_process(env=worker_env(own_topology, ticks, every=2.0))
    time.sleep(12)
    stop_all([after])
    seen = occurrences(ticks)
    assert max(seen.values()) == 1, {k: n for k, n in seen.items() if n > 1}
    instants = sorted(seen)
    # What the old rule planned (up to 5 s ahead) ran, then the new rule from there on.
    late = [t for t in instants if t > changed_at + 6]
    assert len(late) >= 3 and all(t % 2 == 0 for t in late), late
    assert all(b - a in (1.0, 2.0) for a, b in itertools.pairwise(instants)), instants


def test_occurrences_missed_while_no_worker_ran_follow_the_misfire_policy(
    broker_url, worker_process, tmp_path
):
    # The three policies side by side over one outage, each with a topology and
    # workers of its own: how many of the missed occurrences run (None: all).
    expected = {"coalesce": 1, "skip": 0, "all": None}
    with ExitStack() as stack:
        envs = {
            misfire: worker_env(
                stack.enter_context(topology_of_its_own(broker_url)),
                tmp_path / f"{misfire}.jsonl",
                DEFERRED_TEST_MISFIRE=misfire,
            )
            for misfire in expected
        }
        first = [worker_process(env=env) for env in envs.values()]
        assert wait_for(lambda: all(LEADS in w.output() for w in first), 15)
        time.sleep(2)
        stop_all(first)
        stopped = time.time()
        # An outage longer than the period and than what was planned ahead (5 s)
        time.sleep(10)
        restarted = time.time()
        workers = [worker_process(env=env) for env in envs.values()]
        assert wait_for(lambda: all(LEADS in w.output() for w in workers), 15)
        time.sleep(3)
        stop_all(workers)
    for misfire, runs in expected.items():
        ticks = tmp_path / f"{misfire}.jsonl"
        rows = read_records(str(ticks))
        seen = occurrences(ticks)
        assert max(seen.values()) == 1, misfire
        instants = sorted(seen)
        holes = sum(int(b - a) - 1 for a, b in itertools.pairwise(instants))
        # Of the occurrences missed meanwhile, the policy's number ran, at once: a
        # missed occurrence is due when it is found missed, any other at its instant
        # (what was planned ahead before the outage ran late, but was not missed).
        missed_runs = [r for r in rows if r["due"] > r["occurrence"]]
        assert all(r["occurrence"] > stopped for r in missed_runs), (misfire, missed_runs)
        if runs is None:  # "all": every one, so the chain has no hole
            assert holes == 0 and len(missed_runs) >= 2, (misfire, instants, missed_runs)
        else:  # the outage left a hole in the chain
            assert holes >= 2, (misfire, instants)
            assert len(missed_runs) == runs, (misfire, instants, stopped, restarted, missed_runs)


def test_deferred_schedules_lists_pauses_resumes_and_runs(own_topology, worker_process, tmp_path):
    from io import StringIO

    from django.conf import settings
    from django.core.management import call_command
    from django.test import override_settings

    from deferred.core.schedule import every

    ticks = tmp_path / "ticks.jsonl"
    env = worker_env(own_topology, ticks)
    worker = worker_process(env=env)
    here = {**settings.DEFERRED, "PREFIX": own_topology.prefix}
    here["SCHEDULES"] = {"tests.tick": every(seconds=1)}

    def listing() -> dict:
        out = StringIO()
        call_command("deferred_schedules", "--json", stdout=out)
        return json.loads(out.getvalue())

    with override_settings(DEFERRED=here):
        assert wait_for(lambda: listing()["leader"] is not None, 10)
        (row,) = listing()["schedules"]
        assert row["name"] == "tests.tick" and row["rule"] == "every 1 s"
        assert row["next_run"] and not row["paused"] and row["leader"]
        out = StringIO()
        call_command("deferred_status", "--json", stdout=out)
        (shown,) = json.loads(out.getvalue())["schedules"]["schedules"]
        assert shown["name"] == "tests.tick" and shown["leader"] == row["leader"]
        # Pause: what was planned (up to 5 s ahead) runs, then nothing
        call_command("deferred_schedules", "pause", "tests.tick", stdout=StringIO())
        assert wait_for(lambda: listing()["schedules"][0]["paused"], 5)
        time.sleep(6.5)
        count = len(read_records(str(ticks)))
        # The pause lives in the broker: a restarted worker keeps it
        stop_all([worker])
        worker = worker_process(env=env)
        time.sleep(3)
        assert len(read_records(str(ticks))) == count
        assert listing()["schedules"][0]["paused"]
        # Run once, now, while paused
        call_command("deferred_schedules", "run", "tests.tick", stdout=StringIO())
        assert wait_for(lambda: len(read_records(str(ticks))) == count + 1, 5)
        call_command("deferred_schedules", "resume", "tests.tick", stdout=StringIO())
        assert wait_for(lambda: len(read_records(str(ticks))) >= count + 3, 6)
        with pytest.raises(CommandError, match="No schedule named"):
            call_command("deferred_schedules", "pause", "tests.nothing", stdout=StringIO())
    stop_all([worker])


def test_a_worker_started_with_no_schedules_never_schedules(own_topology, worker_process, tmp_path):
    ticks = tmp_path / "ticks.jsonl"
    worker = worker_process("--no-schedules", env=worker_env(own_topology, ticks))
    time.sleep(3)
    assert LEADS not in worker.output()
    assert not ticks.exists()
    stop_all([worker])


def test_a_removed_schedule_stops(own_topology, worker_process, tmp_path):
    ticks = tmp_path / "ticks.jsonl"
    worker = worker_process(env=worker_env(own_topology, ticks))
    time.sleep(3)
    stop_all([worker])
    removed_at = time.time()
    # The next deploy no longer has the schedule (the task itself still exists)
    env = worker_env(own_topology, ticks)
    del env["DEFERRED_TEST_EVERY"]
    worker = worker_process(env=env)
    time.sleep(8)
    stop_all([worker])
    # What was planned ahead (5 s) ran; nothing after it
    assert max(occurrences(ticks)) <= removed_at + 5.5


def test_an_occurrence_whose_task_is_gone_is_dropped_not_failed(
    clean, run_worker, raw_channel, caplog
):
    from deferred.core.jobs import Job, utcnow
    from deferred.core.schedule import occurrence_id
    from deferred.producer.publishing import publish

    # Planned before a deploy removed its task (and so its schedule)
    at = utcnow()
    gone = Job(
        id=occurrence_id("tests.removed_since", at),
        task="tests.removed_since",
        args=(),
        kwargs={},
        due=at,
        queue="default",
        occurrence=at,
    )
    publish(gone, 0)
    with caplog.at_level("WARNING", logger="deferred.worker"):
        run_worker()
        dropped = "outcome=dropped duration_ms=0.0 reason=unknown_task"
        assert wait_for(lambda: dropped in caplog.text, 5), caplog.text
    ready = clean.ready_queues["default"].name
    assert raw_channel.queue_declare(ready, passive=True).method.message_count == 0
    failed = raw_channel.queue_declare(clean.failed_queue.name, passive=True).method.message_count
    assert failed == 0


def test_a_forged_pause_command_is_ignored(own_topology, worker_process, tmp_path, raw_channel):
    import pika

    from deferred.core.jobs import utcnow
    from deferred.records.schedules import Command

    ticks = tmp_path / "ticks.jsonl"
    worker = worker_process(env=worker_env(own_topology, ticks))
    assert wait_for(lambda: len(read_records(str(ticks))) >= 2, 15)
    # Given a pause written into the record queue by someone without our key,
    forged = Command("pause", "tests.tick", "f" * 32, utcnow()).encode()
    raw_channel.basic_publish(
        "", own_topology.schedules_queue.name, forged, pika.BasicProperties(delivery_mode=2)
    )
    # the schedule goes on, and the worker says why.
    count = len(read_records(str(ticks)))
    assert wait_for(lambda: len(read_records(str(ticks))) >= count + 6, 15)
    stop_all([worker])
    assert "Ignoring a schedule record or command" in worker.output()
