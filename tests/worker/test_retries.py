"""Retries, failed jobs and their command, against the real broker."""

from __future__ import annotations

import itertools
import json
import signal
import time
from datetime import datetime
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from deferred import defer
from tests.conftest import depth, signed, wait_for
from tests.testapp.tasks import (
    always_fails,
    asks_retry,
    fails_until_file,
    flaky,
    permanent,
    read_records,
    record,
    who_am_i,
)

pytestmark = pytest.mark.usefixtures("clean")


def attempts(path: str) -> list[dict]:
    return [r for r in read_records(path) if r["event"] == "attempt"]


def failed_list() -> list[dict]:
    out = StringIO()
    call_command("deferred_failed", "list", "--json", stdout=out)
    return json.loads(out.getvalue())


def test_fails_twice_then_succeeds_with_its_backoff(records, run_worker):
    run_worker()
    job_id = defer(flaky, 0, records, "f", 2)
    assert wait_for(lambda: len(attempts(records)) == 3, 15), read_records(records)
    time.sleep(0.3)
    runs = attempts(records)
    assert [r["attempt"] for r in runs] == [1, 2, 3]
    assert {r["job"] for r in runs} == {job_id}  # the same job id on every attempt
    gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(runs)]
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0, gaps
    assert gaps[0] < 3.5 and gaps[1] < 4.0, gaps


def test_always_failing_task_ends_in_the_failed_queue_after_its_retries(
    clean, raw_channel, records, run_worker
):
    run_worker()
    job_id = defer(always_fails, 0, records, "doomed")
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 10)
    assert [r["attempt"] for r in attempts(records)] == [1, 2, 3]
    (entry,) = failed_list()
    assert entry["id"] == job_id and entry["task"] == "tests.always_fails"
    assert entry["reason"] == "retries_exhausted" and entry["attempts"] == 3
    assert "doomed always fails" in entry["error"]
    assert "RuntimeError" in entry["traceback"]
    # The original due time, not the last retry's.
    first_run = attempts(records)[0]["at"]
    assert datetime.fromisoformat(entry["due"]).timestamp() <= first_run
    assert entry["failed_at"] >= entry["due"]
    assert depth(raw_channel, clean.failed_queue.name) == 1  # listing took nothing away


def test_a_permanent_error_is_not_retried(clean, raw_channel, records, run_worker):
    run_worker()
    defer(permanent, 0, records, "p")
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 10)
    assert len(attempts(records)) == 1
    assert failed_list()[0]["reason"] == "task_error"


def test_a_task_can_ask_for_a_retry(records, run_worker):
    run_worker()
    defer(asks_retry, 0, records, "r")
    assert wait_for(lambda: len(attempts(records)) == 2, 10)
    first, second = attempts(records)
    assert second["at"] - first["at"] >= 0.3


def test_current_job_inside_and_outside(records, run_worker):
    import deferred

    assert deferred.current_job() is None
    run_worker()
    job_id = defer(who_am_i, 0, records, "me")
    assert wait_for(lambda: read_records(records), 10)
    (row,) = read_records(records)
    assert (row["job"], row["attempt"], row["task"]) == (job_id, 1, "tests.who_am_i")


def test_failed_jobs_are_listed_retried_and_purged(
    clean, raw_channel, records, run_worker, tmp_path
):
    flag = str(tmp_path / "service-is-back")
    run_worker()
    to_retry = defer(fails_until_file, 0, records, "retry-me", flag)
    to_purge = defer(fails_until_file, 0, records, "purge-me", flag)
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 2, 10)
    assert {e["id"] for e in failed_list()} == {to_retry, to_purge}

    # retry: the job runs again, as a fresh first attempt, and leaves the failed queue.
    open(flag, "w").close()
    out = StringIO()
    call_command("deferred_failed", "retry", to_retry, stdout=out)
    assert "1 job re-queued" in out.getvalue()
    assert wait_for(
        lambda: len([r for r in attempts(records) if r["label"] == "retry-me"]) == 2, 10
    )
    time.sleep(0.3)
    assert [e["id"] for e in failed_list()] == [to_purge]

    # purge: refuses without confirmation when not interactive, then deletes with --yes.
    with pytest.raises(CommandError, match="--yes"):
        call_command("deferred_failed", "purge", to_purge)
    assert [e["id"] for e in failed_list()] == [to_purge]
    call_command("deferred_failed", "purge", to_purge, "--yes", stdout=StringIO())
    assert failed_list() == []


def test_failed_command_errors(clean):
    with pytest.raises(CommandError, match="not-a-job"):
        call_command("deferred_failed", "retry", "not-a-job", stdout=StringIO())
    with pytest.raises(CommandError, match="--all"):
        call_command("deferred_failed", "purge", stdout=StringIO())
    with pytest.raises(CommandError, match="MAX_DELAY"):
        call_command("deferred_failed", "retry", "--all", "--delay", "1e12", stdout=StringIO())
    with pytest.raises(CommandError, match="not both"):
        call_command("deferred_failed", "purge", "x", "--all", stdout=StringIO())


def test_retry_all_with_a_delay(clean, raw_channel, records, run_worker):
    run_worker()
    defer(always_fails, 0, records, "a")
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 10)
    before = len(attempts(records))
    started = time.time()
    call_command("deferred_failed", "retry", "--all", "--delay", "0.5", stdout=StringIO())
    assert depth(raw_channel, clean.failed_queue.name) == 0
    assert wait_for(lambda: len(attempts(records)) > before, 10)
    assert attempts(records)[before]["at"] - started >= 0.5
    assert attempts(records)[before]["attempt"] == 1


def test_sigkill_between_retry_publish_and_ack_duplicates_but_never_loses(
    clean, records, worker_process, monkeypatch
):
    monkeypatch.setenv("DEFERRED_TEST_KILL_AFTER_RETRY_PUBLISH", "1")
    dying = worker_process(expect_exit=True)
    job_id = defer(flaky, 0, records, "k", 1)
    assert dying.wait(20) == -signal.SIGKILL
    # The retry was published and the original never acked: both come back.
    monkeypatch.delenv("DEFERRED_TEST_KILL_AFTER_RETRY_PUBLISH")
    worker_process()
    assert wait_for(lambda: any(r["attempt"] == 2 for r in attempts(records)), 15)
    time.sleep(1.5)
    runs = attempts(records)
    assert {r["job"] for r in runs} == {job_id}
    assert any(r["attempt"] == 2 for r in runs), "the retry was lost"
    assert len(runs) <= 4  # at most a duplicate of each attempt


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_a_job_that_kills_the_worker_every_time_ends_in_the_failed_queue(
    broker_url, tmp_path, monkeypatch, queue_type
):
    import uuid

    from django.test import override_settings

    from deferred.broker import admin_channel
    from deferred.conf import get_settings
    from deferred.core.topology import plan_topology
    from tests.conftest import WorkerProcess
    from tests.testapp.tasks import crash

    prefix = f"deferred-test-poison-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("DEFERRED_TEST_PREFIX", prefix)
    monkeypatch.setenv("DEFERRED_TEST_QUEUE_TYPE", queue_type)
    monkeypatch.setenv("DEFERRED_TEST_DELIVERY_LIMIT", "2")
    records = str(tmp_path / "poison.jsonl")
    values = {
        "BROKER_URL": broker_url,
        "PREFIX": prefix,
        "QUEUE_TYPE": queue_type,
        "DELIVERY_LIMIT": 2,
        "QUEUES": ["default", "other"],
    }
    with override_settings(DEFERRED=values):
        plan = plan_topology(get_settings())
        call_command("declare_delay_topology", verbosity=0)
        try:
            defer(crash, 0, records, "poison")
            with admin_channel(broker_url) as admin:
                for n in range(8):  # bounded: each worker dies on the poison job
                    if admin.message_count(plan.failed_queue.name):
                        break
                    worker = WorkerProcess(tmp_path / f"w{n}.log", expect_exit=True)
                    assert wait_for(
                        lambda: (
                            worker.proc.poll() is not None  # noqa: B023
                            or admin.message_count(plan.failed_queue.name)
                        ),
                        30,
                    )
                    if worker.proc.poll() is None:  # it failed the job instead of dying
                        worker.proc.send_signal(signal.SIGTERM)
                        assert worker.proc.wait(20) == 0
                assert admin.message_count(plan.failed_queue.name) == 1
            runs = len(attempts(records))
            assert runs == 3, f"{runs} runs with DELIVERY_LIMIT 2"  # DELIVERY_LIMIT + 1
            (entry,) = failed_list()
            assert entry["reason"] == "delivery_limit" and entry["task"] == "tests.crash"
            # A restarted worker runs other jobs normally.
            healthy = WorkerProcess(tmp_path / "healthy.log")
            defer(record, 0, records, "after")
            assert wait_for(
                lambda: any(r.get("label") == "after" for r in read_records(records)), 10
            )
            healthy.proc.send_signal(signal.SIGTERM)
            assert healthy.proc.wait(20) == 0
        finally:
            with admin_channel(broker_url) as admin:
                admin.delete_everything(plan)


def test_redrive_publishes_a_fresh_message_without_dead_letter_headers(clean, raw_channel):
    # A job dead-lettered into the failed queue carries x-death headers; brokers
    # before 4.0.1 may drop a re-published message that still has them.
    import pika

    from deferred.core.jobs import Job, new_job_id, utcnow

    job = Job(
        id=new_job_id(), task=record.name, args=("p", "x"), kwargs={}, due=utcnow(), queue="default"
    )
    death = {
        "x-death": [{"reason": "delivery_limit", "queue": "q", "count": 1}],
        "x-first-death-reason": "delivery_limit",
        "x-last-death-reason": "delivery_limit",
    }
    raw_channel.basic_publish(
        "",
        clean.failed_queue.name,
        job.encode(),
        # RabbitMQ keeps the job's signature header when it dead-letters it.
        pika.BasicProperties(headers={**death, **signed(job.encode())}, delivery_mode=2),
    )
    (entry,) = failed_list()
    assert entry["reason"] == "delivery_limit"
    call_command("deferred_failed", "retry", job.id, stdout=StringIO())
    ready = clean.ready_queues["default"].name
    assert wait_for(lambda: depth(raw_channel, ready) == 1, 5)
    _method, props, body = raw_channel.basic_get(ready, auto_ack=True)
    assert Job.decode(body).id == job.id
    headers = props.headers or {}
    assert not [h for h in headers if h.startswith(("x-death", "x-first-death", "x-last-death"))]
