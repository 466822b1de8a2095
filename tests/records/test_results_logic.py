"""Results, pure: how records fold into a result, signatures, values, settings."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from deferred.conf import get_settings
from deferred.core import signing
from deferred.core.jobs import Job, new_job_id
from deferred.core.topology import build_plan
from deferred.operate import permissions
from deferred.producer.tasks import task
from deferred.records.recording import _with_run
from deferred.records.result_format import (
    CLOCK_SLACK_S,
    decode,
    encode,
    encode_marker,
    error_of,
    marker_of,
    value_record,
)
from deferred.records.result_format import id_ms as _id_ms
from deferred.records.results import Result, _since, fold

KEYS = ("k1",)
JOB = new_job_id(datetime(2026, 1, 1, tzinfo=UTC))
T0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()


def rec(ev: str, at: float, **fields) -> dict:
    return {"id": JOB, "ev": ev, "at": T0 + at, "a": fields.pop("a", 1), **fields}


def test_no_record_is_pending_and_unknown():
    r = fold(JOB, [])
    assert r.state == "pending" and r.outcome is None and r.attempts == 0
    assert r.worker is None and r.error is None and not r.finished


def test_started_then_succeeded():
    r = fold(
        JOB,
        [rec("started", 0, w="w1", task="t"), rec("succeeded", 1.5, value={"n": 1}, task="t")],
    )
    assert r.state == "succeeded" and r.finished and r.value == {"n": 1} and r.value_kept
    assert r.started_at == datetime.fromtimestamp(T0, UTC)
    assert r.finished_at == datetime.fromtimestamp(T0 + 1.5, UTC)
    assert r.worker == "w1" and r.task == "t" and r.attempts == 1


def test_a_retry_is_pending_with_its_error_then_the_last_attempt_counts():
    err = {"type": "builtins.RuntimeError", "msg": "boom", "tb": "Traceback..."}
    retrying = [rec("started", 0, w="w1"), rec("retrying", 1, err=err)]
    r = fold(JOB, retrying)
    assert r.state == "pending" and r.outcome == "retrying" and r.error.message == "boom"
    r = fold(JOB, [*retrying, rec("started", 5, a=2, w="w2")])
    assert r.state == "running" and r.attempts == 2 and r.workers == ("w1", "w2")
    assert r.last_attempted_at == datetime.fromtimestamp(T0 + 5, UTC)
    assert r.started_at == datetime.fromtimestamp(T0, UTC)
    r = fold(JOB, [*retrying, rec("started", 5, a=2), rec("failed", 6, a=2, err=err, reason="x")])
    assert r.state == "failed" and len(r.errors) == 2 and r.reason == "x"


def test_cancelled_and_superseded_read_cancelled_and_dropped_reads_failed():
    assert fold(JOB, [rec("cancelled", 0)]).state == "cancelled"
    superseded = fold(JOB, [rec("superseded", 0)])
    assert superseded.state == "cancelled" and superseded.outcome == "superseded"
    assert fold(JOB, [rec("dropped", 0)]).state == "failed"


def test_the_first_end_stands_against_a_duplicate_run():
    # A duplicate delivery of the same run (no "run", or the same one) after its end
    r = fold(
        JOB,
        [rec("started", 0), rec("succeeded", 1, value=1), rec("started", 2), rec("failed", 3)],
    )
    assert r.state == "succeeded" and r.value == 1 and r.finished_at.timestamp() == T0 + 1
    same_run = _id_ms(JOB)
    r = fold(JOB, [rec("failed", 1), rec("started", 2, run=same_run), rec("succeeded", 3)])
    assert r.state == "failed" and r.attempts == 1


def test_a_re_driven_run_supersedes_the_failure_it_follows():
    err = {"type": "builtins.RuntimeError", "msg": "boom", "tb": ""}
    later = _id_ms(JOB) + 3_600_000
    failed = [rec("started", 0, w="w1"), rec("failed", 1, err=err, reason="task_error")]
    # The re-drive's own record (no attempt, no worker): pending again
    redriven = [*failed, {"id": JOB, "ev": "retrying", "at": T0 + 3599, "run": later}]
    r = fold(JOB, redriven)
    assert r.state == "pending" and r.outcome == "retrying" and r.finished_at is None
    assert r.attempts == 1 and r.reason is None and len(r.errors) == 1
    assert fold(JOB, [*redriven, rec("started", 3600, run=later)]).attempts == 2
    again = [*failed, rec("started", 3600, run=later, w="w2")]
    r = fold(JOB, again)
    assert r.state == "running" and r.outcome == "started" and r.finished_at is None
    assert r.reason is None and r.attempts == 2 and r.workers == ("w1", "w2")
    # A duplicate of the failed run's end, read after the new run began: ignored
    r = fold(JOB, [*again, rec("failed", 3601, err=err)])
    assert r.state == "running"
    r = fold(JOB, [*again, rec("succeeded", 3602, run=later, value=7)])
    assert r.state == "succeeded" and r.value == 7 and r.reason is None
    assert r.attempts == 2 and len(r.errors) == 1  # the failed run's error is kept
    assert r.started_at == datetime.fromtimestamp(T0, UTC)
    assert r.last_attempted_at == datetime.fromtimestamp(T0 + 3600, UTC)
    # A run that ends within STARTED_AFTER_S has one record: it still starts the run
    r = fold(JOB, [*failed, rec("succeeded", 3600, run=later, st=T0 + 3600, w="w2")])
    assert r.state == "succeeded" and r.workers == ("w1", "w2")
    # "run" that is no number is the first run's
    r = fold(JOB, [*failed, rec("succeeded", 5, run="later"), rec("succeeded", 6, run=True)])
    assert r.state == "failed"


def test_records_carry_their_run_only_when_re_driven():
    from dataclasses import replace

    due = datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
    job = Job(id=new_job_id(due), task="t", args=(), kwargs={}, due=due, queue="q")
    record: dict = {}
    _with_run(record, job)
    assert record == {}
    retried = job.next_attempt(due + timedelta(seconds=30))
    _with_run(record, retried)
    assert record == {}  # a retry is the same run
    redriven = replace(retried, attempt=1, due=due + timedelta(hours=1), first_due_at=None)
    _with_run(record, redriven)
    assert record["run"] > _id_ms(job.id)
    assert (
        fold(
            job.id,
            [
                {"id": job.id, "ev": "failed", "at": 1.0, "a": 2},
                {"id": job.id, "ev": "succeeded", "at": 2.0, "a": 1, **record},
            ],
        ).state
        == "succeeded"
    )


def test_other_jobs_and_unknown_events_are_ignored():
    other = {**rec("succeeded", 0), "id": "other"}
    assert fold(JOB, [other, rec("exploded", 0)]).state == "pending"


def test_a_value_left_out_reads_not_kept():
    r = fold(JOB, [rec("succeeded", 0, kept=False)])
    assert r.state == "succeeded" and r.value is None and not r.value_kept


def test_django_tasks_calls_come_from_any_record():
    r = fold(
        JOB,
        [
            rec(
                "cancelled",
                0,
                b="default",
                args=[1],
                kwargs={"x": 2},
                c="2026-01-01T00:00:00+00:00",
            )
        ],
    )
    assert r.backend == "default" and r.args == (1,) and r.kwargs == {"x": 2}
    assert r.enqueued_at == datetime(2026, 1, 1, tzinfo=UTC)


def test_a_record_signed_with_another_key_or_unsigned_is_never_read():
    body = encode([rec("succeeded", 0)])
    assert decode(body, signing.sign(body, KEYS), KEYS) == [rec("succeeded", 0)]
    assert decode(body, signing.sign(body, ("forger",)), KEYS) == []
    assert decode(body, {}, KEYS) == []
    # Altered after signing
    headers = signing.sign(body, KEYS)
    assert decode(body.replace(b"succeeded", b"cancelled"), headers, KEYS) == []
    # Signing off: read as it is
    assert decode(body, {}, None) == [rec("succeeded", 0)]


def test_what_is_not_a_record_message_reads_as_none():
    for body in (b"not json", b"[]", b'{"v": 99, "r": []}', b'{"v": 1, "r": "x"}'):
        assert decode(body, None, None) == []
    assert decode(b'{"v": 1, "r": [1, {"id": "a"}]}', None, None) == [{"id": "a"}]


def test_markers_are_told_apart():
    assert marker_of(encode_marker("tok")) == "tok"
    assert marker_of(encode([rec("started", 0)])) is None
    assert marker_of(b'{"marker": 5}') is None


def test_values_json_cannot_carry_or_too_large_are_left_out():
    assert value_record({"a": [1, 2]}, 100) == {"value": {"a": [1, 2]}}
    assert value_record(object(), 100) == {"kept": False}
    assert value_record("x" * 200, 100) == {"kept": False}
    assert value_record(None, 0) == {"kept": False}  # "null" is 4 bytes
    assert value_record((1, 2), 100) == {"value": [1, 2]}  # as JSON gives it back


def test_an_error_keeps_its_class_path_message_and_a_cut_traceback():
    try:
        raise ValueError("x" * 5000)
    except ValueError as exc:
        err = error_of(exc)
    assert err["type"] == "builtins.ValueError"
    assert len(err["msg"]) == 2000
    assert "Traceback" in err["tb"] or "ValueError" in err["tb"]

    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError

    assert "cannot be printed" in error_of(Broken())["msg"]


def test_the_reader_starts_a_little_before_the_due_time_the_id_carries():
    due = datetime(2026, 3, 1, 12, tzinfo=UTC)
    assert _since(new_job_id(due)) == due - timedelta(seconds=CLOCK_SLACK_S)
    with pytest.raises(ValueError, match="not a job id"):
        _since("123")


def test_settings_defaults_and_bad_values():
    with override_settings(DEFERRED={}):
        s = get_settings()
    assert s.results is True and s.result_ttl_ms == 24 * 3600 * 1000
    assert s.result_max_bytes == 64 * 1024
    with override_settings(DEFERRED={"RESULT_TTL": timedelta(hours=2), "RESULTS": False}):
        s = get_settings()
    assert s.results is False and s.result_ttl_ms == 2 * 3600 * 1000
    for bad in (
        {"RESULTS": "yes"},
        {"RESULT_TTL": 5},
        {"RESULT_TTL": timedelta(days=3651)},
        {"RESULT_MAX_BYTES": -1},
        {"RESULT_MAX_BYTES": 2 * 1024 * 1024},
        {"RESULT_MAX_BYTES": True},
    ):
        with override_settings(DEFERRED=bad), pytest.raises(ImproperlyConfigured):
            get_settings()


def test_the_results_stream_keeps_result_ttl():
    plan = build_plan(
        prefix="p",
        radix=16,
        resolution_ms=1,
        max_delay_ms=60_000,
        queue_type="classic",
        queues=("default",),
        result_ttl_ms=3_600_000,
    )
    assert plan.results_queue.name == "p.results"
    assert plan.results_queue.arguments["x-queue-type"] == "stream"
    assert plan.results_queue.arguments["x-max-age"] == "3600s"
    assert plan.results_queue in plan.shared_queues
    assert any(b.destination == "p.results" and b.routing_key == "result" for b in plan.bindings)


def test_the_publisher_role_may_read_the_results_and_not_the_queues_of_jobs():
    import re

    publisher = permissions.for_role("publisher", "app")
    assert re.fullmatch(publisher.read, "app.results")
    assert not re.fullmatch(publisher.read, "app.failed")
    assert not re.fullmatch(publisher.read, "app.ready.default")
    worker = permissions.for_role("worker", "app")
    assert re.fullmatch(worker.read, "app.results")


def test_task_result_option():
    @task(name="tests.logic.no_result", result=False)
    def quiet() -> None: ...

    assert quiet.result is False
    with pytest.raises(TypeError, match="result"):
        task(name="tests.logic.bad", result="no")  # type: ignore[arg-type]


def test_a_django_tasks_jobs_records_carry_its_call():
    from deferred.records.recording import _with_call

    job = Job(id=JOB, task="app.tasks.f", args=(1,), kwargs={}, due=datetime.now(UTC), queue="q")
    assert "b" not in _with_call({}, job)
    from dataclasses import replace

    called = _with_call({}, replace(job, backend="default"))
    assert called["b"] == "default" and called["args"] == [1]
    json.dumps(called)


class _Sender:
    """A publisher that keeps what it is given, or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.sent: list[bytes] = []
        self.error = error

    def publish(self, exchange: str, routing_key: str, body: bytes, **_kwargs) -> None:
        if self.error is not None:
            raise self.error
        self.sent.append(body)


def _writer(monkeypatch, sender: _Sender):
    from deferred.broker import results as broker_results

    monkeypatch.setattr(broker_results, "publisher", lambda urls, timeout: sender)

    def encode_or_fail(records: list) -> tuple[bytes, dict]:
        if "bad" in records:
            raise TypeError("a record JSON cannot carry")
        return json.dumps(records).encode(), {}

    return broker_results.ResultWriter(
        "amqp://guest:guest@127.0.0.1:1/%2F", "x", "result", encode_or_fail, timeout=1, linger_s=0
    )


def test_the_writer_survives_a_batch_that_raises_and_gives_it_up(monkeypatch, caplog):
    sender = _Sender()
    writer = _writer(monkeypatch, sender)
    writer.start()
    try:
        told: list[bool] = []
        bad = writer.write("bad")
        bad.add_done_callback(told.append)
        assert not bad.wait(5) and bad._done.is_set() and told == [False]
        assert writer.lost == 1 and "could not write 1 result record" in caplog.text.lower()
        # The thread is still there: the next record goes out, and is confirmed
        good = writer.write("good")
        assert good.wait(5) and good.ok
        assert sender.sent == [b'["good"]']
        # Not only encode: a publisher that raises something unexpected too
        sender.error = RuntimeError("a bug in the publisher")
        assert not writer.write("again").wait(5)
        sender.error = None
        assert writer.write("after").wait(5)
        assert writer._thread is not None and writer._thread.is_alive()
    finally:
        writer.stop()


def test_the_writer_waits_for_a_broker_that_went_away_and_sends_each_message_once(monkeypatch):
    from deferred.broker import BrokerUnavailable
    from deferred.broker import results as broker_results

    class Flaky(_Sender):
        """Refuses the first ``fails`` publishes, as a restarting broker does."""

        def __init__(self, fails: int) -> None:
            super().__init__()
            self.fails = fails

        def publish(self, exchange: str, routing_key: str, body: bytes, **kwargs) -> None:
            if self.fails:
                self.fails -= 1
                raise BrokerUnavailable("restarting")
            super().publish(exchange, routing_key, body, **kwargs)

    monkeypatch.setattr(broker_results, "RETRY_FIRST_S", 0.05)
    sender = Flaky(fails=3)
    writer = _writer(monkeypatch, sender)
    writer.start()
    try:
        written = writer.write("one")
        assert written.wait(5) and writer.lost == 0
        assert sender.sent == [b'["one"]']
    finally:
        writer.stop()


def test_the_writer_gives_up_a_batch_the_broker_refuses_for_too_long_and_goes_on(monkeypatch):
    from deferred.broker import BrokerUnavailable
    from deferred.broker import results as broker_results

    monkeypatch.setattr(broker_results, "RETRY_FOR_S", 0.3)
    monkeypatch.setattr(broker_results, "RETRY_FIRST_S", 0.05)
    sender = _Sender(BrokerUnavailable("down"))
    writer = _writer(monkeypatch, sender)
    writer.start()
    try:
        started = time.monotonic()
        assert not writer.write("one").wait(5) and writer.lost == 1
        assert time.monotonic() - started >= 0.1  # it tried for a while first
        sender.error = None
        assert writer.write("two").wait(5)
    finally:
        writer.stop()


def test_an_id_due_before_the_stream_keeps_anything_reads_pending_without_a_read(monkeypatch):
    from deferred.records import results

    def no_read(*_args, **_kwargs):
        raise AssertionError("the stream was read")

    monkeypatch.setattr(results, "_read", no_read)
    ttl = get_settings().result_ttl_ms / 1000
    old = new_job_id(datetime.now(UTC) - timedelta(seconds=ttl + 60))
    found = results.result(old)
    assert found == Result(id=old) and found.state == "pending" and found.complete


def test_an_incomplete_result_says_so():
    from dataclasses import replace

    from deferred.records.results import render_text

    found = replace(fold(JOB, [rec("failed", 0)]), complete=False)
    assert found.as_dict()["complete"] is False
    assert "ran out of time" in render_text(found)
    assert "ran out of time" not in render_text(fold(JOB, [rec("failed", 0)]))


def test_a_writer_behind_the_jobs_makes_them_wait_for_room_then_gives_their_records_up(
    monkeypatch,
):
    from deferred.broker import results as broker_results

    sender = _Sender()
    monkeypatch.setattr(broker_results, "publisher", lambda urls, timeout: sender)
    # Not started: nothing takes records out, as a writer stuck on a slow broker
    writer = broker_results.ResultWriter(
        "amqp://guest:guest@127.0.0.1:1/%2F",
        "x",
        "result",
        lambda records: (json.dumps(records).encode(), {}),
        timeout=0.2,
        max_waiting=2,
    )
    first, second = writer.write("a"), writer.write("b")
    assert first is second and writer.lost == 0
    t0 = time.monotonic()
    third = writer.write("c")
    waited = time.monotonic() - t0
    assert 0.15 <= waited < 2 and not third.wait(0) and writer.lost == 1
    # Room again once the writer takes the waiting records: a job thread waiting is let in
    let_in: list = []
    waiting = threading.Thread(target=lambda: let_in.append(writer.write("d")))
    writer.timeout = 5
    waiting.start()
    time.sleep(0.05)
    assert not let_in
    writer.start()
    waiting.join(5)
    try:
        assert let_in and let_in[0].wait(5)
        assert first.wait(5) and json.loads(sender.sent[0]) == ["a", "b"]
        assert b'"d"' in sender.sent[-1]
    finally:
        writer.stop()


# ---------------------------------------------------------------- the results cache


def test_only_a_first_attempts_lasting_end_is_cacheable():
    from deferred.records.recording import cacheable

    assert cacheable({"ev": "succeeded", "a": 1})
    assert cacheable({"ev": "cancelled"})  # dropped before it started
    assert cacheable({"ev": "superseded", "a": 1})
    assert not cacheable({"ev": "succeeded", "a": 2})  # other workers ran attempt 1
    assert not cacheable({"ev": "failed", "a": 1})  # may be re-driven
    assert not cacheable({"ev": "retrying", "a": 1})
    assert not cacheable({"ev": "succeeded", "a": 1, "run": 123})  # a re-driven run


def test_the_cache_putter_puts_a_message_s_entries_once_it_is_confirmed(settings):
    from django.core.cache import caches

    from deferred.broker.results import Written
    from deferred.conf import get_settings
    from deferred.records.result_cache import CachePutter, cache_key
    from tests.conftest import wait_for

    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    cache = caches["default"]
    cache.clear()

    def encoded(records):
        return (json.dumps(records).encode(), {})

    def entry(job_id):
        return cache.get(cache_key(get_settings(), job_id))

    putter = CachePutter(get_settings(), "default", encoded)
    confirmed, refused, early = Written(), Written(), Written()
    putter.add(confirmed, "a", [{"n": 1}])
    putter.add(confirmed, "b", [{"n": 2}])
    putter.add(refused, "c", [{"n": 3}])
    time.sleep(0.1)
    assert entry("a") is None  # not before the confirm
    confirmed._finish(True)
    refused._finish(False)
    assert wait_for(lambda: entry("b") is not None, 5)
    assert entry("a") == (b'[{"n": 1}]', {}) and entry("b") == (b'[{"n": 2}]', {})
    # A message confirmed before its entry was added: put at once
    early._finish(True)
    putter.add(early, "d", [{"n": 4}])
    assert wait_for(lambda: entry("d") is not None, 5)
    putter.stop()
    assert entry("c") is None
    assert putter.put == 3 and not putter._batches


def test_a_cache_that_hangs_holds_up_nothing_and_drops_what_has_no_room(settings, monkeypatch):
    from django.core.cache.backends.locmem import LocMemCache

    from deferred.broker.results import Written
    from deferred.conf import get_settings
    from deferred.records import result_cache

    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    release = threading.Event()
    monkeypatch.setattr(result_cache, "MAX_BATCHES", 2)
    # Every thread has its own cache object: the class is what they share.
    monkeypatch.setattr(LocMemCache, "set_many", lambda *a, **k: release.wait(10))
    putter = result_cache.CachePutter(get_settings(), "default", lambda r: (b"", {}))
    started = time.monotonic()
    for n in range(6):  # one taken by the hung thread, two waiting, the rest dropped
        written = Written()
        putter.add(written, f"job{n}", [{"n": n}])
        written._finish(True)
        time.sleep(0.05)
    assert time.monotonic() - started < 2  # the writer's callbacks never waited
    assert putter.failed == 3
    release.set()
    putter.stop()
    assert putter.put == 3


def test_a_redelivered_attempt_is_not_cached_and_a_fresh_one_is(settings):
    from deferred.core.jobs import utcnow
    from deferred.records.recording import Recorder

    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": "default"}
    recorder = Recorder(get_settings(), "host:1")  # its writer not started: nothing sent
    assert recorder.cache is not None
    # What the recorder hands the cache (a batch leaves the cache's view once its write
    # is settled, at a moment a busy host moves).
    added: list[str] = []
    hand = recorder.cache.add

    def spy(written: Any, job_id: str, records: list[dict[str, Any]]) -> None:
        added.append(job_id)
        hand(written, job_id, records)

    recorder.cache.add = spy  # type: ignore[method-assign]

    def made() -> Job:
        # One moment for the id and the due time: a millisecond between the two would
        # make the job read as a re-driven run, which is never cached.
        now = utcnow()
        return Job(id=new_job_id(now), task="tests.add", args=(), kwargs={}, due=now, queue="q")

    def ran(redelivered: bool) -> Job:
        job = made()
        recorder.record_start(job, utcnow(), redelivered=redelivered)
        recorder.record_end(job, "succeeded", utcnow(), value=1)
        return job

    fresh, again = ran(False), ran(True)
    dropped = made()
    recorder.record_end(dropped, "cancelled", utcnow())  # never started: cached all the same
    assert sorted(added) == sorted([fresh.id, dropped.id]) and again.id not in added
    assert not recorder._starts


def test_the_writer_wakes_for_a_delayed_record_due_before_it_would_wake():
    from deferred.broker.results import ResultWriter

    writer = ResultWriter(
        "amqp://guest:guest@127.0.0.1:1/%2F",
        "x",
        "result",
        lambda r: (b"", {}),
        timeout=1,
        linger_s=0,
    )
    sent: list[tuple[float, list]] = []
    writer._publish = lambda written: sent.append((time.monotonic(), list(written.records)))
    writer.start()
    try:
        start = time.monotonic()
        writer.delay("late", "late", 5.0)  # the writer now sleeps until this one's time
        time.sleep(0.1)
        writer.delay("soon", "soon", 0.2)  # due before that: it must wake for it
        deadline = time.monotonic() + 3
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sent, "the record due sooner never went out"
        at, records = sent[0]
        assert records == ["soon"]
        assert 0.25 <= at - start < 1.5  # not early, and not at the later record's time
        writer.write("now")  # a plain record wakes it too
        deadline = time.monotonic() + 2
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sent) == 2 and sent[1][1] == ["now"]
    finally:
        writer.stop(timeout=2)


def test_the_recorder_as_an_observer_records_the_jobs_that_keep_results():
    """The worker tells its observers, the recorder among them, what starts and ends;
    the recorder writes the events a result reads, of the jobs that keep results."""
    from deferred.core.jobs import utcnow
    from deferred.core.outcomes import Observers, Outcome
    from deferred.records.recording import Recorder

    recorder = Recorder(get_settings(), "host:1")  # its writer not started: nothing sent
    written: list[dict[str, Any]] = []
    delayed: list[dict[str, Any]] = []
    write, delay = recorder.writer.write, recorder.writer.delay

    def spy_write(record: dict[str, Any]) -> Any:
        written.append(record)
        return write(record)

    def spy_delay(key: str, record: dict[str, Any], seconds: float) -> None:
        delayed.append(record)
        delay(key, record, seconds)

    recorder.writer.write = spy_write  # type: ignore[method-assign]
    recorder.writer.delay = spy_delay  # type: ignore[method-assign]
    told = Observers([recorder])

    def job(name: str) -> Job:
        now = utcnow()
        return Job(id=new_job_id(now), task=name, args=(), kwargs={}, due=now, queue="q")

    kept, unkept = job("tests.add"), job("tests.add_unrecorded")
    for each in (kept, unkept):
        told.attempt_started(each, utcnow(), redelivered=False)
        told.job_ended(each, Outcome.RETRYING, utcnow(), error=ValueError("again"))
    told.job_ended(kept, Outcome.RESCHEDULED, utcnow())  # no event: the job stays pending
    told.started()  # the counting hooks are not the recorder's: nothing, no error
    assert [(r["id"], r["ev"]) for r in delayed] == [(kept.id, "started")]
    assert [(r["id"], r["ev"]) for r in written] == [(kept.id, "retrying")]
    assert written[0]["err"]["type"].endswith("ValueError")
