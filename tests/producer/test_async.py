"""adefer(), adefer_many() and the backend's aenqueue() against the real broker,
and async task functions run by the worker."""

from __future__ import annotations

import asyncio
import statistics
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.test import override_settings

from deferred import BrokerUnavailable, adefer, adefer_many, defer, defer_many, testing
from deferred.conf import get_settings
from deferred.django_tasks.framework import api as _api
from deferred.records.failures import list_failed
from tests.conftest import total_waiting, wait_for
from tests.testapp.framework_tasks import double, note, note_async
from tests.testapp.tasks import explode_async, read_records, record, record_async

pytestmark = pytest.mark.django_db(transaction=True)


def test_adefer_publishes_jobs_the_worker_runs_at_their_time(clean, records, run_worker):
    run_worker()

    async def main():
        sent = time.time()
        first = await adefer(record, 0.2, records, "adefer")
        second = await record.adefer(timedelta(milliseconds=100), records, "method")
        many = await adefer_many([(record, 0.1, (records, f"many-{n}")) for n in range(3)])
        return sent, [first, second, *many]

    sent, ids = asyncio.run(main())
    assert len(set(ids)) == 5
    assert wait_for(lambda: len(read_records(records)) == 5, 10)
    at = {r["label"]: r["at"] for r in read_records(records)}
    assert at["adefer"] >= sent + 0.2, "ran early"
    assert at["method"] >= sent + 0.1, "ran early"
    assert max(at.values()) < sent + 5, "grossly late"


def test_adefer_refuses_what_defer_refuses_and_publishes_nothing(clean, raw_channel, records):
    bad_calls = [
        (record, -1, records, "x"),  # a negative delay
        (record, "soon", records, "x"),  # not a delay
        ("no.such.task", 1),
        (record, 1, records),  # an argument missing
        (record, 1, records, object()),  # not JSON
        (record, 1, records, "x" * 300_000),  # over MAX_MESSAGE_BYTES
    ]
    bad_many = [
        # One bad call among good ones: none of them is published.
        [(record, 1, (records, "ok")), (record, 1, (records,))],
        [(record, 1)],
    ]

    def error_of(call, *args):
        try:
            result = call(*args)
            if asyncio.iscoroutine(result):
                asyncio.run(result)
        except (TypeError, ValueError) as exc:
            return type(exc), str(exc).split(" at 0x")[0]
        raise AssertionError(f"{call.__name__}{args!r} did not raise")

    for args in bad_calls:
        assert error_of(adefer, *args) == error_of(defer, *args)
    for calls in bad_many:
        assert error_of(adefer_many, calls) == error_of(defer_many, calls)
    assert total_waiting(raw_channel, clean) == 0


def test_adefer_with_the_broker_down_raises_broker_unavailable(records):
    with override_settings(DEFERRED={"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}):
        with pytest.raises(BrokerUnavailable, match="Cannot connect") as caught:
            asyncio.run(adefer(record, 1, records, "x"))
    assert caught.value.job_id  # names the job it could not publish


def test_the_event_loop_keeps_running_while_jobs_are_published(clean, records):
    # A ticker runs beside 200 adefer() calls: a publish waiting on its socket
    # in the loop would stop it for the whole confirm round trip.
    async def main():
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker():
            while not done.is_set():
                before = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - before - 0.001)

        ticking = asyncio.create_task(ticker())
        await asyncio.gather(*(adefer(record, 0, records, str(n)) for n in range(200)))
        done.set()
        await ticking
        return lags

    lags = asyncio.run(main())
    assert len(lags) > 10, "the ticker hardly ran: the loop was blocked"
    # A loop blocked by each publish would show many long lags; one stall of
    # the whole process on a loaded host shows as a single one.
    assert statistics.median(lags) < 0.05, (
        f"the loop stood still for {statistics.median(lags) * 1000:.0f} ms (median)"
    )
    assert max(lags) < 2.0, f"the loop stood still for {max(lags) * 1000:.0f} ms"


def test_inside_atomic_adefer_publishes_after_the_commit_and_never_for_a_rollback(
    clean, raw_channel, records
):
    # async_to_sync from inside atomic(): the transaction is the calling thread's.
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        async_to_sync(adefer)(record, 0, records, "rolled back")
        raise Boom
    assert total_waiting(raw_channel, clean) == 0

    with transaction.atomic():
        async_to_sync(adefer_many)([(record, 0, (records, "committed"))])
        time.sleep(0.1)
        assert total_waiting(raw_channel, clean) == 0, "published before the commit"
    assert wait_for(lambda: total_waiting(raw_channel, clean) == 1, 5)


def test_async_task_functions_run_and_retry_in_the_worker(clean, records, run_worker):
    run_worker(concurrency=2)
    defer_ids = [
        async_to_sync(adefer)(record_async, 0, records, "async-1"),
        async_to_sync(adefer)(record_async, 0, records, "async-2"),
    ]
    async_to_sync(adefer)(explode_async, 0, records, "boom")
    assert wait_for(lambda: len(list_failed(get_settings())) == 1, 15)
    ran = [r for r in read_records(records) if r.get("kind") == "async"]
    assert sorted(r["job"] for r in ran) == sorted(defer_ids)  # current_job() inside
    attempts = [r["attempt"] for r in read_records(records) if r["event"] == "attempt"]
    assert attempts == [1, 2]  # retried once, then failed
    (failed,) = list_failed(get_settings())
    assert failed.reason == "retries_exhausted" and "boom" in (failed.error or "")


def test_aenqueue_publishes_without_the_sync_thread_and_the_worker_runs_it(
    clean, run_worker, tmp_path
):
    run_worker()
    path = tmp_path / "notes.jsonl"

    async def main():
        results = await asyncio.gather(
            note.aenqueue(str(path), "aenqueue"),
            note_async.aenqueue(str(path), "async task"),
        )
        return results

    results = asyncio.run(main())
    assert [r.status for r in results] == [_api.TaskResultStatus.READY] * 2
    assert wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 2, 10)
    assert "aenqueue" in path.read_text() and "async task" in path.read_text()


def test_aenqueue_refuses_bad_arguments_and_waits_for_the_commit(clean, raw_channel, tmp_path):
    with pytest.raises(TypeError, match="Bad arguments"):
        asyncio.run(double.aenqueue())
    assert total_waiting(raw_channel, clean) == 0
    with pytest.raises(RuntimeError), transaction.atomic():
        async_to_sync(note.aenqueue)(str(tmp_path / "n"), "rolled back")
        raise RuntimeError
    assert total_waiting(raw_channel, clean) == 0


def test_test_modes_take_adefer_and_eager_runs_async_tasks(records):
    with testing.capture() as jobs:
        asyncio.run(adefer(record, 5, records, "captured"))
    assert [job.args for job in jobs] == [(records, "captured")]
    with testing.eager():
        asyncio.run(adefer(record_async, 5, records, "eager"))
    assert [r["label"] for r in read_records(records)] == ["eager"]


def test_callers_batched_together_each_get_the_error_naming_their_own_jobs(records):
    async def main():
        calls = [adefer(record, 1, records, str(n)) for n in range(5)]
        calls.append(adefer_many([(record, 1, (records, "a")), (record, 1, (records, "b"))]))
        return await asyncio.gather(*calls, return_exceptions=True)

    with override_settings(DEFERRED={"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}):
        errors = asyncio.run(main())
    assert all(isinstance(e, BrokerUnavailable) for e in errors), errors
    named = [e.job_ids for e in errors]
    assert [len(ids) for ids in named] == [1, 1, 1, 1, 1, 2]
    assert len({job_id for ids in named for job_id in ids}) == 7  # each its own
    assert all(e.job_id == e.job_ids[0] for e in errors)
