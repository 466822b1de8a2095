"""The job envelope (pure)."""

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from deferred.core.jobs import FORMAT_VERSION, BrokenMessage, Job

DUE = datetime(2026, 1, 1, tzinfo=UTC)


def job(**kw):
    return Job(id="abc", task="t", args=(1, "x"), kwargs={"k": [1]}, due=DUE, queue="default", **kw)


def test_round_trip():
    original = job()
    body = original.encode()
    data = json.loads(body)
    assert data["version"] == FORMAT_VERSION
    assert set(data) >= {"version", "id", "task", "args", "kwargs", "due", "attempt"}
    assert data["attempt"] == 1
    assert Job.decode(body) == original


@pytest.mark.parametrize("bad", [object(), {1, 2}, float("nan"), b"bytes"])
def test_arguments_must_be_json(bad):
    with pytest.raises(TypeError, match="JSON"):
        Job(id="a", task="t", args=(bad,), kwargs={}, due=DUE, queue="default").encode()


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe",
        b"not json",
        b"[]",
        b'{"version": 99}',
        b'{"version": 1}',
        json.dumps(
            {
                **json.loads(
                    Job(id="a", task="t", args=(), kwargs={}, due=DUE, queue="q").encode()
                ),
                "attempt": "1",
            }
        ).encode(),
        json.dumps(
            {
                **json.loads(
                    Job(id="a", task="t", args=(), kwargs={}, due=DUE, queue="q").encode()
                ),
                "due": "2026-01-01T00:00",
            }
        ).encode(),
    ],
)
def test_broken_bodies(body):
    with pytest.raises(BrokenMessage):
        Job.decode(body)


def test_django_tasks_fields_round_trip_and_stay_out_of_plain_jobs():
    now = datetime.now(UTC)
    plain = Job(id="a" * 32, task="t", args=(), kwargs={}, due=now, queue="default")
    assert "backend" not in plain.to_dict() and "workers" not in plain.to_dict()
    framework = replace(plain, backend="default").next_attempt(now, worker="host:1")
    decoded = Job.decode(framework.encode())
    assert decoded.backend == "default"
    assert decoded.workers == ("host:1",)
    assert decoded.attempt == 2
    broken = framework.to_dict() | {"workers": [1]}
    with pytest.raises(BrokenMessage, match="workers"):
        Job.decode(json.dumps(broken).encode())


@pytest.mark.parametrize(
    ("failed_at", "expected"),
    [
        ("2026-11-25T14:03:09.123456+00:00", datetime(2026, 11, 25, 14, 3, 9, 123456, tzinfo=UTC)),
        ("2026-11-25T14:03:09", datetime(2026, 11, 25, 14, 3, 9, tzinfo=UTC)),  # naive: UTC
        ("yesterday", None),
        (None, None),
    ],
)
def test_failed_at_time_reads_the_record_or_gives_none(failed_at, expected) -> None:
    from deferred.records.failures import FailedJob

    entry = FailedJob("id", "t", "task_error", 1, None, None, None, failed_at, None)
    assert entry.failed_at_time == expected
