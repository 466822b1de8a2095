"""Debounced jobs against the real broker: only the latest job of each key runs."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from io import StringIO

import pytest
from django.core.management import call_command

from deferred import adefer, defer, defer_many
from deferred.broker import publisher
from deferred.conf import get_settings
from deferred.core import signing
from deferred.core.jobs import due_of
from deferred.core.topology import CANCEL_ROUTING_KEY, plan_topology
from deferred.producer.publishing import prepare
from tests.conftest import wait_for
from tests.testapp.tasks import patient_flaky, read_records, record

pytestmark = pytest.mark.usefixtures("clean")


def labels(path: str) -> list[str]:
    return [r["label"] for r in read_records(path)]


def key() -> str:
    return f"test:{uuid.uuid4().hex[:8]}"


def test_a_thousand_keyed_jobs_over_fifty_keys_run_exactly_the_latest_of_each(
    own_topology, run_worker, records
):
    # Given 20 jobs for each of 50 keys, due 1 to 3 s from now in random order,
    # deferred through defer(), Task.defer(), defer_many() and adefer()
    keys = [key() for _ in range(50)]
    rng = random.Random(7)
    latest: dict[str, str] = {}
    calls = [(k, n) for n in range(20) for k in keys]
    for start in range(0, len(calls), 100):
        chunk = calls[start : start + 100]
        way = (start // 100) % 4
        labelled = [(k, f"{k}/{n}", rng.uniform(1.0, 3.0)) for k, n in chunk]
        if way == 0:
            for k, label, delay in labelled:
                defer(record.using(key=k), delay, records, label)
                latest[k] = label
        elif way == 1:
            for k, label, delay in labelled:
                record.using(key=k).defer(delay, records, label)
                latest[k] = label
        elif way == 2:
            defer_many([(record.using(key=k), d, (records, label)) for k, label, d in labelled])
            latest.update({k: label for k, label, _ in labelled})
        else:

            async def send(batch=labelled) -> None:
                for k, label, delay in batch:
                    await adefer(record.using(key=k), delay, records, label)

            asyncio.run(send())
            latest.update({k: label for k, label, _ in labelled})
    worker = run_worker(concurrency=8)
    # When every job has come due
    assert wait_for(lambda: worker.outcomes["superseded"] + len(labels(records)) >= 1000, 30), (
        worker.outcomes,
        len(labels(records)),
    )
    time.sleep(0.5)
    # Then exactly the latest job of each key ran, once, and the rest were superseded
    assert sorted(labels(records)) == sorted(latest.values())
    assert worker.outcomes["superseded"] == 950
    assert worker.outcomes["failed"] == 0


@pytest.mark.quiet
def test_a_later_job_deferred_just_before_the_older_one_is_due_still_wins(run_worker, records):
    run_worker(concurrency=4)
    in_time: list[str] = []
    for n in range(10):
        k = key()
        older = defer(record.using(key=k), 0.5, records, f"older-{n}")
        due = due_of(older)
        assert due is not None
        # The newer job is deferred 10 ms before the older one is due.
        time.sleep(max(0.0, due.timestamp() - 0.010 - time.time()))
        defer(record.using(key=k), 0.2, records, f"newer-{n}")
        # The promise holds for a defer() that returned before the due time; on
        # a stalled host a few may not, and those older jobs are free to run.
        if time.time() < due.timestamp():
            in_time.append(f"older-{n}")
    assert len(in_time) >= 5, f"only {len(in_time)} of 10 newer jobs were confirmed in time"
    assert wait_for(lambda: sum(x.startswith("newer") for x in labels(records)) == 10, 15)
    time.sleep(0.5)
    ran = labels(records)
    assert not [label for label in ran if label in in_time], ran


def test_the_latest_job_of_a_key_holds_across_a_worker_restart(run_worker, records):
    k = key()
    worker = run_worker()
    assert worker.cancels.connected.wait(5)
    defer(record.using(key=k), 1.5, records, "first")
    worker.stop()
    time.sleep(0.2)
    defer(record.using(key=k), 1.0, records, "second")  # while no worker runs
    second = run_worker()
    assert wait_for(lambda: labels(records) == ["second"], 10)
    assert wait_for(lambda: second.outcomes["superseded"] == 1, 5)
    time.sleep(0.5)
    assert labels(records) == ["second"]
    # And the status counts the key while its latest job can come due
    out = StringIO()
    call_command("deferred_status", "--json", stdout=out)
    status = json.loads(out.getvalue())
    assert status["keys_in_force"] is not None and status["superseded_pending"] is not None


def test_a_retry_of_a_superseded_job_is_dropped(run_worker, records):
    # patient_flaky fails its first attempt and retries 3 s later
    k = key()
    worker = run_worker()
    defer(patient_flaky.using(key=k), 0, records, "older", 1)
    assert wait_for(lambda: worker.outcomes["retrying"] == 1, 10)
    # When a later job of its key is deferred during the backoff
    defer(record.using(key=k), 0.5, records, "newer")
    # Then the newer one runs, and the retry is dropped when it comes due
    assert wait_for(lambda: "newer" in labels(records), 10)
    assert wait_for(lambda: worker.outcomes["superseded"] == 1, 10)
    assert [r["attempt"] for r in read_records(records) if r["label"] == "older"] == [1]


def test_a_forged_keyed_job_in_the_stream_supersedes_nothing(run_worker, records, caplog):
    settings = get_settings()
    assert settings.signing
    k = key()
    worker = run_worker()
    real = defer(record.using(key=k), 1.0, records, "real")
    # A keyed job written into the stream with a signature made with another key
    forged = prepare(record.using(key=k), 0.5, (records, "forged"), {}, settings, due_of(real))
    plan = plan_topology(settings)
    publisher(settings.broker_urls, 5).publish(
        plan.ingest_exchange,
        CANCEL_ROUTING_KEY,
        forged.body,
        message_id=forged.job.id,
        headers=signing.sign(forged.body, ("not the project's key",)),
    )
    # Then the real job runs: the forged record was ignored, and said so
    assert wait_for(lambda: labels(records) == ["real"], 10)
    assert worker.outcomes["superseded"] == 0
    assert any(f"keyed job {forged.job.id}" in m for m in caplog.messages)


def test_jobs_without_a_key_are_never_superseded(own_topology, run_worker, records):
    k = key()
    run_worker()
    defer(record, 0.3, records, "plain")
    defer(record.using(key=k), 0.3, records, "keyed")
    assert wait_for(lambda: sorted(labels(records)) == ["keyed", "plain"], 10)
