"""What the worker runs for a job: a ``@deferred.task`` or a django.tasks task.

Both kinds travel through the same queues in the same job format; only the
way a job names its function differs (a registered name, or the module path
of a django.tasks ``Task`` with the alias of the backend that enqueued it).
The worker and the test modes resolve a job here, so they run both kinds the
same way.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from django.core.exceptions import ImproperlyConfigured

from deferred.core.context import running
from deferred.core.jobs import Job
from deferred.core.limits import Watch, run_async
from deferred.producer.tasks import Task, UnknownTask, get_task

if TYPE_CHECKING:
    from deferred.conf import DeferredSettings
    from deferred.core.retries import RetryPolicy


class Runnable(Protocol):
    """A job's function, ready to run."""

    def run(
        self,
        job: Job,
        worker_id: str,
        *,
        retries: bool = True,
        watch: Watch | None = None,
        started: datetime | None = None,
    ) -> Any:
        """Run one attempt of ``job``; raise what the function raised.

        ``retries`` says whether a failure of this attempt may be retried
        (false in the test modes, which never retry). ``watch``: the
        attempt's time limit, which an ``async def`` function's event loop
        enforces (:func:`deferred.core.limits.run_async`). ``started``: when the
        attempt started, as its results record says (default: now).
        """

    def retry_policy(self, settings: DeferredSettings) -> RetryPolicy:
        """How failed attempts of this job are retried."""

    def time_limit(self, settings: DeferredSettings) -> float | None:
        """Seconds an attempt may run; ``None``: no limit."""


@dataclass(frozen=True)
class RegisteredTask:
    """A function registered with ``@deferred.task``."""

    task: Task[..., Any]

    def run(
        self,
        job: Job,
        worker_id: str,
        *,
        retries: bool = True,
        watch: Watch | None = None,
        started: datetime | None = None,
    ) -> Any:
        """Call the function; an ``async def`` one is run to its end here.

        An event loop per job, made by ``async_to_sync`` from the job's
        thread (as Django runs an async django.tasks task): its
        ``sync_to_async`` ORM calls come back to this thread and its database
        connection, and one task blocking its loop stalls no other job.
        """
        with running(job):
            result = self.task.func(*job.args, **job.kwargs)
            if inspect.isawaitable(result):
                return run_async(result, watch)
            return result

    def retry_policy(self, settings: DeferredSettings) -> RetryPolicy:
        return self.task.retry_policy(settings)

    def time_limit(self, settings: DeferredSettings) -> float | None:
        return self.task.time_limit(settings)


def resolve(job: Job) -> Runnable:
    """The function ``job`` names; ``deferred.producer.tasks.UnknownTask`` if there is none."""
    if job.backend is None:
        return RegisteredTask(get_task(job.task))
    # Imported only for a django.tasks job: plain users need neither Django 6
    # nor the django-tasks backport.
    try:
        from deferred.worker.django_tasks import resolve_django_task
    except ImproperlyConfigured as exc:
        raise UnknownTask(f"Job {job.id} is a django.tasks job, and {exc}") from None
    return resolve_django_task(job)
