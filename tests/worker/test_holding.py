"""The last mile: jobs due within HOLD_WINDOW skip the lowest levels and are held,
unacked, by the worker that takes them from the hold queue.

Pure tests of the routing (every delay lands in exactly one queue, after the
right waits) and of the timer; then, against the real broker: hold and release,
SIGTERM and SIGKILL during a hold, a cancel during a hold, prefetch with held
jobs, a held job handed back when every thread is busy, the status figures,
and jobs of a topology declared without the window.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings

from deferred import cancel, defer
from deferred.broker import admin_channel
from deferred.broker.consumer import hold_prefetch
from deferred.conf import _build, get_settings
from deferred.core.topology import Plan, build_plan, hold_levels_for, plan_topology, recorded_plan
from deferred.operate.status import build_snapshot
from deferred.operate.status_text import render_text
from deferred.worker import Worker
from deferred.worker.holding import HANDED_BACK, Held, Holder
from tests.conftest import _every_plan, depth, wait_for
from tests.testapp.tasks import read_records, sleepy, timed

# --------------------------------------------------------------------------- the plan, pure


def _plan(window_ms: int, radix: int = 16, resolution_ms: int = 1) -> Plan:
    return build_plan(
        prefix="p",
        radix=radix,
        resolution_ms=resolution_ms,
        max_delay_ms=400 * 86_400_000,
        queue_type="classic",
        queues=("default", "other"),
        hold_window_ms=window_ms,
    )


def _matches(pattern: str, key: str) -> bool:
    """AMQP topic matching for the patterns the plan uses (``*``: one word; no ``#``)."""
    words, keys = pattern.split("."), key.split(".")
    return len(words) == len(keys) and all(w in ("*", k) for w, k in zip(words, keys, strict=True))


def _route(plan: Plan, delay_ms: int, queue: str) -> tuple[str, int, int]:
    """Follow a job through the plan as RabbitMQ would: (where it lands, ms waited, hops)."""
    key = plan.routing_key(delay_ms, queue)
    ttl = {q.name: (q.ttl_ms, q.arguments["x-dead-letter-exchange"]) for q in plan.delay_queues}
    exchange, waited, hops = plan.ingest_exchange, 0, 0
    for _ in range(plan.levels + 1):
        found = {
            b.destination
            for b in plan.bindings
            if b.source == exchange and _matches(b.routing_key, key)
        }
        if plan.ledger_queue is not None and exchange == plan.ingest_exchange:
            # A job that enters a delay queue is copied into the ledger too (not a place
            # it waits in: tests/core/test_topology_logic.py checks that copy).
            found.discard(plan.ledger_queue.name)
        assert len(found) == 1, (delay_ms, exchange, key, found)
        (destination,) = found
        if destination not in ttl:
            return destination, waited, hops
        hops += 1
        waited += ttl[destination][0]
        exchange = ttl[destination][1]
    raise AssertionError(f"{key} never left the delay queues")


@pytest.mark.parametrize(
    ("window_ms", "radix", "resolution_ms", "held"),
    [
        (256, 16, 1, 2),
        (255, 16, 1, 1),
        (0, 16, 1, 0),
        (4096, 16, 1, 3),
        (256, 2, 1, 8),
        (999, 16, 1000, 0),
    ],
)
def test_the_window_leaves_out_the_levels_it_covers_whole(window_ms, radix, resolution_ms, held):
    assert hold_levels_for(window_ms, radix, resolution_ms, levels=12) == held
    # At least one level stays declared, however wide the window.
    assert hold_levels_for(10**12, 16, 1, levels=4) == 3


def test_every_delay_lands_in_one_queue_early_by_less_than_the_window_never_late():
    rng = random.Random(7)
    for window_ms in (0, 16, 256, 4096):
        plan = _plan(window_ms)
        assert plan.window_ms == (window_ms if window_ms else 0)
        assert all(q.level is not None and q.level >= plan.hold_levels for q in plan.delay_queues)
        delays = [0, 1, 15, 16, 255, 256, 257, 3000, 86_400_000] + [
            rng.randrange(0, 10**9) for _ in range(300)
        ]
        for delay in delays:
            for queue in ("default", "other"):
                landed, waited, hops = _route(plan, delay, queue)
                early = delay - waited
                assert 0 <= early < max(plan.window_ms, 1), (window_ms, delay, waited)
                expected = plan.hold_queues[queue] if early else plan.ready_queues[queue]
                assert landed == expected.name, (window_ms, delay, landed)
                assert plan.hops(delay) == hops


def test_the_default_window_halves_the_hops_of_short_delays():
    held, full = _plan(256), _plan(0)
    delays = range(0, 3000, 7)
    assert sum(held.hops(d) for d in delays) * 2 < sum(full.hops(d) for d in delays)
    levels = full.levels
    assert held.levels == levels
    assert held.topology_id == f"r16.1ms.L{levels}.H2.classic"
    assert full.topology_id == f"r16.1ms.L{levels}.classic"
    # Without a window, keys and queues are what they always were.
    assert full.key_words == levels + 1
    # 257 ms: digits 1, 0, 1 in base 16.
    words = ["0"] * (levels - 3)
    assert full.routing_key(257, "default") == ".".join([*words, "1", "0", "1", "default"])
    # With two levels held: the third digit, then the hold word for "0, 1".
    assert held.routing_key(257, "default") == ".".join([*words, "1", "1", "default"])
    assert held.routing_key(256, "default").endswith(".1.0.default")
    assert held.key_words == levels - 2 + 2


def test_a_topology_recorded_before_the_window_is_rebuilt_with_every_level():
    old = _plan(0)
    record = json.loads(old.record())
    del record["hold_levels"]  # what an older release recorded
    rebuilt = recorded_plan(record, prefix="p", queues=("default", "other"))
    assert rebuilt.hold_levels == 0 and rebuilt.topology_id == old.topology_id
    held = _plan(256)
    again = recorded_plan(json.loads(held.record()), prefix="p", queues=("default", "other"))
    assert again.topology_id == held.topology_id and again.hold_levels == 2
    # Hold queues exist whatever the window: a changed window strands nothing.
    assert old.hold_queues.keys() == held.hold_queues.keys() == {"default", "other"}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("HOLD_WINDOW", -1, "HOLD_WINDOW"),
        ("HOLD_WINDOW", 3601, "1 hour"),
        ("HOLD_WINDOW", 0.0005, "whole number"),
        ("HOLD_WINDOW", "256ms", "timedelta or a number"),
        ("HOLD_PREFETCH", 0, "HOLD_PREFETCH"),
        ("HOLD_PREFETCH", 70_000, "65535"),
        ("HOLD_PREFETCH", True, "HOLD_PREFETCH"),
    ],
)
def test_bad_hold_settings_are_configuration_errors(key, value, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        _build({key: value})


def test_hold_settings_defaults_and_units():
    assert _build({}).hold_window_ms == 256
    assert _build({}).hold_prefetch == 1000
    assert _build({"HOLD_WINDOW": timedelta(seconds=4)}).hold_window_ms == 4000
    assert _build({"HOLD_WINDOW": 0.3}).hold_window_ms == 300
    assert _build({"HOLD_WINDOW": 0}).hold_window_ms == 0


def test_the_hold_allowance_is_shared_between_the_hold_queues():
    assert hold_prefetch(1000, ["a"]) == {"a": 1000}
    assert hold_prefetch(10, ["a", "b", "c"]) == {"a": 4, "b": 3, "c": 3}
    assert hold_prefetch(1, ["a", "b"]) == {"a": 1, "b": 1}
    assert hold_prefetch(5, []) == {}


# --------------------------------------------------------------------------- the timer, pure


def test_the_holder_releases_in_due_order_never_before_the_time():
    released: list[tuple[str, float]] = []
    holder = Holder(
        lambda es: released.extend((e.job, time.monotonic()) for e in es), lambda e: None
    )
    holder.start_thread()
    try:
        start = time.monotonic()
        for name, seconds in [("c", 0.15), ("a", 0.05), ("b", 0.1), ("now", 0.0)]:
            holder.hold(object(), name, seconds)
        assert wait_for(lambda: len(released) == 4, 2)
        assert [name for name, _ in released] == ["now", "a", "b", "c"]
        for (name, at), seconds in zip(released, [0.0, 0.05, 0.1, 0.15], strict=True):
            assert at - start >= seconds, name
            assert at - start < seconds + 0.5, name
    finally:
        holder.stop()


def test_jobs_due_together_are_released_in_one_call_in_due_order():
    """One call for all those due: the pool gets them at once and orders them by
    priority, instead of a free thread starting the first before the rest are in."""
    calls: list[list[str]] = []
    holder = Holder(lambda es: calls.append([e.job for e in es]), lambda e: None)
    for name, seconds in [("b", 0.02), ("a", 0.01), ("c", 0.03)]:
        holder.hold(object(), name, seconds)
    time.sleep(0.1)  # all three due before the timer looks
    holder.start_thread()
    try:
        assert wait_for(lambda: calls, 2)
        assert calls == [["a", "b", "c"]]
    finally:
        holder.stop()


def test_a_batch_the_pool_refuses_is_handed_back_whole():
    handed: list[object] = []

    def refuse(entries: list[Held]) -> None:
        raise RuntimeError("the pool is shut down")

    holder = Holder(refuse, lambda e: handed.append(e.job))
    for name in ("x", "y"):
        holder.hold(object(), name, 0)
    holder.start_thread()
    try:
        assert wait_for(lambda: len(handed) == 2, 2)
        assert sorted(handed) == ["x", "y"]  # type: ignore[type-var]
        assert holder.count() == 0
    finally:
        holder.stop()


def test_a_released_job_no_thread_starts_is_handed_back_once():
    handed: list[object] = []
    holder = Holder(lambda es: None, lambda e: handed.append(e.job), hand_back_after_s=0.05)
    holder.start_thread()
    try:
        entry = holder.hold(object(), "late", 0.01)
        assert entry is not None
        assert wait_for(lambda: handed == ["late"], 2)
        assert entry.state == HANDED_BACK
        # The pool thread that comes too late must not run it.
        assert holder.start(entry) is False
    finally:
        holder.stop()
    # A job a thread starts in time is not handed back. (A holder of its own, whose
    # grace is long enough for the test to see the job released on a busy host.)
    patient = Holder(lambda es: None, lambda e: handed.append(e.job), hand_back_after_s=5)
    patient.start_thread()
    try:
        started = patient.hold(object(), "started", 0.0)
        assert started is not None
        assert wait_for(lambda: started.state == "released", 2)
        assert patient.start(started) is True
        time.sleep(0.15)
        assert handed == ["late"]
        assert patient.count() == 0
    finally:
        patient.stop()


def test_a_pool_that_keeps_starting_jobs_keeps_its_released_ones():
    handed: list[object] = []
    stalled = threading.Event()
    holder = Holder(
        lambda es: None,
        lambda e: handed.append(e.job),
        stalled=lambda seconds: stalled.is_set(),
        hand_back_after_s=0.05,
    )
    holder.start_thread()
    try:
        entry = holder.hold(object(), "waits its turn", 0)
        assert entry is not None
        time.sleep(0.3)  # six grace periods, the pool busy but moving
        assert handed == [] and entry.state == "released"
        stalled.set()  # now every thread is stuck on a long job
        assert wait_for(lambda: handed == ["waits its turn"], 1)
    finally:
        holder.stop()


def test_stopping_returns_every_job_neither_started_nor_handed_back():
    holder = Holder(lambda es: None, lambda e: None, hand_back_after_s=60)
    holder.start_thread()
    waiting = holder.hold(object(), "waiting", 30)
    due = holder.hold(object(), "due", 0)
    assert waiting is not None and due is not None
    assert wait_for(lambda: due.state == "released", 1)
    assert holder.count() == 2
    left = holder.stop()
    assert sorted(e.job for e in left) == ["due", "waiting"]
    assert holder.hold(object(), "after", 1) is None
    assert holder.start(due) is False


def test_the_status_counts_held_jobs_apart():
    plan = _plan(256)

    class Stats:
        def __init__(self, messages: int, consumers: int = 1) -> None:
            self.messages, self.consumers = messages, consumers

    stats = {q.name: Stats(0) for q in plan.all_queues}
    stats[plan.hold_queues["default"].name] = Stats(4)
    unacked = {plan.ready_queues["default"].name: 2, plan.hold_queues["default"].name: 7}
    snapshot = build_snapshot(
        current=plan,
        others=[],
        stats=stats,  # type: ignore[arg-type]
        failed_by_queue={},
        unacked=unacked,
        taken_at=datetime.now(UTC),
    )
    assert snapshot.held == 7
    assert snapshot.queues[0].held == 7 and snapshot.queues[0].hold_waiting == 4
    assert snapshot.pending == 4  # waiting in the hold queue: not due, not held
    assert "7 held" in render_text(snapshot)
    unknown = build_snapshot(
        current=plan,
        others=[],
        stats=stats,  # type: ignore[arg-type]
        failed_by_queue={},
        unacked=None,
        taken_at=snapshot.taken_at,
    )
    assert unknown.held is None and "n/a held" in render_text(unknown)


# --------------------------------------------------------------------------- the real broker

#: Wide enough to hold a job for seconds: 16**3 ms, three levels left to the workers.
WIDE_WINDOW_S = 4.096


@contextmanager
def held_topology(broker_url: str, **extra: object) -> Iterator[tuple[Plan, dict[str, str]]]:
    """A topology of its own with a wide window; the env its worker subprocesses need."""
    prefix = f"{settings.DEFERRED['PREFIX']}-h{uuid.uuid4().hex[:6]}"
    values = {**settings.DEFERRED, "PREFIX": prefix, "HOLD_WINDOW": WIDE_WINDOW_S, **extra}
    env = {"DEFERRED_TEST_PREFIX": prefix, "DEFERRED_TEST_HOLD_WINDOW": str(WIDE_WINDOW_S)}
    if "HOLD_PREFETCH" in extra:
        env["DEFERRED_TEST_HOLD_PREFETCH"] = str(extra["HOLD_PREFETCH"])
    with override_settings(DEFERRED=values):
        call_command("declare_delay_topology", verbosity=0)
        plan = plan_topology(get_settings())
        assert plan.hold_levels == 3
        try:
            yield plan, env
        finally:
            with admin_channel(broker_url) as admin:
                for each in _every_plan(admin, plan):
                    admin.delete_everything(each)


def _runs(path: str) -> list[dict]:
    return [r for r in read_records(path) if r["event"] == "ran"] if os.path.exists(path) else []


@contextmanager
def running(**kwargs: object) -> Iterator[Worker]:
    """An in-process worker of the settings in force, stopped (and joined) at the end:
    before the topology it consumes is deleted."""
    worker = Worker(settings=get_settings(), install_signal_handlers=False, **kwargs)  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, name="test-holding-worker", daemon=True)
    thread.start()
    try:
        assert worker.consuming.wait(10), "the worker did not start consuming"
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop"


def test_a_job_due_within_the_window_is_held_and_runs_on_time_never_early(
    clean, run_worker, records
):
    plan = clean
    assert plan.hold_levels == 2  # the default window: 256 ms
    worker = run_worker(concurrency=2)
    due_in = 0.2
    job_id = defer(timed, due_in, records, "held")
    # It skipped every delay queue and sits in the worker, unacked, until due.
    assert wait_for(lambda: worker.holder.count() == 1 or _runs(records), 2)
    assert wait_for(lambda: _runs(records), 5)
    (run,) = _runs(records)
    assert run["job"] == job_id
    assert run["at"] >= run["due"], "ran early"
    assert run["at"] - run["due"] < 1.0, "grossly late"
    # The task wrote its record before the worker counted its outcome.
    assert wait_for(lambda: worker.outcomes["succeeded"] == 1, 5)
    assert worker.holder.count() == 0


def test_sigterm_during_a_hold_hands_the_job_back_at_once_uncounted(
    broker_url, worker_process, raw_channel, records
):
    with held_topology(broker_url) as (plan, env):
        hold_queue = plan.hold_queues["default"].name
        first = worker_process("--concurrency", "1", env=env)
        job_id = defer(timed, 3.0, records, "held")
        # Straight to the hold queue (3 s < the 4.096 s window), taken by the worker.
        assert wait_for(lambda: depth(raw_channel, hold_queue) == 0, 3)
        time.sleep(0.3)
        stopped_at = time.time()
        first.signal(signal.SIGTERM)
        first.wait(10)
        assert time.time() - stopped_at < 2.5, "the held job kept the worker until due"
        assert "Handed back 1 held job for" in first.output(), first.output()
        assert depth(raw_channel, hold_queue) == 1, first.output()
        assert not _runs(records)
        second = worker_process("--concurrency", "1", env=env)
        assert wait_for(lambda: _runs(records), 8), second.output()
        time.sleep(0.5)
        (run,) = _runs(records)
        assert run["job"] == job_id and run["at"] >= run["due"]
        # A fresh copy: no redelivery counted against DELIVERY_LIMIT.
        assert "outcome=requeued" not in second.output()
        assert "outcome=succeeded" in second.output()


@pytest.mark.quiet
def test_sigkill_during_a_hold_the_broker_gives_the_job_to_another_worker(
    broker_url, worker_process, raw_channel, records
):
    with held_topology(broker_url) as (plan, env):
        hold_queue = plan.hold_queues["default"].name
        first = worker_process("--concurrency", "1", env=env)
        job_id = defer(timed, 2.5, records, "held")
        assert wait_for(lambda: depth(raw_channel, hold_queue) == 0, 3)
        time.sleep(0.3)
        first.kill()
        assert wait_for(lambda: depth(raw_channel, hold_queue) == 1, 5)
        second = worker_process("--concurrency", "1", env=env)
        assert wait_for(lambda: _runs(records), 8), second.output()
        time.sleep(0.5)
        (run,) = _runs(records)
        assert run["job"] == job_id
        assert run["at"] >= run["due"], "ran early"
        assert run["at"] - run["due"] < 3.0, "grossly late"


def test_a_cancel_during_a_hold_wins(broker_url, records):
    with held_topology(broker_url) as (_plan, _env), running(concurrency=1) as worker:
        job_id = defer(timed, 1.5, records, "cancelled")
        assert wait_for(lambda: worker.holder.count() == 1, 3)
        cancel(job_id)
        assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 6)
        assert worker.holder.count() == 0
        assert not _runs(records)


def test_held_jobs_have_their_own_prefetch_and_leave_the_rest_to_other_workers(
    broker_url, raw_channel, records
):
    with (
        held_topology(broker_url, HOLD_PREFETCH=3) as (plan, _env),
        running(concurrency=1, queues=["default"]) as first,
    ):
        hold_queue = plan.hold_queues["default"].name
        ids = [defer(timed, 2.5, records, f"later-{n}") for n in range(8)]
        # Three held, five left in the queue for anyone.
        assert wait_for(lambda: first.holder.count() == 3, 3)
        time.sleep(0.3)
        assert first.holder.count() == 3 and depth(raw_channel, hold_queue) == 5
        # Held jobs do not take the running slot: a due job starts at once.
        now_id = defer(timed, 0, records, "now")
        assert wait_for(lambda: any(r["job"] == now_id for r in _runs(records)), 2)
        with running(concurrency=1, queues=["default"]) as second:
            assert wait_for(lambda: second.holder.count() == 3, 3)
            assert depth(raw_channel, hold_queue) == 2
            assert wait_for(lambda: len(_runs(records)) == 9, 10)
            time.sleep(0.3)
        runs = _runs(records)
        assert sorted(r["job"] for r in runs) == sorted([*ids, now_id])
        assert all(r["at"] >= r["due"] for r in runs), "ran early"


def test_a_held_job_whose_worker_is_busy_goes_to_a_free_worker(
    broker_url, worker_process, raw_channel, records
):
    with held_topology(broker_url) as (plan, env):
        busy = worker_process("--concurrency", "1", env=env)
        defer(sleepy, 0, records, "slow", 4.0)
        assert wait_for(lambda: any(r["event"] == "start" for r in read_records(records)), 5)
        job_id = defer(timed, 1.0, records, "held")
        hold_queue = plan.hold_queues["default"].name
        assert wait_for(lambda: depth(raw_channel, hold_queue) == 0, 3)  # held by the busy one
        free = worker_process("--concurrency", "1", env=env)
        assert wait_for(lambda: _runs(records), 6), busy.output()
        (run,) = [r for r in _runs(records) if r.get("job") == job_id]
        assert run["at"] >= run["due"]
        # Run by the free worker while the busy one's thread still slept.
        assert run["at"] - run["due"] < 2.0, busy.output() + free.output()
        assert run["pid"] == free.proc.pid
        assert "every thread is busy" in busy.output()


def test_the_status_shows_held_jobs(broker_url):
    from deferred.operate.status import collect

    with held_topology(broker_url) as (_plan, _env), running(concurrency=1) as worker:
        defer(timed, 3.0, "/dev/null", "held")
        assert wait_for(lambda: worker.holder.count() == 1, 3)
        snapshot = collect(get_settings(), read_failed=False).snapshot
        (default,) = [q for q in snapshot.queues if q.name == "default"]
        assert default.hold_waiting == 0
        if snapshot.unacked_source == "management":
            # The management API's figures lag a few seconds behind.
            assert wait_for(
                lambda: collect(get_settings(), read_failed=False).snapshot.held == 1, 10
            )
        else:
            assert snapshot.held is None
            assert "n/a held" in render_text(snapshot)


def test_jobs_of_a_topology_without_the_window_still_run_once(broker_url, records):
    with held_topology(broker_url) as (plan, _env):
        without = {**settings.DEFERRED, "PREFIX": plan.prefix, "HOLD_WINDOW": 0}
        with override_settings(DEFERRED=without):
            # What an older release declares and publishes: every level.
            call_command("declare_delay_topology", verbosity=0)
            old_plan = plan_topology(get_settings())
            assert old_plan.hold_levels == 0
            ids = [defer(timed, d, records, f"old-{d}") for d in (0.0, 0.05, 0.3, 1.2)]
        with running(concurrency=2) as worker:
            assert wait_for(lambda: len(_runs(records)) == 4, 8)
            time.sleep(0.3)
        runs = _runs(records)
        assert sorted(r["job"] for r in runs) == sorted(ids)
        assert all(r["at"] >= r["due"] for r in runs)
        assert worker.outcomes["succeeded"] == 4


def test_a_stopping_worker_hands_back_every_held_job(broker_url, raw_channel, records):
    with held_topology(broker_url) as (plan, _env):
        worker = Worker(concurrency=1, settings=get_settings(), install_signal_handlers=False)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        assert worker.consuming.wait(10)
        for n in range(5):
            defer(timed, 3.0, records, f"held-{n}")
        assert wait_for(lambda: worker.holder.count() == 5, 3)
        worker.stop()
        thread.join(10)
        assert not thread.is_alive()
        assert depth(raw_channel, plan.hold_queues["default"].name) == 5
        assert not _runs(records)
