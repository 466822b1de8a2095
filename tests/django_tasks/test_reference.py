"""Django's task framework, checked with its own test suites: the checks of Django's
``tests/tasks/`` and of the django-tasks family (django-tasks, django-tasks-db,
django-tasks-rq) that apply to any real queueing backend, ported to this backend and run
against the real broker and a real worker. Each test names the reference it ports;
where this backend answers differently on purpose, the test says so and why.

"DB" is django-tasks-db's ``tests/tests.py`` (``DatabaseBackendTestCase``,
``DatabaseBackendWorkerTestCase``, ``DatabaseWorkerProcessTestCase``,
``DBTaskResultOrderingTestCase``), "RQ" django-tasks-rq's ``tests/tests.py``
(``RQBackendTestCase``); both were django-tasks' ``tests/tests/test_database_backend.py``
and ``test_rq_backend.py`` before they moved. "django-tasks" is django-tasks'
``tests/tests/``, whose generic suites are Django's ``tests/tasks/`` under other names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import time
from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest
from django.conf import settings
from django.core import checks
from django.db import transaction
from django.http import Http404, JsonResponse
from django.test import override_settings
from django.urls import path, reverse
from django.utils import timezone

from deferred.backends import InvalidTask, InvalidTaskBackend, RabbitMQBackend
from deferred.conf import get_settings
from deferred.core.jobs import Job, new_job_id
from deferred.django_tasks import backend as deferred_backends
from deferred.django_tasks.framework import api as _api
from deferred.django_tasks.framework import exceptions as _exceptions
from deferred.django_tasks.framework import signals
from deferred.producer.publishing import publish
from deferred.records.failures import list_failed
from tests.conftest import depth, run_python, total_waiting, wait_for
from tests.testapp.framework_tasks import (
    attempt_is,
    blocks_until,
    complex_exception,
    double,
    echo,
    exits,
    fails_with,
    interrupts,
    meaning_of_life,
    noop,
    noop_async,
    note,
    note_async,
    own_id,
    returns_a_lambda,
    sleep_for,
)

pytestmark = pytest.mark.django_db(transaction=True)

TaskResultDoesNotExist = _exceptions.TaskResultDoesNotExist
TaskResultMismatch = _exceptions.TaskResultMismatch
Status = _api.TaskResultStatus
#: The framework's logger: "django.tasks" (Django 6), "django_tasks" (the backport).
TASKS_LOGGER = signals.logger.name
BACKEND = "deferred.backends.RabbitMQBackend"


def backend():
    return _api.task_backends["default"]


def finished(result) -> bool:
    result.refresh()
    return result.status in (Status.SUCCESSFUL, Status.FAILED)


def status_of(result_id: str):
    """The status ``get_result()`` reads now, leaving any ``TaskResult`` untouched."""
    return backend().get_result(result_id).status


def lines(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]


def forget_enqueued_here() -> None:
    """Forget what this process enqueued, as another process (a web process that did not
    enqueue the task) knows nothing of it."""
    deferred_backends._enqueued.clear()


@pytest.fixture
def drained(clean, raw_channel):
    """``clean``, and emptied again at the end: for tests that leave due jobs no worker
    ran, so that no later test's worker runs them."""
    yield clean
    for queue in (*clean.ready_queues.values(), clean.failed_queue):
        raw_channel.queue_purge(queue.name)


class Received:
    """What the receivers of one of the framework's signals got: (sender, task_result)."""

    def __init__(self, which) -> None:
        self.signal = which
        self.calls: list[tuple[type, object]] = []
        #: The result's fields as they were when the signal was sent (a backend may go on
        #: updating the same object, as the framework's ImmediateBackend does).
        self.seen: list[dict] = []

    def __call__(self, sender, task_result, **kwargs) -> None:
        self.calls.append((sender, task_result))
        self.seen.append(
            {
                "status": task_result.status,
                "started_at": task_result.started_at,
                "finished_at": task_result.finished_at,
                "worker_ids": list(task_result.worker_ids),
                "attempts": task_result.attempts,
            }
        )

    def __enter__(self) -> Received:
        self.signal.connect(self, weak=False, dispatch_uid=id(self))
        return self

    def __exit__(self, *exc) -> None:
        self.signal.disconnect(dispatch_uid=id(self))


def tasks_log(caplog, *needles: str) -> list[logging.LogRecord]:
    """The framework's log records (its signal receivers'), those naming every needle."""
    return [
        r
        for r in caplog.records
        if r.name == TASKS_LOGGER and all(n in r.getMessage() for n in needles)
    ]


# ---------------------------------------------------------------------- configuration


def test_using_correct_backend():
    """Django tests/tasks/test_immediate_backend.py and test_dummy_backend.py, DB and RQ
    ``test_using_correct_backend``, and Django tests/tasks/test_tasks.py
    ``test_get_backend``: the default backend is ours, alias "default", no options; a task
    names it and finds it."""
    found = _api.task_backends["default"]
    assert _api.default_task_backend.alias == "default"  # a proxy to it
    assert isinstance(found, RabbitMQBackend)
    assert found.alias == "default" and found.options == {}
    assert noop.backend == "default" and noop.get_backend() is found


def test_check():
    """Django tests/tasks/test_dummy_backend.py and django-tasks-db/-rq ``test_check``:
    a well configured backend has no system check errors."""
    assert list(_api.task_backends["default"].check()) == []


def test_uses_deferred_queues_for_queue_names():
    """RQ ``test_uses_rq_queues_for_queue_names``: with no ``QUEUES`` of its own, the
    backend's queue names are the broker's, here ``DEFERRED['QUEUES']`` (and the
    framework's default name, "default", which this backend always accepts: documented in
    docs/howto/django-tasks.md)."""
    with override_settings(TASKS={"default": {"BACKEND": BACKEND}}):
        assert backend().queues == {"default", "other"}
    with override_settings(
        DEFERRED={**settings.DEFERRED, "QUEUES": ["other"]}, TASKS={"default": {"BACKEND": BACKEND}}
    ):
        assert backend().queues == {"other", "default"}


def test_unknown_queue_name_fails_the_backend_check():
    """RQ ``test_unknown_queue_name``: a backend ``QUEUES`` entry the broker has no queue
    for is a check error whose hint says where to add it (ours: ``DEFERRED['QUEUES']``,
    check ``deferred.E010``)."""
    with override_settings(
        TASKS={"default": {"BACKEND": BACKEND, "QUEUES": ["default", "queue-2"]}}
    ):
        (error,) = backend().check()
    assert error.id == "deferred.E010" and error.level == checks.ERROR
    assert "queue-2" in error.msg and "DEFERRED" in error.hint


def test_unknown_queue_name_fails_manage_py_check():
    """RQ ``test_unknown_queue_name``, in the form docs/howto/django-tasks.md promises: "A
    backend ``QUEUES`` entry that is not a DEFERRED queue is reported by ``manage.py
    check`` (``deferred.E010``)". The system checks, as ``manage.py check`` runs them."""
    with override_settings(
        TASKS={"default": {"BACKEND": BACKEND, "QUEUES": ["default", "queue-2"]}}
    ):
        found = [m for m in checks.run_checks() if m.id == "deferred.E010"]
    assert len(found) == 1, "manage.py check does not report deferred.E010"
    assert "queue-2" in found[0].msg


def test_backend_app_missing():
    """DB ``test_database_backend_app_missing`` and RQ ``test_rq_app_missing``: without
    its app in ``INSTALLED_APPS`` (ours: "deferred", which docs/quickstart.md requires:
    the worker command and the topology checks are the app's), the backend's check says
    so, its hint naming the app."""
    with override_settings(INSTALLED_APPS=["django.contrib.contenttypes"]):
        errors = list(backend().check())
    assert len(errors) == 1, errors
    assert "deferred" in (errors[0].hint or "")


def test_bad_options_refuse_the_backend_before_anything_is_enqueued(clean, raw_channel):
    """DB ``test_unknown_id_function`` (a bad ``OPTIONS`` value fails the first enqueue,
    loudly). Ours has no ``id_function``; its ``OPTIONS`` are ``ON_COMMIT``,
    ``MAX_RETRIES``, ``RETRY_BACKOFF`` and ``TIME_LIMIT``, and a bad one raises the
    framework's ``InvalidTaskBackend`` when the backend is first used (documented in
    docs/howto/django-tasks.md), with nothing published."""
    for options in ({"id_function": "missing.function"}, {"MAX_RETRIES": "x"}):
        with override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": options}}):
            with pytest.raises(InvalidTaskBackend, match=next(iter(options))):
                noop.enqueue()
    time.sleep(0.1)
    assert total_waiting(raw_channel, clean) == 0


# ---------------------------------------------------------------------- validation


def test_enqueue_with_invalid_argument():
    """Django tests/tasks/test_tasks.py ``test_enqueue_with_invalid_argument`` and
    ``test_aenqueue_with_invalid_argument``: an argument JSON cannot carry (a datetime)
    raises ``TypeError`` at enqueue. (The message is ours: it names the task.)"""
    with pytest.raises(TypeError):
        double.enqueue(datetime.now(UTC))
    with pytest.raises(TypeError):
        asyncio.run(double.aenqueue(datetime.now(UTC)))


def test_json_normalize_round_trip(clean, run_worker):
    """Django tests/tasks/test_utils.py ``JSONNormalizeTestCase.test_round_trip`` and
    ``test_encode_error``, through the backend: tuples read back as lists, in the result's
    arguments at once and in the return value the worker recorded; what JSON cannot carry
    (an object, a function, a datetime) is refused at enqueue."""
    result = echo.enqueue((), foo=())
    assert result.args == [[]] and result.kwargs == {"foo": []}
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(result), 15), result.status
    assert result.status == Status.SUCCESSFUL
    assert result.return_value == {"args": [[]], "kwargs": {"foo": []}}
    for example in (object(), any, datetime.now(UTC)):
        with pytest.raises(TypeError):
            echo.enqueue(example)
        with pytest.raises(TypeError):
            echo.enqueue(value={"nested": [example]})


def test_arguments_reach_the_task_as_the_framework_normalises_them(clean, run_worker):
    """Django tests/tasks/test_utils.py ``test_round_trip`` (bytes as text) and the
    database backend's JSON arguments: the task receives what the framework's
    ``TaskResult`` holds, UTF-8 bytes as text, a tuple as a list and, through JSON, a dict
    key that is not a string as a string (documented in docs/howto/django-tasks.md)."""
    result = echo.enqueue(b"caf\xc3\xa9", (1, 2), mapping={1: "a"})
    assert result.args == ["café", [1, 2]] and result.kwargs == {"mapping": {1: "a"}}
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(result), 15), result.status
    assert result.return_value == {"args": ["café", [1, 2]], "kwargs": {"mapping": {"1": "a"}}}
    with pytest.raises(TypeError):
        echo.enqueue(b"\xff")  # bytes that are not UTF-8 text


def test_naive_datetime():
    """Django tests/tasks/test_tasks.py ``test_naive_datetime``: a naive ``run_after`` is
    refused with the framework's message."""
    with pytest.raises(InvalidTask, match="run_after must be an aware datetime"):
        double.using(run_after=datetime.now())


@pytest.mark.parametrize("priority", [-101, 101, 3.1])
def test_invalid_priority(priority):
    """Django tests/tasks/test_tasks.py ``test_invalid_priority``: outside -100..100, or
    not a whole number, is refused."""
    with pytest.raises(InvalidTask):
        double.using(priority=priority)


@pytest.mark.parametrize("priority", [-100, 0, 100])
def test_valid_priorities(priority):
    """Django tests/tasks/test_tasks.py ``test_invalid_priority`` (its accepted values)
    and ``test_using_priority``."""
    assert double.using(priority=priority).priority == priority
    assert double.priority == 0


def test_using():
    """Django tests/tasks/test_tasks.py ``test_using_queue_name``,
    ``test_using_run_after``, ``test_chained_using`` and
    ``test_using_creates_new_instance``: ``using()`` goes through this backend's
    validation and makes a new task, the original untouched."""
    now = timezone.now()
    assert noop.queue_name == _api.DEFAULT_TASK_QUEUE_NAME
    assert noop.using(queue_name="other").queue_name == "other"
    assert noop.queue_name == _api.DEFAULT_TASK_QUEUE_NAME
    assert noop.run_after is None
    run_after = noop.using(run_after=now)
    assert run_after.run_after == now and noop.run_after is None
    chained = run_after.using(priority=10)
    assert chained.priority == 10 and chained.run_after == now
    assert run_after.priority == 0
    again = noop.using()
    assert again == noop and again is not noop


def test_unknown_queue_name():
    """Django tests/tasks/test_tasks.py ``test_unknown_queue_name``: a queue the backend
    does not have is refused. (Our message says where the valid ones come from.)"""
    with pytest.raises(InvalidTask, match="queue-2"):
        double.using(queue_name="queue-2")


def test_validate_on_enqueue(clean, raw_channel):
    """Django tests/tasks/test_dummy_backend.py and test_immediate_backend.py, DB and RQ
    ``test_validate_on_enqueue`` and ``test_validate_on_aenqueue``: a task made while its
    queue was valid is checked again at enqueue, against the backend as configured then,
    and refused with the framework's message; nothing is published."""
    task = noop.using(queue_name="other")  # valid under the default TASKS
    with override_settings(TASKS={"default": {"BACKEND": BACKEND, "QUEUES": ["default"]}}):
        with pytest.raises(InvalidTask, match="Queue 'other' is not valid for backend"):
            task.enqueue()
        with pytest.raises(InvalidTask, match="Queue 'other' is not valid for backend"):
            asyncio.run(task.aenqueue())
    time.sleep(0.1)
    assert total_waiting(raw_channel, clean) == 0


def test_invalid_function():
    """Django tests/tasks/test_tasks.py and django-tasks ``test_invalid_function``: a
    function that is not defined at a module level (a builtin, a nested function) is
    refused when decorated."""

    def nested():
        return None

    for invalid_function in (any, nested):
        with pytest.raises(InvalidTask, match="Task function must be defined at a module level"):
            _api.task()(invalid_function)


def test_takes_context_without_taking_context():
    """Django tests/tasks/test_tasks.py and django-tasks
    ``test_takes_context_without_taking_context``."""
    with pytest.raises(
        InvalidTask, match="Task takes context but does not have a first argument of 'context'"
    ):
        _api.task(takes_context=True)(meaning_of_life.func)


def test_validate_disallowed_async_task():
    """Django tests/tasks/test_dummy_backend.py ``test_validate_disallowed_async_task`` and
    test_custom_backend.py ``test_enqueue_async_task_on_non_async_backend``: our
    validation leaves the framework's async check in force (a backend that said it could
    not run async tasks would refuse them); ours can, so they pass."""
    backend().validate_task(noop_async)
    with mock.patch.object(RabbitMQBackend, "supports_async_task", False):
        with pytest.raises(InvalidTask, match=r"(?i)does not support async tasks"):
            backend().validate_task(noop_async)


# ---------------------------------------------------------------------- enqueue


def assert_just_enqueued(result, task, args, kwargs) -> None:
    """The result of a task just enqueued, as the reference suites check it."""
    assert isinstance(result.id, str) and 0 < len(result.id) <= 64  # the framework's bound
    assert result.status == Status.READY
    assert result.is_finished is False
    assert result.enqueued_at is not None and result.enqueued_at <= timezone.now()
    assert result.started_at is None
    assert result.last_attempted_at is None
    assert result.finished_at is None
    with pytest.raises(ValueError, match="Task has not finished yet"):
        result.return_value  # noqa: B018 - the framework raises until it finished
    assert result.task == task
    assert result.args == args and result.kwargs == kwargs
    assert result.backend == "default"
    assert result.errors == [] and result.worker_ids == []
    assert result.attempts == 0


def test_enqueue_task(drained):
    """Django tests/tasks/test_dummy_backend.py ``test_enqueue_task``, ``test_errors`` and
    ``test_takes_context``, Django tests/tasks/test_tasks.py ``test_enqueue_task``, DB
    and RQ ``test_enqueue_task``: right after enqueue, sync and async task functions alike,
    the result is READY with every field as the framework has it, and ``task_enqueued``
    was sent once, by the backend class, with that result. (DB checks its ids are UUID4s;
    ours are the job ids, 32 hex digits: two enqueues, two ids.)"""
    ids = set()
    for task in (noop, noop_async):
        with Received(signals.task_enqueued) as received:
            result = task.enqueue(1, two=3)
        assert_just_enqueued(result, task, [1], {"two": 3})
        assert received.calls == [(RabbitMQBackend, result)]
        assert received.calls[0][1] is result
        ids.add(result.id)
    assert len(ids) == 2
    # A task that takes the context is READY too: the context is the worker's to pass.
    assert own_id.enqueue().status == Status.READY


def test_enqueue_task_async(drained):
    """Django tests/tasks/test_dummy_backend.py ``test_enqueue_task_async``, Django
    tests/tasks/test_tasks.py ``test_enqueue_task_async``, DB and RQ
    ``test_enqueue_task_async``: ``aenqueue()`` gives the same READY result and sends
    ``task_enqueued`` the same way."""

    async def enqueue_both():
        out = []
        for task in (noop, noop_async):
            with Received(signals.task_enqueued) as received:
                result = await task.aenqueue()
            out.append((task, result, received.calls))
        return out

    for task, result, calls in asyncio.run(enqueue_both()):
        assert_just_enqueued(result, task, [], {})
        assert calls == [(RabbitMQBackend, result)]


# ---------------------------------------------------------------------- results


def test_get_result(drained):
    """Django tests/tasks/test_tasks.py and test_dummy_backend.py ``test_get_result`` and
    ``test_get_result_async``, DB and RQ ``test_get_result`` and ``test_get_result_async``,
    in the process that enqueued: the result read back equals the one enqueue gave, by
    the backend and by the task."""
    result = backend().enqueue(noop, (), {})
    assert backend().get_result(result.id) == result
    assert noop.get_result(result.id) == result
    result_async = asyncio.run(backend().aenqueue(noop, (), {}))
    assert asyncio.run(backend().aget_result(result_async.id)) == result_async
    assert asyncio.run(noop.aget_result(result_async.id)) == result_async
    # And read back from the broker (the ledger), not from this process's memory.
    forget_enqueued_here()
    assert backend().get_result(result.id) == result
    assert asyncio.run(noop.aget_result(result_async.id)) == result_async


READ_IN_ANOTHER_PROCESS = r"""
import asyncio, json, sys

import django

django.setup()
from deferred.django_tasks.framework import api as _api

backend = _api.task_backends["default"]


def described(read):
    try:
        r = read()
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    stamp = lambda moment: moment.isoformat() if moment else None
    return {
        "id": r.id,
        "status": str(r.status),
        "is_finished": r.is_finished,
        "task": r.task.module_path,
        "queue_name": r.task.queue_name,
        "priority": r.task.priority,
        "run_after": stamp(r.task.run_after),
        "enqueued_at": stamp(r.enqueued_at),
        "started_at": stamp(r.started_at),
        "last_attempted_at": stamp(r.last_attempted_at),
        "finished_at": stamp(r.finished_at),
        "args": r.args,
        "kwargs": r.kwargs,
        "backend": r.backend,
        "errors": len(r.errors),
        "worker_ids": r.worker_ids,
        "attempts": r.attempts,
    }


out = {}
for result_id in sys.argv[1:]:
    out[result_id] = {
        "sync": described(lambda: backend.get_result(result_id)),
        "async": described(lambda: asyncio.run(backend.aget_result(result_id))),
    }
print(json.dumps(out))
"""


def read_in_another_process(*result_ids: str) -> dict:
    """``get_result()`` and ``aget_result()`` of each id, in a new Python process (with
    the current PREFIX), as JSON."""
    return json.loads(run_python(READ_IN_ANOTHER_PROCESS, *result_ids).splitlines()[-1])


def test_get_result_in_another_process(own_topology):
    """DB and RQ ``test_get_result`` and ``test_get_result_async`` (a result is read back
    from the store, in any process), DB ``test_run_after`` (a task due later is READY
    until then) and DB ``test_run_after_tz`` (a task enqueued with no ``run_after`` reads
    back with none): a task no worker has started, one due now and one due in an hour,
    read by ``get_result()`` and ``aget_result()`` in another process, is READY with the
    fields enqueue gave (docs/howto/django-tasks.md: ``result.task``, read in any
    process, is the task as it was enqueued; its ``run_after`` to the millisecond, as our
    records keep it)."""
    now_result = echo.using(queue_name="other", priority=7).enqueue(1, two=[3])
    run_after = timezone.now() + timedelta(hours=1)
    later_result = noop.using(run_after=run_after).enqueue()
    read = read_in_another_process(now_result.id, later_result.id)
    for result in (now_result, later_result):
        for how in ("sync", "async"):
            fresh = read[result.id][how]
            assert "raised" not in fresh, (how, fresh)
            assert fresh["status"] == "READY" and fresh["is_finished"] is False
            assert fresh["id"] == result.id and fresh["backend"] == "default"
            assert fresh["task"] == result.task.module_path
            assert fresh["queue_name"] == result.task.queue_name
            assert fresh["priority"] == result.task.priority
            assert fresh["args"] == result.args and fresh["kwargs"] == result.kwargs
            assert fresh["enqueued_at"] == result.enqueued_at.isoformat()
            for unset in ("started_at", "last_attempted_at", "finished_at"):
                assert fresh[unset] is None, (unset, fresh)
            assert fresh["errors"] == 0 and fresh["worker_ids"] == [] and fresh["attempts"] == 0
    assert read[now_result.id]["sync"]["run_after"] is None
    # To the millisecond: our job ids and records keep run_after in whole milliseconds.
    read_back = datetime.fromisoformat(read[later_result.id]["sync"]["run_after"])
    assert abs(read_back - run_after) < timedelta(milliseconds=1), (read_back, run_after)


def test_refresh_result_without_change(drained):
    """Django tests/tasks/test_tasks.py and django-tasks ``test_refresh_result``: with no
    worker, ``refresh()`` and ``arefresh()`` change nothing."""
    result = asyncio.run(noop.aenqueue())
    original = dataclasses.asdict(result)
    forget_enqueued_here()  # read back from the broker (the ledger), not from memory
    result.refresh()
    assert dataclasses.asdict(result) == original
    asyncio.run(result.arefresh())
    assert dataclasses.asdict(result) == original


@pytest.mark.parametrize("how", ["sync", "async"])
def test_refresh_result(clean, run_worker, how):
    """DB and RQ ``test_refresh_result`` and ``test_refresh_result_async``, DB
    ``test_run_enqueued_task``, Django tests/tasks/test_immediate_backend.py
    ``test_result`` and ``test_result_async``, and Django tests/tasks/test_dummy_backend.py
    ``test_refresh_result`` and ``test_refresh_result_async`` (with a real worker instead
    of an edited store): the worker
    runs the task; the result in hand stays READY until ``refresh()`` (``arefresh()``)
    reads it SUCCESSFUL, with its times, its return value and one attempt."""
    if how == "sync":
        result = backend().enqueue(meaning_of_life, [], {})
    else:
        result = asyncio.run(backend().aenqueue(meaning_of_life, [], {}))
    worker = run_worker(concurrency=1)
    assert wait_for(lambda: status_of(result.id) == Status.SUCCESSFUL, 15)

    assert result.status == Status.READY and not result.is_finished
    assert result.started_at is None and result.last_attempted_at is None
    assert result.finished_at is None and result.attempts == 0

    if how == "sync":
        result.refresh()
    else:
        asyncio.run(result.arefresh())

    assert result.status == Status.SUCCESSFUL and result.is_finished
    assert result.started_at is not None and result.last_attempted_at is not None
    assert result.finished_at is not None
    assert result.started_at >= result.enqueued_at
    assert result.finished_at >= result.started_at
    assert result.return_value == 42
    assert result.attempts == 1 and result.worker_ids == [worker.worker_id]
    assert result.errors == []


def test_get_missing_result():
    """Django tests/tasks/test_tasks.py and test_dummy_backend.py, DB and RQ
    ``test_get_missing_result`` and ``test_async_get_missing_result`` (an id of the right
    shape that names nothing), and DB/RQ ``test_invalid_uuid`` and
    ``test_async_invalid_uuid`` (an id that is none): both raise
    ``TaskResultDoesNotExist``."""
    for result_id in ("123", new_job_id()):
        with pytest.raises(TaskResultDoesNotExist):
            backend().get_result(result_id)
        with pytest.raises(TaskResultDoesNotExist):
            asyncio.run(backend().aget_result(result_id))
        with pytest.raises(TaskResultDoesNotExist):
            noop.get_result(result_id)


def test_get_incorrect_result(drained):
    """Django tests/tasks/test_tasks.py ``test_get_incorrect_result`` and
    ``test_get_incorrect_result_async``: the result of one task, asked of another,
    raises ``TaskResultMismatch``."""
    result = note_async.enqueue("/dev/null", "x")
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        double.get_result(result.id)
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        asyncio.run(double.aget_result(result.id))


# Views for the django-tasks test project's checks (its tests/views.py, in our words).


def _result_response(result) -> JsonResponse:
    if result.status == Status.SUCCESSFUL:
        value = result.return_value
    elif result.status == Status.FAILED:
        value = result.errors[0].traceback
    else:
        value = None
    return JsonResponse({"result_id": result.id, "result": value, "status": result.status})


def meaning_of_life_view(request):
    return _result_response(meaning_of_life.enqueue())


async def meaning_of_life_view_async(request):
    return _result_response(await meaning_of_life.aenqueue())


async def result_view(request, result_id):
    try:
        result = await _api.default_task_backend.aget_result(result_id)
    except TaskResultDoesNotExist:
        raise Http404 from None
    return _result_response(result)


urlpatterns = [
    path("meaning-of-life/", meaning_of_life_view, name="meaning-of-life"),
    path("meaning-of-life-async/", meaning_of_life_view_async, name="meaning-of-life-async"),
    path("result/<str:result_id>", result_view, name="result"),
]


@override_settings(ROOT_URLCONF=__name__)
def test_meaning_of_life_view(drained, client):
    """django-tasks tests/tests/test_dummy_backend.py ``test_meaning_of_life_view`` (and
    the DB and RQ tests of the same name, before they moved): a view enqueues, sync or
    async, and answers READY; ``get_result()`` of its id reads READY."""
    for url in (reverse("meaning-of-life"), reverse("meaning-of-life-async")):
        response = client.get(url)
        assert response.status_code == 200
        data = json.loads(response.content)
        assert data["result"] is None and data["status"] == Status.READY
        forget_enqueued_here()  # as the broker has it, not this process's memory
        assert backend().get_result(data["result_id"]).status == Status.READY


@override_settings(ROOT_URLCONF=__name__)
def test_get_result_from_different_request(drained, client):
    """django-tasks tests/tests/test_dummy_backend.py
    ``test_get_result_from_different_request`` (and the DB and RQ tests of the same name,
    before they moved): the result view reads the task another request enqueued, READY.
    The second request is served as by another web process, which did not enqueue it."""
    response = client.get(reverse("meaning-of-life"))
    assert response.status_code == 200
    result_id = json.loads(response.content)["result_id"]
    forget_enqueued_here()
    response = client.get(reverse("result", args=[result_id]))
    assert response.status_code == 200, "the result view found no result (404)"
    assert json.loads(response.content) == {
        "result_id": result_id,
        "result": None,
        "status": Status.READY,
    }


# ---------------------------------------------------------------------- running


def test_takes_context(clean, run_worker):
    """Django tests/tasks/test_immediate_backend.py, DB and RQ ``test_takes_context``: a
    task that takes the context sees its own result id."""
    result = own_id.enqueue()
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(result), 15), result.status
    assert result.status == Status.SUCCESSFUL and result.return_value == result.id


def test_context(clean, run_worker):
    """Django tests/tasks/test_immediate_backend.py, DB and RQ ``test_context``: the
    context is a ``TaskContext`` whose ``attempt`` is 1 on the first run. (The same task
    told to expect attempt 2 fails, so the check inside it does check.)"""
    first = attempt_is.enqueue(1)
    wrong = attempt_is.enqueue(2)
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(first) and finished(wrong), 15)
    assert first.status == Status.SUCCESSFUL
    assert wrong.status == Status.FAILED
    assert wrong.errors[0].exception_class is AssertionError


@pytest.mark.parametrize(
    "kind, exception", [("value", ValueError), ("exit", SystemExit)], ids=["value", "exit"]
)
def test_catches_exception(clean, run_worker, kind, exception):
    """Django tests/tasks/test_immediate_backend.py, RQ ``test_catches_exception``, DB
    ``test_failing_task`` and ``test_system_exit_task``: a task that raises
    (``ValueError``, or ``SystemExit``) is FAILED, with its exception class and a
    traceback ending with the error; its ``return_value`` raises; the worker goes on."""
    with override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": {"MAX_RETRIES": 0}}}):
        result = fails_with.enqueue(kind, "This task failed due to x")
        run_worker(concurrency=1)
        assert wait_for(lambda: finished(result), 15), result.status
        after = double.enqueue(1)
        assert wait_for(lambda: finished(after), 15), after.status
    assert result.status == Status.FAILED and result.is_finished
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018 - the framework raises for a failed task
    assert result.enqueued_at <= result.started_at
    assert result.started_at <= result.last_attempted_at <= result.finished_at
    (error,) = result.errors
    assert error.exception_class is exception
    assert error.traceback.endswith(f"{exception.__name__}: This task failed due to x\n")
    assert result.task == fails_with
    assert result.args == [kind, "This task failed due to x"] and result.kwargs == {}
    assert result.attempts == 1
    assert after.status == Status.SUCCESSFUL and after.return_value == 2


def test_complex_exception(clean, run_worker):
    """Django tests/tasks/test_immediate_backend.py, DB and RQ ``test_complex_exception``:
    an exception whose argument is an exception is FAILED with its class and the
    traceback showing the raise."""
    result = complex_exception.enqueue()
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(result), 15), result.status
    assert result.status == Status.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018
    assert result.started_at is not None and result.last_attempted_at is not None
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result._return_value is None
    assert result.errors[0].exception_class is ValueError
    assert 'ValueError(ValueError("This task failed"))' in result.errors[0].traceback
    assert result.task == complex_exception
    assert result.args == [] and result.kwargs == {}
    assert result.attempts == 1


def test_complex_return_value(clean, run_worker):
    """Django tests/tasks/test_immediate_backend.py, DB and RQ
    ``test_complex_return_value``: a return value JSON cannot carry (a lambda) makes the
    task FAILED with a ``TypeError`` whose traceback says why. Ours is
    ``deferred.backends.ReturnValueNotJSON``, a ``TypeError`` (documented in
    docs/howto/django-tasks.md), caused by the framework's own "Unsupported type"."""
    result = returns_a_lambda.enqueue()
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(result), 15), result.status
    assert result.status == Status.FAILED
    assert result.started_at is not None and result.last_attempted_at is not None
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result._return_value is None
    assert issubclass(result.errors[0].exception_class, TypeError)
    assert "Unsupported type" in result.errors[0].traceback


def test_interrupting_and_exiting_tasks_fail_and_the_worker_goes_on(clean, run_worker):
    """DB ``test_keyboard_interrupt_task`` and ``test_worker_doesnt_exit`` (and, for a
    queueing backend, Django tests/tasks/test_immediate_backend.py
    ``test_throws_keyboard_interrupt``, where the caller ran the task): a task that raises
    ``KeyboardInterrupt``, or calls ``exit(1)``, is FAILED with that exception class, and
    the worker runs the next task."""
    interrupted = interrupts.enqueue("This task failed due to KeyboardInterrupt")
    exited = exits.enqueue()
    worker = run_worker(concurrency=1)
    assert wait_for(lambda: finished(interrupted) and finished(exited), 15)
    after = meaning_of_life.enqueue()
    assert wait_for(lambda: finished(after), 15), after.status
    assert interrupted.status == Status.FAILED
    assert interrupted.errors[0].exception_class is KeyboardInterrupt
    assert exited.status == Status.FAILED
    assert exited.errors[0].exception_class is SystemExit
    assert after.status == Status.SUCCESSFUL and after.return_value == 42
    assert after.worker_ids == [worker.worker_id]


def test_batch_processes_all_tasks(clean, run_worker):
    """DB ``test_batch_processes_all_tasks``: three tasks and a failing one, waiting
    before any worker runs: one worker runs all four, three SUCCESSFUL and one FAILED."""
    results = [noop.enqueue() for _ in range(3)]
    failing = fails_with.enqueue("value", "x")
    run_worker(concurrency=1)
    assert wait_for(lambda: all(finished(r) for r in [*results, failing]), 15)
    assert [r.status for r in results] == [Status.SUCCESSFUL] * 3
    assert failing.status == Status.FAILED


# ---------------------------------------------------------------------- signals and logs


def test_enqueue_logs(drained, caplog):
    """Django tests/tasks/test_dummy_backend.py, DB and RQ ``test_enqueue_logs``: one
    enqueue, one line of the framework's log, saying "enqueued" with the id."""
    with caplog.at_level(logging.DEBUG, logger=TASKS_LOGGER):
        result = noop.enqueue()
    logged = tasks_log(caplog)
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert "enqueued" in logged[0].getMessage() and result.id in logged[0].getMessage()


def test_started_finished_logs_and_signals(clean, run_worker, caplog):
    """RQ ``test_started_finished_logs``, Django tests/tasks/test_immediate_backend.py
    ``test_enqueue_logs`` and ``test_successful_task_no_none_type_in_logs``: the
    framework logs "enqueued", then "state=RUNNING" and "state=SUCCESSFUL" with the id,
    and no "NoneType". Those lines are its receivers of ``task_started`` and
    ``task_finished``: both are sent by the backend class, around the run, with the
    result as it is then (RUNNING with its start and this worker; SUCCESSFUL with its
    end and return value)."""
    with (
        caplog.at_level(logging.DEBUG, logger=TASKS_LOGGER),
        Received(signals.task_started) as started,
        Received(signals.task_finished) as ended,
    ):
        result = meaning_of_life.enqueue()
        worker = run_worker(concurrency=1)
        assert wait_for(lambda: finished(result), 15), result.status
        assert wait_for(lambda: len(tasks_log(caplog)) >= 3, 5)
    messages = [r.getMessage() for r in tasks_log(caplog)]
    assert len(messages) == 3, messages
    assert "enqueued" in messages[0]
    assert "state=RUNNING" in messages[1]
    assert "state=SUCCESSFUL" in messages[2]
    assert all(result.id in m for m in messages)
    assert not any("NoneType" in m for m in messages)

    ((sender, running),) = started.calls
    assert sender is RabbitMQBackend
    assert running.id == result.id and running.task == meaning_of_life
    (then,) = started.seen
    assert then["status"] == Status.RUNNING
    assert then["started_at"] is not None and then["finished_at"] is None
    assert then["worker_ids"] == [worker.worker_id] and then["attempts"] == 1
    ((sender, done),) = ended.calls
    assert sender is RabbitMQBackend
    assert done.id == result.id and ended.seen[0]["status"] == Status.SUCCESSFUL
    assert done.finished_at >= done.started_at and done.return_value == 42
    assert done.started_at == result.started_at  # what get_result() reads


def test_failed_logs(clean, run_worker, caplog):
    """RQ and Django tests/tasks/test_immediate_backend.py ``test_failed_logs``, and the
    log check of Django's ``test_catches_exception``: a failing task logs "state=RUNNING",
    then "state=FAILED" with the id, once, at ERROR with the exception (its message in
    the formatted line)."""
    result = fails_with.enqueue("value", "This task failed due to ValueError")
    with caplog.at_level(logging.DEBUG, logger=TASKS_LOGGER):
        run_worker(concurrency=1)
        assert wait_for(lambda: finished(result), 15), result.status
        assert wait_for(lambda: len(tasks_log(caplog)) >= 2, 5)
    logged = tasks_log(caplog)
    assert len(logged) == 2, [r.getMessage() for r in logged]
    assert "state=RUNNING" in logged[0].getMessage() and result.id in logged[0].getMessage()
    assert "state=FAILED" in logged[1].getMessage() and result.id in logged[1].getMessage()
    errors = [r for r in logged if r.levelno >= logging.ERROR]
    assert errors == [logged[1]]
    assert "This task failed due to ValueError" in logging.Formatter().format(errors[0])


# ---------------------------------------------------------------------- transactions


def test_enqueue_waits_for_the_commit_by_default(clean, raw_channel):
    """Django tests/tasks/test_dummy_backend.py and test_immediate_backend.py
    ``test_doesnt_wait_until_transaction_commit_by_default``, DB and RQ
    ``test_doesnt_wait_until_transaction_commit``, in the form our documented default
    implies: the framework's backends enqueue at once inside ``atomic()``; ours publishes
    after the commit (docs/howto/django-tasks.md: "Inside ``transaction.atomic()``,
    ``.enqueue()`` publishes after the commit. A rollback enqueues nothing."), as the
    framework's own earlier ``ENQUEUE_ON_COMMIT`` (Django tests/tasks/test_dummy_backend.py
    ``test_wait_until_transaction_commit``, since removed) did. ``task_enqueued`` follows
    the publish."""
    ready = clean.ready_queues["default"].name
    with Received(signals.task_enqueued) as received:
        with transaction.atomic():
            result = noop.enqueue()
            assert result.status == Status.READY and result.enqueued_at is not None
            time.sleep(0.1)
            assert depth(raw_channel, ready) == 0
            assert received.calls == []
        assert received.calls == [(RabbitMQBackend, result)]
        assert wait_for(lambda: depth(raw_channel, ready) == 1, 5)

        with pytest.raises(ZeroDivisionError), transaction.atomic():
            noop.enqueue()
            1 / 0  # noqa: B018
        time.sleep(0.1)
    assert depth(raw_channel, ready) == 1
    assert received.calls == [(RabbitMQBackend, result)]
    raw_channel.queue_purge(ready)


def test_enqueue_at_once_inside_a_transaction_with_on_commit_off(clean, raw_channel):
    """Django tests/tasks/test_dummy_backend.py and test_immediate_backend.py
    ``test_doesnt_wait_until_transaction_commit_by_default``, DB and RQ
    ``test_doesnt_wait_until_transaction_commit``, as the framework has it: with
    ``OPTIONS["ON_COMMIT"] = False`` (documented: "publishes at once") the task is on the
    broker, and ``task_enqueued`` sent, before the transaction ends."""
    ready = clean.ready_queues["default"].name
    with override_settings(
        TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": {"ON_COMMIT": False}}}
    ):
        with Received(signals.task_enqueued) as received, transaction.atomic():
            result = noop.enqueue()
            assert result.enqueued_at is not None
            assert received.calls == [(RabbitMQBackend, result)]
            assert wait_for(lambda: depth(raw_channel, ready) == 1, 5)
    assert depth(raw_channel, ready) == 1
    raw_channel.queue_purge(ready)


# ---------------------------------------------------------------------- queues and order


def test_queue_isolation(drained, raw_channel):
    """RQ ``test_queue_isolation``: a task goes to its own queue's broker queue, and only
    there; both results read READY meanwhile."""
    default_task = noop.enqueue()
    other_task = noop.using(queue_name="other").enqueue()
    forget_enqueued_here()  # as the broker has them, not this process's memory
    assert backend().get_result(default_task.id).status == Status.READY
    assert backend().get_result(other_task.id).status == Status.READY

    def ids_in(queue: str) -> list[str]:
        found = []
        while True:
            method, _, body = raw_channel.basic_get(drained.ready_queues[queue].name, True)
            if method is None:
                return found
            found.append(Job.decode(body).id)

    for queue in ("default", "other"):
        assert wait_for(lambda q=queue: depth(raw_channel, drained.ready_queues[q].name) == 1, 5)
    assert ids_in("default") == [default_task.id]
    assert ids_in("other") == [other_task.id]


def test_doesnt_process_different_queue(clean, run_worker, raw_channel):
    """DB ``test_doesnt_process_different_queue`` and ``test_process_all_queues``: a
    worker of the queue "default" leaves a task of "other" waiting (READY, on the broker);
    a worker of every queue (ours: no ``--queue``) runs it."""
    on_default = noop.enqueue()
    on_other = noop.using(queue_name="other").enqueue()
    run_worker(queues=["default"], concurrency=1)
    assert wait_for(lambda: finished(on_default), 15), on_default.status
    time.sleep(0.3)
    assert status_of(on_other.id) == Status.READY
    assert depth(raw_channel, clean.ready_queues["other"].name) == 1
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(on_other), 15), on_other.status
    assert on_default.status == on_other.status == Status.SUCCESSFUL


def test_higher_priority_tasks_come_first(clean, run_worker, records, raw_channel):
    """DB ``DBTaskResultOrderingTestCase.test_higher_priority_tasks_come_first`` and
    ``test_earlier_enqueued_at_comes_first_given_same_priority_and_run_after``, and the
    READY order of DB ``test_run_after_priority``: tasks waiting for a worker run highest
    priority first, and in the order they were enqueued among equal priorities. Ours
    orders a backlog in the broker by level, bands of 20 (documented in
    docs/howto/worker.md, Priorities), so the priorities here lie in different bands."""
    for label, priority in [("low", -60), ("zero-a", 0), ("mid", 30), ("zero-b", 0), ("high", 90)]:
        note.using(priority=priority).enqueue(records, label)
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["other"].name) == 5, 5)
    run_worker(queues=["other"], concurrency=1)
    assert wait_for(lambda: len(lines(records)) == 5, 15), lines(records)
    assert [line["label"] for line in lines(records)] == ["high", "mid", "zero-a", "zero-b", "low"]


def test_earlier_run_after_comes_first_given_same_priority(clean, run_worker, records):
    """DB ``DBTaskResultOrderingTestCase.test_earlier_run_after_comes_first_given_same_priority``
    and DB ``test_run_after_priority`` (a task due later is not ready, whatever its
    priority): of two tasks due soon, the one due first runs first, even when the other
    has the higher priority; neither runs before its ``run_after``."""
    run_worker(queues=["other"], concurrency=1)
    now = timezone.now()
    late_at, early_at = now + timedelta(milliseconds=2500), now + timedelta(milliseconds=500)
    late = note.using(run_after=late_at, priority=90).enqueue(records, "late")
    early = note.using(run_after=early_at).enqueue(records, "early")
    assert wait_for(lambda: len(lines(records)) == 2, 15), lines(records)
    assert [line["label"] for line in lines(records)] == ["early", "late"]
    assert wait_for(lambda: finished(late) and finished(early), 15)
    assert early.started_at >= early_at and late.started_at >= late_at


def test_run_after(own_topology, run_worker):
    """DB ``test_run_after`` and ``test_run_after_priority``: a task due in hours, even of
    the highest priority, is not run by a worker that runs what is due; it stays READY."""
    with Received(signals.task_started) as started:
        far = noop.using(run_after=timezone.now() + timedelta(hours=10), priority=100).enqueue()
        due = noop.enqueue()
        run_worker(concurrency=1)
        assert wait_for(lambda: finished(due), 15), due.status
        time.sleep(0.5)
    assert [r.id for _, r in started.calls] == [due.id]
    forget_enqueued_here()  # READY as the broker has it, not from this process's memory
    assert status_of(far.id) == Status.READY


def test_run_after_tz(clean, run_worker):
    """DB ``test_run_after_tz``: with ``USE_TZ`` on and off, a task enqueued with no
    ``run_after`` runs, and its result's task, read back by another process (one that did
    not enqueue it), has no ``run_after``."""
    run_worker(concurrency=1)
    for use_tz in (True, False):
        with override_settings(USE_TZ=use_tz):
            result_id = noop.enqueue().id
            assert wait_for(lambda i=result_id: status_of(i) == Status.SUCCESSFUL, 15), use_tz
            forget_enqueued_here()
            assert backend().get_result(result_id).task.run_after is None


# ---------------------------------------------------------------------- workers


def forged(task_path: str) -> Job:
    """A job naming ``task_path`` as this backend's, published as if by anyone."""
    job = Job(
        id=new_job_id(),
        task=task_path,
        args=(["exit", "1"],) if task_path.startswith("subprocess") else (),
        kwargs={},
        due=datetime.now(UTC),
        queue="default",
        backend="default",
    )
    publish(job, 0)
    return job


def test_invalid_task_path(clean, run_worker):
    """DB ``test_invalid_task_path``, ``test_missing_task_path`` and
    ``test_task_import_string`` (the worker fails a row naming no task), and RQ
    ``test_invalid_task_path`` (``get_result()`` of such a job refuses it): a message
    naming something that is not a task (``subprocess.check_output``), a module that does
    not exist, or a name its module lacks is not run; the worker fails it
    (``unknown_task``, documented in docs/howto/django-tasks.md), and ``get_result()``
    raises ``TaskResultDoesNotExist`` (RQ raises ``SuspiciousOperation``; DB reads it
    FAILED)."""
    run_worker(concurrency=1)
    jobs = [
        forged("subprocess.check_output"),
        forged("missing.func"),
        forged("tests.testapp.framework_tasks.some_test"),
    ]
    assert wait_for(lambda: len(list_failed(get_settings())) == 3, 15)
    entries = {e.id: e for e in list_failed(get_settings())}
    assert set(entries) == {job.id for job in jobs}
    assert {e.reason for e in entries.values()} == {"unknown_task"}
    for job in jobs:
        with pytest.raises(TaskResultDoesNotExist):
            backend().get_result(job.id)


def test_multiple_workers(clean, run_worker, caplog):
    """DB ``test_multiple_workers``: ten tasks, three workers: every task SUCCESSFUL, and
    each logged RUNNING once and SUCCESSFUL once (no task ran twice)."""
    results = [sleep_for.enqueue(0.1) for _ in range(10)]
    with caplog.at_level(logging.INFO, logger=TASKS_LOGGER):
        for _ in range(3):
            run_worker(concurrency=1)
        assert wait_for(lambda: all(finished(r) for r in results), 20)
        assert wait_for(lambda: len(tasks_log(caplog, "state=SUCCESSFUL")) >= 10, 5)
    assert {r.status for r in results} == {Status.SUCCESSFUL}
    for result in results:
        assert len(tasks_log(caplog, result.id, "state=RUNNING")) == 1
        assert len(tasks_log(caplog, result.id, "state=SUCCESSFUL")) == 1


def test_run_subprocess(clean, worker_process):
    """DB ``test_run_subprocess``, ``test_verbose_logging`` and ``test_interrupt_no_tasks``:
    a worker process runs the task, and the result in hand is READY until refreshed, then
    SUCCESSFUL; the worker's output has the framework's lines for it, "Task id=...
    path=... state=RUNNING", then "state=SUCCESSFUL" (with no ``LOGGING`` of the
    project's, as the worker guide describes: root logger, the tasks' INFO lines); idle
    again, it stops on SIGTERM with status 0. (DB gives that stop 0.5 s; ours hands back
    its held jobs and closes its broker connection first, so it gets 20 s here.)"""
    result = meaning_of_life.enqueue()
    worker = worker_process(env={"DJANGO_SETTINGS_MODULE": "tests.settings_plain"})
    assert wait_for(lambda: status_of(result.id) == Status.SUCCESSFUL, 15), worker.output()
    assert result.status == Status.READY
    result.refresh()
    assert result.status == Status.SUCCESSFUL and result.return_value == 42

    path = meaning_of_life.module_path
    running = f"Task id={result.id} path={path} state=RUNNING"
    successful = f"Task id={result.id} path={path} state=SUCCESSFUL"
    assert wait_for(lambda: successful in worker.output(), 5), worker.output()
    output = worker.output()
    assert running in output and output.index(running) < output.index(successful)

    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0, worker.output()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_signals(clean, worker_process, signum, tmp_path):
    """DB ``test_interrupt_signals``: SIGINT or SIGTERM while a task runs (RUNNING, with
    a worker id): the worker lets it finish, then exits 0; the task is SUCCESSFUL. The
    task runs until the test releases it, so it surely runs when the signal comes."""
    release = tmp_path / "release"
    result = blocks_until.enqueue(str(release))
    worker = worker_process()
    assert wait_for(lambda: status_of(result.id) == Status.RUNNING, 10), worker.output()
    result.refresh()
    assert result.worker_ids != []
    worker.signal(signum)
    time.sleep(0.5)
    assert worker.proc.poll() is None, worker.output()  # still finishing its task
    release.touch()
    assert worker.wait(20) == 0, worker.output()
    result.refresh()
    assert result.status == Status.SUCCESSFUL and result.return_value == "released"


def test_repeat_ctrl_c(clean, worker_process, tmp_path):
    """DB ``test_repeat_ctrl_c``, in the form our documented behaviour implies: DB's
    worker ends the running task at a second Ctrl-C (FAILED, ``SystemExit``); ours, at
    SIGINT or SIGTERM, "finishes and acks the running ones, and exits 0"
    (docs/howto/worker.md), and a second SIGINT changes nothing: the task still ends
    SUCCESSFUL."""
    release = tmp_path / "release"
    result = blocks_until.enqueue(str(release))
    worker = worker_process()
    assert wait_for(lambda: status_of(result.id) == Status.RUNNING, 10), worker.output()
    worker.signal(signal.SIGINT)
    time.sleep(0.3)
    worker.signal(signal.SIGINT)
    time.sleep(0.5)
    assert worker.proc.poll() is None, worker.output()
    assert status_of(result.id) == Status.RUNNING
    release.touch()
    assert worker.wait(20) == 0, worker.output()
    result.refresh()
    assert result.status == Status.SUCCESSFUL


def test_kill(clean, worker_process, run_worker, tmp_path):
    """DB ``test_kill``: a worker process killed (SIGKILL) while its task runs leaves the
    task RUNNING. Ours then goes further, as documented (docs/explanation/guarantees.md:
    a job is acked only after its task returned; if that worker is killed, RabbitMQ
    redelivers it to another worker): the next worker runs it to SUCCESSFUL."""
    release = tmp_path / "release"
    result = blocks_until.enqueue(str(release))
    worker = worker_process()
    assert wait_for(lambda: status_of(result.id) == Status.RUNNING, 10), worker.output()
    worker.kill()
    assert worker.proc.returncode == -signal.SIGKILL
    assert status_of(result.id) == Status.RUNNING
    release.touch()
    run_worker(concurrency=1)
    assert wait_for(lambda: status_of(result.id) == Status.SUCCESSFUL, 20)
