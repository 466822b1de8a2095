"""deferred.testing: eager and capture modes. No broker: the broker URL points nowhere."""

from datetime import timedelta

import pytest
from django.test import override_settings

import deferred
from deferred import defer
from deferred.testing import capture, eager
from tests.testapp.tasks import explode, read_records, record, who_am_i

NOWHERE = {"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F", "QUEUES": ["default", "other"]}


@override_settings(DEFERRED=NOWHERE)
def test_capture_records_defers_without_a_broker(tmp_path):
    path = str(tmp_path / "r.jsonl")
    with deferred.testing.capture() as jobs:
        job_id = defer(record, timedelta(minutes=5), path, "later")
        record.using(queue="other").defer(1, path, "other")
    assert jobs[0].id == job_id
    assert [(j.task, j.args, j.queue) for j in jobs] == [
        (record.name, (path, "later"), "default"),
        (record.name, (path, "other"), "other"),
    ]
    assert deferred.testing.delay_of(jobs[0]) == timedelta(minutes=5)
    assert jobs.for_task(record) == list(jobs)
    assert read_records(path) == []  # nothing ran
    jobs.run()  # earliest due first
    assert [r["label"] for r in read_records(path)] == ["other", "later"]


@override_settings(DEFERRED=NOWHERE)
def test_capture_still_validates_like_defer():
    with capture() as jobs:
        with pytest.raises(ValueError):
            defer(record, -1, "p", "l")
        with pytest.raises(TypeError):
            defer(record, 1, object(), "l")
        with pytest.raises(ValueError):
            defer("no.such.task", 1)
    assert jobs == []


@override_settings(DEFERRED=NOWHERE)
def test_eager_runs_at_once_with_current_job(tmp_path):
    path = str(tmp_path / "r.jsonl")
    with eager() as ran:
        job_id = defer(who_am_i, timedelta(days=1), path, "now")
    (row,) = read_records(path)
    assert row["job"] == job_id and row["attempt"] == 1
    assert [j.id for j in ran] == [job_id]
    assert deferred.current_job() is None  # outside a job


@override_settings(DEFERRED=NOWHERE)
def test_eager_propagates_task_errors():
    with eager(), pytest.raises(RuntimeError, match="boom"):
        defer(explode, 0, "boom")


@override_settings(DEFERRED=NOWHERE)
def test_capture_run_also_runs_the_jobs_they_defer(tmp_path):
    from tests.testapp.tasks import chain

    path = str(tmp_path / "r.jsonl")
    with capture() as jobs:
        defer(chain, 0, path, 3)
    jobs.run()  # after the block: the follow-ups are still captured, not published
    assert [r["label"] for r in read_records(path)] == ["3", "2", "1"]
    assert jobs == []


@override_settings(DEFERRED=NOWHERE)
def test_nested_modes_unwind_in_any_order(tmp_path):
    path = str(tmp_path / "r.jsonl")
    with capture() as outer:
        with eager():
            defer(record, 0, path, "eager")
        defer(record, 0, path, "captured")
    assert [j.args[1] for j in outer] == ["captured"]
    assert [r["label"] for r in read_records(path)] == ["eager"]
