"""Time limits, the worker's pool and recycling as pure logic: no broker."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from deferred import TimeLimitExceeded, task
from deferred.conf import get_settings
from deferred.core.limits import Watchdog, parse_time_limit
from deferred.producer.tasks import unregister
from deferred.worker.pool import Pool
from deferred.worker.recycling import Recycling, resident_bytes


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), (2, 2.0), (0.25, 0.25), (timedelta(minutes=1), 60.0)],
)
def test_time_limits_parse_from_seconds_or_timedelta(value, seconds):
    assert parse_time_limit(value) == seconds


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), timedelta(0)])
def test_a_time_limit_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="time_limit must be a positive, finite duration"):
        parse_time_limit(value)


@pytest.mark.parametrize("value", ["10", True, [1]])
def test_a_time_limit_must_be_a_duration(value):
    with pytest.raises(TypeError, match="time_limit must be a number of seconds"):
        parse_time_limit(value)


def test_settings_defaults_and_errors(settings):
    assert get_settings().time_limit_s == 600.0 and get_settings().time_limit_grace_s == 30.0
    base = dict(settings.DEFERRED)
    with override_settings(DEFERRED={**base, "TIME_LIMIT": None, "TIME_LIMIT_GRACE": 2}):
        assert get_settings().time_limit_s is None and get_settings().time_limit_grace_s == 2.0
    for key, value, message in [
        ("TIME_LIMIT", 0, "DEFERRED['TIME_LIMIT'] must be a positive"),
        ("TIME_LIMIT", "5m", "DEFERRED['TIME_LIMIT'] must be a number of seconds"),
        ("TIME_LIMIT_GRACE", None, "DEFERRED['TIME_LIMIT_GRACE'] must be a positive duration"),
    ]:
        with override_settings(DEFERRED={**base, key: value}):
            with pytest.raises(ImproperlyConfigured, match=message.replace("[", r"\[")):
                get_settings()


def test_a_task_limit_overrides_the_setting_and_none_means_none():
    @task(name="tests.logic.limited", time_limit=timedelta(seconds=5))
    def limited() -> None: ...

    @task(name="tests.logic.free", time_limit=None)
    def free() -> None: ...

    @task(name="tests.logic.default")
    def default() -> None: ...

    try:
        settings = get_settings()
        assert limited.time_limit(settings) == 5.0
        assert free.time_limit(settings) is None
        assert default.time_limit(settings) == settings.time_limit_s
        with pytest.raises(ValueError):
            task(name="tests.logic.bad", time_limit=-1)(lambda: None)
    finally:
        for name in ("tests.logic.limited", "tests.logic.free", "tests.logic.default"):
            unregister(name)


def test_the_watchdog_raises_at_the_soft_limit_and_takes_over_at_the_hard_one():
    taken: list[object] = []
    dog = Watchdog(taken.append)
    caught: list[float] = []
    ended = threading.Event()

    def polite() -> None:
        # Before the watch starts its clock: a busy host may pause between the two.
        began = time.monotonic()
        watch = dog.watch(0.1, 0.2, "polite")
        try:
            while True:
                time.sleep(0.005)
        except TimeLimitExceeded:
            caught.append(time.monotonic() - began)
        assert watch is not None and watch.finish() and watch.fired

    def stubborn() -> None:
        watch = dog.watch(0.1, 0.2, "stubborn")
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            try:
                time.sleep(0.005)
            except TimeLimitExceeded:
                pass
        assert watch is not None and not watch.finish()  # no longer its own
        ended.set()

    threads = [threading.Thread(target=polite), threading.Thread(target=stubborn)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    dog.stop()
    assert ended.is_set()
    assert len(caught) == 1 and 0.1 <= caught[0] < 0.5
    assert [w.context for w in taken] == ["stubborn"]  # type: ignore[attr-defined]


def test_an_attempt_that_finishes_in_time_is_never_interrupted():
    dog = Watchdog(lambda watch: pytest.fail("taken over"))
    watch = dog.watch(0.05, 0.05)
    assert watch is not None and watch.finish() and not watch.fired
    time.sleep(0.2)  # past both limits: nothing may be raised here now
    dog.stop()
    assert dog.watch(None, 1.0) is None  # no limit, nothing watched


def test_the_pool_starts_waiting_calls_highest_priority_first():
    pool = Pool(1)
    gate, busy = threading.Event(), threading.Event()
    order: list[str] = []
    pool.submit(lambda: (busy.set(), gate.wait()))  # holds the only thread
    assert busy.wait(2)
    for n in range(3):
        pool.submit(order.append, f"low{n}", priority=0)
    pool.submit(order.append, "high", priority=5)
    pool.submit(order.append, "mid", priority=2)
    assert pool.waiting() == 5
    gate.set()
    pool.shutdown(wait=True)
    assert order == ["high", "mid", "low0", "low1", "low2"]
    with pytest.raises(RuntimeError):
        pool.submit(order.append, "late")


def test_calls_submitted_together_start_by_priority_on_an_idle_pool():
    """An idle thread takes nothing before the whole batch is in (held jobs due together)."""
    pool = Pool(1)
    order: list[str] = []
    calls = [(order.append, (f"low{n}",), 0) for n in range(50)]
    pool.submit_many([*calls, (order.append, ("high",), 7)])
    pool.shutdown(wait=True)
    assert order[0] == "high" and order[1:] == [f"low{n}" for n in range(50)]
    with pytest.raises(RuntimeError):
        pool.submit_many([(order.append, ("late",), 0)])
    assert len(order) == 51


def test_an_abandoned_thread_is_replaced_and_not_joined():
    pool = Pool(1)
    stuck = threading.Event()
    idents: list[int] = []

    def hang() -> None:
        idents.append(threading.get_ident())
        stuck.wait(10)

    pool.submit(hang)
    assert_soon(lambda: idents)
    ran = threading.Event()
    pool.submit(ran.set)
    pool.abandon(idents[0])
    assert ran.wait(2)  # the replacement ran the waiting call
    began = time.monotonic()
    pool.shutdown(wait=True)
    assert time.monotonic() - began < 1  # the stuck thread is not waited for
    stuck.set()


def test_a_thread_given_up_during_shutdown_is_not_waited_for_and_takes_no_more():
    pool = Pool(2)
    stuck, started = threading.Event(), threading.Event()
    idents: list[int] = []

    def hang() -> None:
        idents.append(threading.get_ident())
        started.set()
        stuck.wait(10)

    pool.submit(hang)
    assert started.wait(2)
    done = threading.Event()
    stopper = threading.Thread(target=lambda: (pool.shutdown(wait=True), done.set()))
    stopper.start()  # waits for the hanging thread...
    assert not done.wait(0.3)
    pool.abandon(idents[0])  # ...until it is given up
    assert done.wait(2)
    stuck.set()  # its job ends: it leaves, and takes nothing
    time.sleep(0.1)
    assert pool.waiting() == 0


def test_recycling_by_count_and_by_memory():
    assert Recycling(max_jobs=3).reason(2) is None
    assert "handled 3 jobs" in (Recycling(max_jobs=3).reason(3) or "")
    now_mib = resident_bytes() / 1024 / 1024
    assert now_mib > 10
    assert Recycling(max_memory_mib=int(now_mib * 4)).reason(1) is None
    assert "MiB of memory" in (Recycling(max_memory_mib=1).reason(1) or "")
    # Not before a job ran: a fresh process over the limit would only make way for another.
    assert Recycling(max_memory_mib=1).reason(0) is None
    with pytest.raises(ValueError):
        Recycling(max_jobs=0)


def assert_soon(predicate, timeout: float = 2.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end
        time.sleep(0.01)


def test_check_warns_of_a_limit_the_consumer_timeout_beats(settings):
    from django.core.checks import run_checks

    @task(name="tests.logic.long", time_limit=3600)
    def long() -> None: ...

    try:
        ids = [(m.id, m.obj) for m in run_checks() if m.id == "deferred.W004"]
        assert ids == [("deferred.W004", long.func)]
        quorum = {**settings.DEFERRED, "QUEUE_TYPE": "quorum", "CONSUMER_TIMEOUT": 120}
        with override_settings(DEFERRED=quorum):
            messages = [m for m in run_checks() if m.id == "deferred.W004"]
            # 600 s + 30 s reaches 120 s too, and so does the task's hour.
            assert len(messages) == 2 and "reaches the consumer timeout (120 s)" in messages[0].msg
    finally:
        unregister("tests.logic.long")
