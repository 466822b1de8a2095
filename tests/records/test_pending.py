"""A task that has not started, read back from the ledger in any process (deferred.records.pending):
django.tasks' ``get_result()`` answers READY with the task as it was enqueued, from a
process that did not enqueue it, whether the task is due in an hour or at once with no
worker running; against the real broker."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.test import override_settings

from deferred import defer
from deferred.conf import get_settings
from deferred.core.jobs import made_ms_of, new_job_id
from deferred.django_tasks.framework import api as _api
from deferred.django_tasks.framework import exceptions as _exceptions
from deferred.records.pending import find
from tests.conftest import run_python, wait_for
from tests.testapp.framework_tasks import double
from tests.testapp.tasks import record

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
Status = _api.TaskResultStatus

#: A second process, with the same settings and PREFIX, that did not enqueue the task:
#: it prints what get_result() answers, as JSON.
_READER = """
import json, sys, django
django.setup()
from django.tasks import default_task_backend
try:
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:
    from django_tasks.exceptions import TaskResultDoesNotExist
try:
    r = default_task_backend.get_result(sys.argv[1])
except TaskResultDoesNotExist as exc:
    print(json.dumps({"missing": str(exc)}))
else:
    print(json.dumps({
        "status": r.status.name, "args": r.args, "kwargs": r.kwargs,
        "enqueued_at": r.enqueued_at.isoformat(), "started_at": r.started_at,
        "path": r.task.module_path, "queue": r.task.queue_name,
        "priority": r.task.priority,
        "run_after": r.task.run_after.isoformat() if r.task.run_after else None,
        "backend": r.backend, "worker_ids": r.worker_ids,
        "errors": [e.exception_class_path for e in r.errors],
    }, default=str))
"""

try:
    import django.tasks  # noqa: F401
except ImportError:  # Django 5.2: the backport
    _READER = _READER.replace("from django.tasks import", "from django_tasks import")


@pytest.fixture(autouse=True)
def tidy(topology, raw_channel):
    """The jobs these tests leave waiting (due in an hour, or with no worker) are purged
    after each one: later tests count what waits in the topology."""
    yield
    queues = [
        *topology.delay_queues,
        *topology.ready_queues.values(),
        *(topology.hold_queues.values() if topology.hold_levels else ()),
    ]
    for queue in queues:
        raw_channel.queue_purge(queue.name)


def read_elsewhere(result_id: str) -> dict:
    """``get_result(result_id)`` in a new Python process."""
    return json.loads(run_python(_READER, result_id).strip().splitlines()[-1])


def test_a_task_due_in_an_hour_reads_ready_in_another_process(clean):
    """Enqueued with a queue, a priority, a run_after and arguments, and no worker: a
    second process reads READY and the task as it was enqueued."""
    run_after = datetime.now(UTC) + timedelta(hours=1)
    enqueued = double.using(queue_name="other", priority=5, run_after=run_after).enqueue(21)
    seen = read_elsewhere(enqueued.id)
    assert seen["status"] == "READY"
    assert seen["args"] == [21] and seen["kwargs"] == {}
    assert seen["path"] == double.module_path
    assert (seen["queue"], seen["priority"]) == ("other", 5)
    assert seen["run_after"] is not None
    assert abs(datetime.fromisoformat(seen["run_after"]) - run_after) < timedelta(milliseconds=2)
    assert datetime.fromisoformat(seen["enqueued_at"]) == enqueued.enqueued_at
    assert seen["started_at"] is None and seen["errors"] == [] and seen["worker_ids"] == []
    assert seen["backend"] == "default"


def test_a_task_due_now_with_no_worker_reads_ready_in_another_process(clean):
    """Due at once, waiting in its ready queue (no worker runs): READY elsewhere too, and
    no run_after."""
    enqueued = double.enqueue(n=4)
    seen = read_elsewhere(enqueued.id)
    assert seen["status"] == "READY" and seen["kwargs"] == {"n": 4}
    assert seen["run_after"] is None and seen["queue"] == "default"


def test_once_a_worker_ran_it_the_results_answer(clean, run_worker):
    enqueued = double.enqueue(5)
    assert read_elsewhere(enqueued.id)["status"] == "READY"
    run_worker()
    wait_for(lambda: read_elsewhere(enqueued.id).get("status") == "SUCCESSFUL", timeout=20)


def test_a_task_enqueued_in_a_transaction_is_found_once_committed(clean):
    """Published at the commit, after the moment its id says it was made: the read goes
    on past that moment to find it. Before the commit nothing was published."""
    with transaction.atomic():
        enqueued = double.enqueue(7)
        time.sleep(0.6)  # the commit comes well after the job was made
        assert "missing" in read_elsewhere(enqueued.id)
    assert read_elsewhere(enqueued.id)["status"] == "READY"


def test_an_unknown_id_is_still_missing(clean):
    unknown = new_job_id(datetime.now(UTC) + timedelta(minutes=5))
    seen = read_elsewhere(unknown)
    assert "No task enqueued" in seen["missing"]


def test_a_plain_defer_is_no_task_of_the_backend(clean):
    job_id = defer(record, 3600, "/dev/null", "x")
    seen = read_elsewhere(job_id)
    assert "is not a task of TASKS['default']" in seen["missing"]
    # ... though the ledger has it, as published.
    found = find(get_settings(), job_id)
    assert found.complete and found.job is not None
    assert (found.job.task, found.job.args) == ("tests.testapp.tasks.record", ("/dev/null", "x"))


def test_find_returns_the_job_as_published(clean):
    job_id = defer(record, 0.5, "/dev/null", "y")
    found = find(get_settings(), job_id)
    assert found.job is not None and found.job.id == job_id and found.job.queue == "default"
    assert find(get_settings(), new_job_id()).job is None


def test_without_a_ledger_a_task_enqueued_elsewhere_is_missing(clean):
    """``LEDGER = False``: nothing to read a task that has not started from, in a process
    that did not enqueue it (this one, with its memory of what it enqueued cleared)."""
    from django.conf import settings

    from deferred.django_tasks import backend as backends

    enqueued = double.using(run_after=datetime.now(UTC) + timedelta(hours=1)).enqueue(1)
    backends._enqueued.clear()
    backend = _api.task_backends["default"]
    assert backend.get_result(enqueued.id).status == Status.READY  # from the ledger
    with override_settings(DEFERRED={**settings.DEFERRED, "LEDGER": False}):
        with pytest.raises(_exceptions.TaskResultDoesNotExist, match="No task enqueued"):
            backend.get_result(enqueued.id)


def test_get_result_reads_the_ledger_only_for_what_the_results_do_not_have(clean, run_worker):
    """A failed task's result comes from the results stream (errors, started_at), not the
    ledger's READY record."""
    from tests.testapp.framework_tasks import fails_with

    enqueued = fails_with.enqueue("value", "no")
    run_worker()
    wait_for(lambda: read_elsewhere(enqueued.id).get("status") == "FAILED", timeout=20)
    seen = read_elsewhere(enqueued.id)
    assert seen["started_at"] is not None and len(seen["errors"]) == 1


# ------------------------------------------------------------------ the id's delay


@pytest.mark.parametrize(
    "wait",
    [
        timedelta(0),
        timedelta(milliseconds=1),
        timedelta(milliseconds=999),
        timedelta(seconds=3),
        timedelta(hours=1),
        timedelta(days=365),
        timedelta(days=365 * 30),
    ],
)
def test_an_id_says_when_its_job_was_made(wait):
    made = datetime(2026, 11, 28, 12, 0, 0, 123456, tzinfo=UTC)
    job_id = new_job_id(made + wait, now=made)
    lo, hi = made_ms_of(job_id)
    made_ms = int(made.timestamp() * 1000)
    assert lo <= made_ms <= hi
    # Narrow: a few ms under a second, 0.0043 % of the delay beyond.
    assert hi - lo <= max(5, wait.total_seconds() * 1000 * 0.000043 + 2)


def test_a_version_7_id_does_not_say():
    from deferred.core.jobs import id_with_due

    assert made_ms_of(id_with_due(datetime.now(UTC), b"seed")) is None
    assert made_ms_of("0" * 12 + "7" + "0" * 3 + "8" + "0" * 15) is None
    assert made_ms_of("not an id") is None


def test_no_ready_from_the_ledger_without_results_or_past_their_retention(clean, monkeypatch):
    """The ledger keeps a job 7 days, the results RESULT_TTL (a day): a task with no
    record in the results has not started only while the results would have one, and
    only if workers write results at all. Otherwise the ledger's copy proves nothing:
    the task may have run, and must not read READY again."""
    from django.conf import settings

    from deferred.django_tasks import backend as backends

    enqueued = double.enqueue(2)
    backends._enqueued.clear()
    backend = _api.task_backends["default"]
    assert backend.get_result(enqueued.id).status == Status.READY
    with override_settings(DEFERRED={**settings.DEFERRED, "RESULTS": False}):
        with pytest.raises(_exceptions.TaskResultDoesNotExist):
            backend.get_result(enqueued.id)
    later = datetime.now(UTC) + timedelta(milliseconds=get_settings().result_ttl_ms + 60_000)
    monkeypatch.setattr(backends, "utcnow", lambda: later)
    with pytest.raises(_exceptions.TaskResultDoesNotExist, match="No task enqueued"):
        backend.get_result(enqueued.id)
