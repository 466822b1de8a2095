"""Priorities against the real broker: one worker at concurrency 1, 200 low-priority
jobs and then 10 high-priority ones, all due at once. The high ones run before the
low ones still waiting, on classic and quorum queues, through the hold queue (the
worker orders what it holds) and through the ready queue (the broker orders it)."""

from __future__ import annotations

import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings

from deferred import defer, defer_many
from deferred.broker import admin_channel
from deferred.conf import get_settings
from deferred.core.jobs import utcnow
from deferred.core.topology import plan_topology
from tests.broker.test_releases import broker_version, quorum_topology
from tests.conftest import wait_for
from tests.testapp.tasks import read_records, record, sleepy
from tests.worker.test_holding import held_topology

LOW, HIGH = 200, 10


def ran(path: str) -> list[str]:
    return [r["label"] for r in read_records(path) if r["event"] == "ran"]


def defer_burst(records: str, delay: object) -> None:
    """200 jobs of the default priority, then 10 of priority 50, all due at ``delay``."""
    defer_many([(record, delay, (records, f"low-{n}")) for n in range(LOW)])
    urgent = record.using(priority=50)
    defer_many([(urgent, delay, (records, f"high-{n}")) for n in range(HIGH)])


def high_positions(records: str) -> list[int]:
    order = ran(records)
    assert len(order) == LOW + HIGH and len(set(order)) == LOW + HIGH, order
    return [n for n, label in enumerate(order) if label.startswith("high")]


def run_burst_through_hold(records: str, run_worker) -> list[int]:
    """Under a window of 4 s (held_topology), jobs due in 2 s go straight to the hold
    queue: all 210 are in the worker long before they are due, however slowly a loaded
    broker moves messages through its delay queues."""
    run_worker(settings=get_settings(), concurrency=1, queues=["default"])
    defer_burst(records, utcnow() + timedelta(seconds=2))
    assert wait_for(lambda: len(ran(records)) == LOW + HIGH, 60), len(ran(records))
    return high_positions(records)


def run_burst_through_ready(records: str, run_worker) -> list[int]:
    run_worker(settings=get_settings(), concurrency=1, queues=["default"])
    # The only thread is busy: the burst waits in the ready queue, in the broker.
    defer(sleepy, 0, records, "blocker", 1.5)
    assert wait_for(lambda: any(r["label"] == "blocker" for r in read_records(records)), 10)
    defer_burst(records, 0)
    assert wait_for(lambda: len(ran(records)) == LOW + HIGH, 60), len(ran(records))
    return high_positions(records)


# ---------------------------------------------------------------------- classic


def test_classic_held_jobs_start_highest_priority_first(broker_url, records, run_worker):
    with held_topology(broker_url):
        positions = run_burst_through_hold(records, run_worker)
    # The first job released may start before the rest are in the pool: at most one.
    assert positions[-1] <= HIGH, positions


@pytest.mark.usefixtures("clean")
def test_classic_ready_queue_delivers_highest_priority_first(records, run_worker):
    positions = run_burst_through_ready(records, run_worker)
    # x-max-priority: strictly first, bar the one the worker may have taken already.
    assert positions[-1] <= HIGH, positions


# ---------------------------------------------------------------------- one level, exact


def defer_close_priorities(records: str, delay: object) -> None:
    """100 jobs of priority 1, then 5 of priority 9: one AMQP level (1 to 20), all due
    at ``delay``."""
    defer_many([(record.using(priority=1), delay, (records, f"low-{n}")) for n in range(100)])
    urgent = record.using(priority=9)
    defer_many([(urgent, delay, (records, f"high-{n}")) for n in range(5)])


def close_positions(records: str) -> list[int]:
    assert wait_for(lambda: len(ran(records)) == 105, 60), len(ran(records))
    return [n for n, label in enumerate(ran(records)) if label.startswith("high")]


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_held_jobs_start_by_their_exact_priority_within_one_level(
    broker_url, records, run_worker, queue_type
):
    # Given a worker of concurrency 1 holding 105 jobs due together, of priorities 1 and 9
    with held_topology(broker_url, QUEUE_TYPE=queue_type):
        run_worker(settings=get_settings(), concurrency=1, queues=["default"])
        defer_close_priorities(records, utcnow() + timedelta(seconds=2))
        # Then the 9s start first (bar the one released before the rest were in the pool)
        positions = close_positions(records)
    assert positions[-1] <= 5, positions


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_held_jobs_due_behind_a_busy_thread_go_back_highest_priority_first(
    broker_url, records, run_worker, queue_type
):
    # Given a worker of concurrency 1 whose only thread is busy
    with held_topology(broker_url, QUEUE_TYPE=queue_type):
        run_worker(settings=get_settings(), concurrency=1, queues=["default"])
        defer(sleepy, 0, records, "blocker", 4.5)
        assert wait_for(lambda: any(r["label"] == "blocker" for r in read_records(records)), 10)
        # When 105 held jobs of priorities 1 and 9 come due together while it runs (they
        # go back to the ready queue for a free worker, all in one AMQP level); due in
        # 3 s, so that all are held before they come due, however slow the broker
        defer_close_priorities(records, utcnow() + timedelta(seconds=3))
        # Then the 9s still run first: they went back first
        positions = close_positions(records)
    assert positions == list(range(5)), positions


# ---------------------------------------------------------------------- quorum


def test_quorum_held_jobs_start_highest_priority_first(broker_url, records, run_worker):
    with held_topology(broker_url, QUEUE_TYPE="quorum"):
        positions = run_burst_through_hold(records, run_worker)
    # The worker orders what it holds, on every release.
    assert positions[-1] <= HIGH, positions


def test_quorum_ready_queue_priorities_are_what_the_broker_offers(broker_url, records, run_worker):
    version = broker_version(broker_url)
    with quorum_topology(broker_url, "prio-ready"):
        positions = run_burst_through_ready(records, run_worker)
    if version < (4, 0):
        # 3.x quorum queues have no priorities: first in, first out (the docs say so).
        assert positions == list(range(LOW, LOW + HIGH)), positions
    elif version < (4, 3):
        # 4.0-4.2: "high" (5 and above) before "normal", in RabbitMQ's own proportion:
        # every high job runs among the first few dozen, long before the low ones end.
        assert positions[-1] < 3 * HIGH, positions
    else:
        # 4.3: strict levels, with no queue argument: first, bar the one already taken.
        assert positions[-1] <= HIGH, positions


# ---------------------------------------------------------------------- manage.py check


def test_check_warns_of_a_priority_the_queues_cannot_honour(broker_url, settings):
    """deferred.W005 asks the broker its release: quorum queues order by priority
    on 4.3 (32 levels), in two levels on 4.0-4.2 (nothing below the default), not at
    all on 3.x; FIFO classic queues never."""
    from django.core.checks import run_checks

    from deferred import task
    from deferred.checks import _broker_version
    from deferred.producer.tasks import unregister

    @task(name="tests.prio.urgent", priority=50)
    def urgent() -> None: ...

    @task(name="tests.prio.lazy", priority=-50)
    def lazy() -> None: ...

    def warned() -> set[str]:
        return {m.obj.__name__ for m in run_checks() if m.id == "deferred.W005"}

    version = broker_version(broker_url)
    try:
        assert warned() == set()  # classic queues with PRIORITIES: every level
        with override_settings(DEFERRED={**settings.DEFERRED, "PRIORITIES": False}):
            assert warned() == {"urgent", "lazy"}
        _broker_version.cache_clear()
        with override_settings(DEFERRED={**settings.DEFERRED, "QUEUE_TYPE": "quorum"}):
            messages = [m for m in run_checks() if m.id == "deferred.W005"]
            release = ".".join(map(str, version))
            assert all(f"quorum queues on RabbitMQ {release}" in m.msg for m in messages)
            if version < (4, 0):
                assert warned() == {"urgent", "lazy"}
            elif version < (4, 3):
                assert warned() == {"lazy"}
            else:
                assert warned() == set()
    finally:
        unregister("tests.prio.urgent")
        unregister("tests.prio.lazy")


# ---------------------------------------------------------------------- a live change


@pytest.mark.parametrize("before", [False, True], ids=["turned-on", "turned-off"])
def test_switching_a_classic_prefix_s_priorities_runs_every_pending_job(
    before, broker_url, records, run_worker, settings
):
    """Jobs waiting in the old topology when PRIORITIES changes (on, or off) still run,
    once, through its ready queue the new workers drain; --remove-empty then removes
    the old topology and that queue."""
    prefix = f"{settings.DEFERRED['PREFIX']}-switch"
    fifo = {**settings.DEFERRED, "PREFIX": prefix, "PRIORITIES": before, "MAX_DELAY": 60}
    plans = []
    try:
        with override_settings(DEFERRED=fifo):
            call_command("declare_delay_topology", stdout=StringIO())
            old = plan_topology(get_settings())
            plans.append(old)
            for n in range(20):
                defer(record, 1 + n * 0.1, records, f"old-{n}")
        with override_settings(DEFERRED={**fifo, "PRIORITIES": not before}):
            call_command("declare_delay_topology", stdout=StringIO())
            new = plan_topology(get_settings())
            plans.append(new)
            assert new.topology_id != old.topology_id
            worker = run_worker(settings=get_settings(), concurrency=2)
            # The FIFO queues are forwarded, outside the worker's slots.
            assert old.ready_queues["default"].name in worker.consumer.forwarding
            assert old.hold_queues["default"].name in worker.consumer.forwarding
            defer(record.using(priority=10), 0.5, records, "new")
            assert wait_for(lambda: len(ran(records)) == 21, 20), ran(records)
            time.sleep(0.5)
            assert sorted(ran(records)) == sorted(["new", *(f"old-{n}" for n in range(20))])
            # The old topology is empty: --remove-empty removes it, then the FIFO queues,
            # while the worker runs; it goes on without reconnecting.
            generation = worker.consumer.generation
            out = StringIO()
            call_command("declare_delay_topology", "--remove-empty", stdout=out)
            assert new.legacy_label in out.getvalue()
            with admin_channel(broker_url) as admin:
                assert admin.message_count(old.ready_queues["default"].name) is None
                assert admin.message_count(old.hold_queues["other"].name) is None
                assert admin.message_count(new.ready_queues["default"].name) == 0
            defer(record, 0, records, "after")
            assert wait_for(lambda: "after" in ran(records), 10)
            assert worker.consumer.generation == generation and worker.consuming.is_set()
    finally:
        with admin_channel(broker_url) as admin:
            for plan in plans:
                admin.delete_everything(plan)
