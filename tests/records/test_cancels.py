"""Cancels against the real broker: before, while and after the worker runs, across restarts."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

import deferred
from deferred import BrokerError, cancel, cancel_many, defer, defer_many
from deferred.conf import get_settings
from deferred.core.jobs import due_of, new_job_id, utcnow
from deferred.records.cancels import read_cancels
from deferred.testing import capture
from tests.conftest import depth, rabbitmqctl, wait_for
from tests.testapp.tasks import patient_flaky, read_records, record, slow_fail

pytestmark = pytest.mark.usefixtures("clean")


def labels(path: str) -> list[str]:
    return [r["label"] for r in read_records(path)]


def test_a_job_cancelled_while_it_waits_never_runs_and_its_neighbour_does(
    clean, run_worker, records, caplog
):
    # Given two jobs due in half a second, one of them cancelled,
    kept = defer(record, 0.5, records, "kept")
    gone = defer(record, 0.5, records, "gone")
    cancel(gone)
    worker = run_worker()
    # when both come due,
    assert wait_for(lambda: labels(records) == ["kept"], 10)
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 5)
    # then only the other one ran, and the cancelled one was acked and logged.
    time.sleep(0.3)
    assert labels(records) == ["kept"]
    assert any(f"job={gone}" in m and "outcome=cancelled" in m for m in caplog.messages)
    assert not any(f"job={kept}" in m and "outcome=cancelled" in m for m in caplog.messages)
    assert depth_of_ready(clean) == 0


def depth_of_ready(plan) -> int:
    from deferred.broker import admin_channel

    with admin_channel(get_settings().broker_urls) as admin:
        return sum(admin.message_count(q.name) or 0 for q in plan.ready_queues.values())


def test_a_cancel_issued_100_ms_before_the_due_time_wins(clean, run_worker, records):
    # A running worker whose reader follows the stream; each job is cancelled
    # 100 ms before it is due (by the due time its id carries, not by the clock
    # before defer(), which a slow publish would eat into), so the cancel races
    # the job to the worker.
    run_worker(concurrency=4)
    in_time = []
    for n in range(20):
        job_id = defer(record, 0.4, records, f"raced-{n}")
        due = due_of(job_id)
        assert due is not None
        time.sleep(max(0.0, due.timestamp() - 0.1 - time.time()))
        cancel(job_id)
        # The promise holds for a cancel confirmed before the due time; on a
        # stalled host a few may miss it, and those are free to run.
        if time.time() < due.timestamp():
            in_time.append(f"raced-{n}")
        defer(record, 0, records, f"marker-{n}")
    assert len(in_time) >= 15, f"only {len(in_time)} of 20 cancels were confirmed in time"
    markers = lambda: [x for x in labels(records) if x.startswith("marker")]  # noqa: E731
    assert wait_for(lambda: len(markers()) == 20, 15)
    time.sleep(0.8)
    assert not [label for label in labels(records) if label in in_time]


def test_a_cancel_holds_across_a_worker_restart(clean, run_worker, records):
    worker = run_worker()
    assert worker.cancels.connected.wait(5)
    job_id = defer(record, 1.5, records, "gone")
    defer(record, 1.5, records, "kept")
    worker.stop()
    time.sleep(0.2)
    cancel(job_id)  # while no worker runs
    second = run_worker()
    assert wait_for(lambda: labels(records) == ["kept"], 10)
    assert wait_for(lambda: second.outcomes["cancelled"] == 1, 5)
    assert labels(records) == ["kept"]


def test_cancelling_during_a_retry_backoff_stops_the_retries(clean, run_worker, records):
    # patient_flaky fails its first attempts and waits 3 s before its first retry.
    worker = run_worker()
    job_id = defer(patient_flaky, 0, records, "flaky", 3)
    assert wait_for(lambda: worker.outcomes["retrying"] == 1, 10)
    cancel(job_id)  # during the backoff
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 10)
    time.sleep(1.0)  # the retry, 3 s after the first attempt, would have come by now
    assert [r["attempt"] for r in read_records(records)] == [1]
    assert worker.outcomes["retrying"] == 1


def test_a_running_job_that_is_cancelled_finishes_and_is_not_retried(
    clean, run_worker, records, raw_channel
):
    worker = run_worker()
    job_id = defer(slow_fail, 0, records, "running", 0.8)
    assert wait_for(lambda: labels(records) == ["running:start"], 10)
    cancel(job_id)
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 10)
    assert labels(records) == ["running:start", "running:end"]  # it finished
    time.sleep(0.5)
    assert labels(records) == ["running:start", "running:end"]  # and was not retried
    assert worker.outcomes["retrying"] == 0
    assert depth(raw_channel, clean.failed_queue.name) == 0  # nor kept as failed


@pytest.mark.alone
def test_a_cancel_holds_across_a_broker_restart(clean, run_worker, records, broker_url):
    gone = defer(record, 3, records, "gone")
    defer(record, 3, records, "kept")
    cancel(gone)
    rabbitmqctl("stop_app")
    try:
        time.sleep(0.5)
    finally:
        rabbitmqctl("start_app")
        rabbitmqctl("await_startup")
    assert wait_for(lambda: _answers(broker_url), 30)
    worker = run_worker()
    assert wait_for(lambda: labels(records) == ["kept"], 15)
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 5)
    assert labels(records) == ["kept"]


def _exists(queue: str) -> bool:
    from deferred.broker import admin_channel

    with admin_channel(get_settings().broker_urls) as admin:
        return admin.queue_exists(queue)


def _answers(url: str) -> bool:
    from deferred.broker import answers

    return answers(url)


def get_settings_dict() -> dict:
    from django.conf import settings

    return dict(settings.DEFERRED)


def test_unknown_finished_and_repeated_cancels_are_accepted(clean, run_worker, records):
    run_worker()
    done = defer(record, 0, records, "done")
    assert wait_for(lambda: labels(records) == ["done"], 10)
    cancel(done)  # finished
    cancel(done)  # already cancelled
    cancel("0" * 32)  # nobody's
    cancel("not-one-of-ours")
    cancel_many([])


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (42, TypeError),
        (None, TypeError),
        ("", ValueError),
        ("a\nb", ValueError),
        ("x" * 201, ValueError),
    ],
)
def test_a_bad_id_raises_and_publishes_nothing(value, error):
    with pytest.raises(error):
        cancel(value)


def test_cancel_many_refuses_a_string_and_checks_every_id_first():
    with pytest.raises(TypeError):
        cancel_many("0" * 32)
    with pytest.raises(TypeError):
        cancel_many(["0" * 32, 7])


def test_cancel_raises_broker_error_when_the_broker_cannot_take_it():
    dead = {**get_settings_dict(), "BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}
    with override_settings(DEFERRED={**dead, "PUBLISH_TIMEOUT": 2}):
        with pytest.raises(BrokerError):
            cancel("0" * 32)
        with pytest.raises(BrokerError):
            cancel_many(["0" * 32] * 3)


def test_a_job_id_carries_its_due_time():
    with capture() as jobs:
        job_id = defer(record, 60, "/dev/null", "x")
    assert due_of(job_id) is not None
    assert abs(due_of(job_id) - jobs[0].due) < timedelta(milliseconds=1)


def test_cancel_many_spreads_a_large_batch_and_the_status_counts_it(clean):
    soon = utcnow() + timedelta(hours=1)
    pending = [new_job_id(soon) for _ in range(2500)]
    cancel_many(pending)
    view = read_cancels()
    assert all(i in view for i in pending)
    out = StringIO()
    call_command("deferred_status", "--json", stdout=out)
    assert json.loads(out.getvalue())["cancels_in_force"] >= 2500


def test_the_command_cancels_and_reports_errors(clean, run_worker, records):
    gone = defer(record, 0.5, records, "gone")
    out = StringIO()
    call_command("deferred_cancel", gone, stdout=out)
    assert "Cancelled 1 job:" in out.getvalue()
    worker = run_worker()
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 10)
    assert labels(records) == []
    with pytest.raises(CommandError):
        call_command("deferred_cancel", "a\tb")
    dead = {**get_settings_dict(), "BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}
    with override_settings(DEFERRED={**dead, "PUBLISH_TIMEOUT": 2}):
        with pytest.raises(CommandError, match="may not have been taken"):
            call_command("deferred_cancel", "0" * 32)


def test_public_names():
    assert deferred.cancel is cancel and deferred.cancel_many is cancel_many


def test_a_thousand_jobs_half_cancelled_before_during_and_across_a_restart(
    clean, worker_process, records
):
    # Given 1,000 jobs due in 5-10 s (timed from before defer_many(), which
    # fixes their due times as it starts),
    rng = random.Random(11)
    delays = [5 + 5 * rng.random() for _ in range(1000)]
    started = time.monotonic()
    ids = defer_many([(record, d, (records, f"job-{n}")) for n, d in enumerate(delays)])
    by_delay = sorted(range(1000), key=lambda n: delays[n])
    # cancels that reach the broker before each job is due: the last group,
    # sent while no worker runs, among the latest jobs.
    restart_group = rng.sample([n for n in by_delay if delays[n] >= 9], 100)
    running_group = rng.sample(
        [n for n in by_delay if delays[n] >= 7 and n not in restart_group], 200
    )
    taken = {*restart_group, *running_group}
    before_group = rng.sample([n for n in range(1000) if n not in taken], 200)
    cancelled = {*taken, *before_group}
    # when 200 are cancelled before any worker runs,
    cancel_many([ids[n] for n in before_group])
    first = worker_process("--concurrency", "4")
    # 200 while it runs, one call each,
    for n in running_group:
        cancel(ids[n])
    assert time.monotonic() - started < 7, "too slow to cancel before the jobs are due"
    # and 100 while it restarts,
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0
    cancel_many([ids[n] for n in restart_group])
    assert time.monotonic() - started < 9, "too slow to cancel before the jobs are due"
    second = worker_process("--concurrency", "4")
    # then the 500 others run exactly once, and none of the 500 cancelled does.
    kept = {f"job-{n}" for n in range(1000) if n not in cancelled}
    assert wait_for(lambda: kept <= set(labels(records)), 40), len(set(labels(records)))
    time.sleep(1.0)  # anything late would show now
    ran = labels(records)
    assert sorted(ran) == sorted(kept), (
        f"{len(set(ran) - kept)} cancelled job(s) ran; {len(ran) - len(set(ran))} duplicate run(s)"
    )
    second.signal(signal.SIGTERM)
    assert second.wait(30) == 0
    logged = first.output() + second.output()
    assert logged.count("outcome=cancelled") == 500


def test_a_worker_declares_a_missing_cancels_stream_and_runs_jobs(
    own_topology, run_worker, records, raw_channel
):
    # Given a topology declared by a version that had no cancels stream,
    raw_channel.queue_delete(own_topology.cancels_queue.name)
    defer(record, 0, records, "ran")
    # a worker creates it (DECLARE is on) and runs the job;
    worker = run_worker()
    assert wait_for(lambda: labels(records) == ["ran"], 15)
    assert worker.cancels.connected.is_set()
    # and cancels work from then on.
    gone = defer(record, 2, records, "gone")
    cancel(gone)
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 10)
    assert labels(records) == ["ran"]


def test_a_stream_deleted_under_a_running_worker_is_declared_again(
    own_topology, run_worker, records, raw_channel, caplog
):
    worker = run_worker()
    assert worker.cancels.connected.wait(10)
    # When the stream disappears under the reader (its consumer is cancelled),
    raw_channel.queue_delete(own_topology.cancels_queue.name)
    # the reader declares it again (DECLARE is on) and reads it from its start
    # (connected again: its marker came back through the ingest exchange's binding):
    assert wait_for(lambda: _exists(own_topology.cancels_queue.name), 10)
    reads = lambda: [m for m in caplog.messages if " the cancels: " in m]  # noqa: E731
    assert wait_for(lambda: len(reads()) == 2, 10)
    gone = defer(record, 2, records, "gone")
    defer(record, 2, records, "kept")
    cancel(gone)
    assert wait_for(lambda: labels(records) == ["kept"], 15)
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 5)


def test_while_the_cancels_cannot_be_read_due_jobs_wait_and_are_never_counted_as_failed(
    own_topology, run_worker, records, raw_channel, monkeypatch, caplog
):
    from deferred.worker import pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "CANCELS_TIMEOUT_S", 0.5)
    monkeypatch.setattr(pipeline_module, "CANCELS_RETRY_S", 0.5)
    stream = own_topology.cancels_queue.name
    with override_settings(DEFERRED={**get_settings_dict(), "DECLARE": False}):
        worker = run_worker()
        assert worker.cancels.connected.wait(10)
        # Given a stream nobody may re-declare (DECLARE off), gone,
        raw_channel.queue_delete(stream)
        assert wait_for(lambda: not worker.cancels.connected.is_set(), 10)
        # a due job is not run on a guess: it goes back to wait, again and again,
        defer(record, 0, records, "waited")
        assert wait_for(lambda: worker.outcomes["rescheduled"] >= 3, 15)
        assert labels(records) == []
        assert depth(raw_channel, own_topology.failed_queue.name) == 0
        assert any("wait_for_cancels_ms" in m for m in caplog.messages)
        # and runs once the infrastructure brings the stream back.
        from deferred.broker import admin_channel

        with admin_channel(get_settings().broker_urls) as admin:
            # The stream and its binding: cancels and markers come through the ingest exchange.
            admin.declare_cancels(own_topology)
        assert wait_for(lambda: labels(records) == ["waited"], 20)
    assert depth(raw_channel, own_topology.failed_queue.name) == 0


@pytest.mark.alone
@pytest.mark.parametrize("then", ["readable", "unreadable"])
def test_a_job_whose_connection_goes_while_it_waits_for_the_cancels_runs_once(
    clean, run_worker, records, monkeypatch, caplog, then
):
    from deferred.broker import BrokerUnavailable
    from deferred.worker import pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "CANCELS_RETRY_S", 0.5)
    worker = run_worker(concurrency=2)
    assert worker.cancels.connected.wait(10)
    # Given reading the cancels is slow (a node dying, say): the first due job waits,
    gate, calls = threading.Event(), []
    real = worker.cancels.is_cancelled

    def slow(job_id: str, timeout: float, **kwargs) -> bool:
        calls.append(job_id)
        if len(calls) == 1:
            assert gate.wait(20)
            if then == "unreadable":
                raise BrokerUnavailable("the cancels could not be read in time")
        return real(job_id, timeout, **kwargs)

    monkeypatch.setattr(worker.cancels, "is_cancelled", slow)
    defer(record, 0, records, "once")
    assert wait_for(lambda: len(calls) == 1, 10)
    generation = worker.consumer.generation
    # when the connection that delivered it goes, RabbitMQ redelivers it,
    rabbitmqctl("close_all_connections", "test: the job is redelivered")
    assert wait_for(lambda: worker.consumer.generation > generation, 15)
    assert wait_for(lambda: len(calls) >= 2, 15)
    # and the copy that waited, whether the cancels then read or not, is neither run
    # nor sent back to wait beside the redelivered one.
    gate.set()
    assert wait_for(lambda: labels(records) == ["once"], 15)
    assert wait_for(
        lambda: any("lost connection; it was redelivered" in m for m in caplog.messages), 5
    )
    time.sleep(2)  # a second copy would have run by now
    assert labels(records) == ["once"]
    assert worker.outcomes["rescheduled"] == 0
