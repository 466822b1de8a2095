"""``current_job()``: what a running task knows about the job it is running.

A context variable, set by the worker (and by eager test mode) around the
task call, so a task can log its job id, use it as an idempotency key, or
behave differently on a retry, without taking extra arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime

from deferred.core.jobs import Job


@dataclass(frozen=True)
class CurrentJob:
    #: The id ``defer()`` returned.
    id: str
    #: 1 on the first run, 2 on the first retry, ...
    attempt: int
    task: str
    queue: str
    due: datetime
    #: For a run of a schedule, the occurrence's scheduled instant (aware, UTC):
    #: the same on every run of that occurrence, a duplicate's included.
    #: ``None`` for a job deferred by hand.
    occurrence: datetime | None = None


_current: ContextVar[CurrentJob | None] = ContextVar("deferred_current_job", default=None)


def current_job() -> CurrentJob | None:
    """The job being run by this thread, or ``None`` outside a job."""
    return _current.get()


@contextmanager
def running(job: Job) -> Iterator[CurrentJob]:
    """Make ``job`` the current job for the duration of the block."""
    info = CurrentJob(
        id=job.id,
        attempt=job.attempt,
        task=job.task,
        queue=job.queue,
        due=job.due,
        occurrence=job.occurrence,
    )
    token = _current.set(info)
    try:
        yield info
    finally:
        _current.reset(token)
