"""Django's task framework, checked with its own test suites: the checks of Django's
``tests/tasks/`` and of the django-tasks family (django-tasks, django-tasks-db,
django-tasks-rq) that apply to any real queueing backend, ported to this backend and run
against the real broker and a real worker. Each test names the reference it ports;
where this backend answers differently on purpose, the test says so and why.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from django.test import override_settings

from deferred.backends import InvalidTask, RabbitMQBackend, _api, _exceptions
from tests.conftest import wait_for
from tests.testapp.framework_tasks import double, fails_with, note_async, own_id

pytestmark = pytest.mark.django_db(transaction=True)

TaskResultDoesNotExist = _exceptions.TaskResultDoesNotExist
TaskResultMismatch = _exceptions.TaskResultMismatch
Status = _api.TaskResultStatus


def finished(result) -> bool:
    result.refresh()
    return result.status in (Status.SUCCESSFUL, Status.FAILED)


def test_using_correct_backend():
    """Django tests/tasks/test_immediate_backend.py and test_dummy_backend.py,
    ``test_using_correct_backend``: the default backend is ours, alias "default", no
    options."""
    backend = _api.task_backends["default"]
    assert _api.default_task_backend.alias == "default"  # a proxy to it
    assert isinstance(backend, RabbitMQBackend)
    assert backend.alias == "default" and backend.options == {}


def test_check():
    """Django tests/tasks/test_dummy_backend.py and django-tasks-db/-rq ``test_check``:
    a well configured backend has no system check errors."""
    assert list(_api.task_backends["default"].check()) == []


def test_enqueue_with_invalid_argument():
    """Django tests/tasks/test_tasks.py ``test_enqueue_with_invalid_argument`` and
    ``test_aenqueue_with_invalid_argument``: an argument JSON cannot carry (a datetime)
    raises ``TypeError`` at enqueue. (The message is ours: it names the task.)"""
    with pytest.raises(TypeError):
        double.enqueue(datetime.now(UTC))
    with pytest.raises(TypeError):
        asyncio.run(double.aenqueue(datetime.now(UTC)))


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


def test_unknown_queue_name():
    """Django tests/tasks/test_tasks.py ``test_unknown_queue_name``: a queue the backend
    does not have is refused. (Our message says where the valid ones come from.)"""
    with pytest.raises(InvalidTask, match="queue-2"):
        double.using(queue_name="queue-2")


def test_get_missing_result():
    """Django tests/tasks/test_tasks.py and test_dummy_backend.py, django-tasks-db/-rq
    ``test_get_missing_result`` and ``test_async_get_missing_result``, and -db/-rq
    ``test_invalid_uuid``: an id that is none raises ``TaskResultDoesNotExist``."""
    backend = _api.task_backends["default"]
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result("123")
    with pytest.raises(TaskResultDoesNotExist):
        asyncio.run(backend.aget_result("123"))


def test_get_incorrect_result(clean):
    """Django tests/tasks/test_tasks.py ``test_get_incorrect_result`` and
    ``test_get_incorrect_result_async``: the result of one task, asked of another,
    raises ``TaskResultMismatch``."""
    result = note_async.enqueue("/dev/null", "x")
    with pytest.raises(TaskResultMismatch):
        double.get_result(result.id)
    with pytest.raises(TaskResultMismatch):
        asyncio.run(double.aget_result(result.id))


def test_takes_context(clean, run_worker):
    """Django tests/tasks/test_immediate_backend.py and django-tasks-rq
    ``test_takes_context``: a task that takes the context sees its own result id."""
    result = own_id.enqueue()
    run_worker(concurrency=1)
    assert wait_for(lambda: finished(result), 15), result.status
    assert result.status == Status.SUCCESSFUL and result.return_value == result.id


@pytest.mark.parametrize(
    "kind, exception", [("value", ValueError), ("exit", SystemExit)], ids=["value", "exit"]
)
def test_catches_exception(clean, run_worker, kind, exception):
    """Django tests/tasks/test_immediate_backend.py and django-tasks-rq
    ``test_catches_exception``: a task that raises (``ValueError``, or ``SystemExit``)
    is FAILED, with its exception class and a traceback ending with the error; its
    ``return_value`` raises; the worker goes on."""
    with override_settings(
        TASKS={
            "default": {
                "BACKEND": "deferred.backends.RabbitMQBackend",
                "OPTIONS": {"MAX_RETRIES": 0},
            }
        }
    ):
        result = fails_with.enqueue(kind, "This task failed due to x")
        run_worker(concurrency=1)
        assert wait_for(lambda: finished(result), 15), result.status
        after = double.enqueue(1)
        assert wait_for(lambda: finished(after), 15), after.status
    assert result.status == Status.FAILED and result.is_finished
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018 - the framework raises for a failed task
    assert result.started_at <= result.last_attempted_at <= result.finished_at
    (error,) = result.errors
    assert error.exception_class is exception
    assert error.traceback.endswith(f"{exception.__name__}: This task failed due to x\n")
    assert result.args == [kind, "This task failed due to x"] and result.kwargs == {}
    assert after.status == Status.SUCCESSFUL and after.return_value == 2
