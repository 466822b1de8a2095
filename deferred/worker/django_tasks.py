"""The worker side of the django.tasks backend: finding the task a job names, and
running one attempt with the framework's signals and context.
"""

from __future__ import annotations

import inspect
import logging
import traceback
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.utils import timezone

from deferred.conf import DeferredSettings, get_settings
from deferred.core.context import running
from deferred.core.jobs import Job
from deferred.core.limits import Watch, run_async
from deferred.core.retries import (
    RetryPolicy,
)
from deferred.django_tasks.backend import RabbitMQBackend, find_task
from deferred.django_tasks.framework import (
    ReturnValueNotJSON,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    finish,
    inline_result,
    normalize_json,
    send,
)
from deferred.records.results import (
    lookup,
)

logger = logging.getLogger("deferred.backends")


@dataclass(frozen=True)
class DjangoTask:
    """A django.tasks task found for a job, with the backend that enqueued it."""

    task: Any
    backend: RabbitMQBackend

    def run(
        self,
        job: Job,
        worker_id: str,
        *,
        retries: bool = True,
        watch: Watch | None = None,
        started: datetime | None = None,
    ) -> Any:
        """Run one attempt with the framework's signals and, if asked for, its context.

        ``task_finished`` says how the attempt ended in the framework's terms:
        SUCCESSFUL with the return value, FAILED when no retry will follow,
        and READY ("ready to be executed again") when the worker will retry
        it, so that the framework's own log handler does not report an
        attempt that is retried as a failed task. ``retries`` is false where
        nothing retries (``deferred.testing``).
        """
        # The attempt's start as its results record has it: the signals' TaskResult and
        # get_result()'s agree to the microsecond.
        now = started or timezone.now()
        fields = {
            "status": TaskResultStatus.RUNNING,
            "started_at": now,
            "last_attempted_at": now,
            # TaskContext.attempt counts these: one per attempt, this one last.
            "worker_ids": [*job.workers, worker_id],
        }
        result = inline_result.get()
        if result is not None and result.id == job.id:
            # Run inline by a test mode inside enqueue(): update what it returns.
            for name, value in fields.items():
                object.__setattr__(result, name, value)
        else:
            first_start, errors = _earlier_attempts(job)
            fields["started_at"] = first_start or now
            result = TaskResult(
                task=self.task,
                id=job.id,
                enqueued_at=job.created,
                finished_at=None,
                args=list(job.args),
                kwargs=dict(job.kwargs),
                backend=self.backend.alias,
                errors=errors,
                **fields,
            )
        send("task_started", type(self.backend), result)
        try:
            with running(job):
                args = list(job.args)
                if self.task.takes_context:
                    args.insert(0, TaskContext(task_result=result))
                if inspect.iscoroutinefunction(self.task.func):
                    # As Task.call does, on a loop that enforces the time limit.
                    value = run_async(self.task.func(*args, **job.kwargs), watch)
                else:
                    value = self.task.func(*args, **job.kwargs)
        except BaseException as exc:
            kind = type(exc)
            result.errors.append(
                TaskError(
                    exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
                    traceback="".join(traceback.format_exception(exc)),
                )
            )
            retried = retries and self.retry_policy(get_settings()).decide(exc, job.attempt).retry
            finish(result, TaskResultStatus.READY if retried else TaskResultStatus.FAILED)
            # Inside the except block: the framework's handler logs exc_info.
            send("task_finished", type(self.backend), result)
            raise
        try:
            value = normalize_json(value)
        except (TypeError, ValueError, RecursionError) as exc:
            error = ReturnValueNotJSON(
                f"Task {self.task.module_path} returned a {type(value).__name__}, which JSON "
                f"cannot carry ({exc}): a django.tasks return value must be JSON-serialisable."
            )
            error.__cause__ = exc
            result.errors.append(
                TaskError(
                    exception_class_path=f"{ReturnValueNotJSON.__module__}.ReturnValueNotJSON",
                    traceback="".join(traceback.format_exception(error)),
                )
            )
            finish(result, TaskResultStatus.FAILED)
            send("task_finished", type(self.backend), result)
            raise error from exc
        object.__setattr__(result, "_return_value", value)
        finish(result, TaskResultStatus.SUCCESSFUL)
        send("task_finished", type(self.backend), result)
        return value

    def retry_policy(self, settings: DeferredSettings) -> RetryPolicy:
        policy = self.backend.retry_policy(settings)
        return replace(policy, dont_retry_for=(*policy.dont_retry_for, ReturnValueNotJSON))

    def time_limit(self, settings: DeferredSettings) -> float | None:
        return self.backend.time_limit(settings)


#: How long a retried attempt may spend reading what its earlier attempts recorded (out
#: of its time limit: the read runs as the attempt starts).
EARLIER_TIMEOUT_S = 1.0


def _earlier_attempts(job: Job) -> tuple[datetime | None, list[Any]]:
    """For a retried attempt: when the first attempt started and every earlier attempt's
    error, as the results say, so that the ``TaskResult`` the signals carry is the one
    ``get_result()`` gives. ``(None, [])`` for a first attempt, or when the results
    cannot say (off, or unreadable: the signals then carry this attempt alone)."""
    if job.attempt <= 1:
        return None, []
    settings = get_settings()
    if not settings.results:
        return None, []
    try:
        found = lookup(settings, job.id, timeout=EARLIER_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the run goes on without the history
        logger.info("job=%s: its earlier attempts could not be read (%s).", job.id, exc)
        return None, []
    errors = [TaskError(exception_class_path=e.type, traceback=e.traceback) for e in found.errors]
    return found.started_at, errors


def resolve_django_task(job: Job) -> DjangoTask:
    """The django.tasks task a job names, ready to run; ``UnknownTask`` if it cannot be
    run here (see :func:`deferred.django_tasks.backend.find_task`)."""
    return DjangoTask(*find_task(job))
