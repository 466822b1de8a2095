"""Test modes for your own test suite: no broker needed.

``eager()`` runs each deferred job inline, at once, inside ``defer()``;
``capture()`` records the jobs instead, for assertions. Both validate exactly
as ``defer()`` does (unknown task, bad delay, bad or non-JSON arguments) and
hand the task its arguments after a JSON round trip, as the worker would.

    from deferred.testing import capture, eager

    def test_signup_schedules_a_reminder(client):
        with capture() as jobs:
            client.post("/signup/", {...})
        assert [j.task for j in jobs] == ["accounts.send_reminder"]
        jobs.run()                      # run them now, in due order

    def test_reminder_end_to_end(client):
        with eager():
            client.post("/signup/", {...})   # the reminder ran already

Both ignore the on-commit rule: in a test wrapped in a transaction that is
never committed, the job is still captured or run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from deferred import publishing
from deferred.context import running
from deferred.jobs import Job
from deferred.tasks import Task, get_task


class CapturedJobs(list[Job]):
    """The jobs deferred inside ``capture()``, in the order they were deferred."""

    def for_task(self, task: Task[..., Any] | str) -> list[Job]:
        name = task if isinstance(task, str) else task.name
        return [job for job in self if job.task == name]

    def run(self) -> None:
        """Run every captured job now, earliest due first, and forget them."""
        for job in sorted(self, key=lambda j: j.due):
            run_job(job)
        self.clear()


def run_job(job: Job) -> Any:
    """Run ``job``'s task inline, as the worker would: JSON arguments, ``current_job()`` set."""
    data = json.loads(job.encode())
    task = get_task(job.task)
    with running(job):
        return task.func(*data["args"], **data["kwargs"])


@contextmanager
def _intercepting(handler: Callable[[Job, int], None]) -> Iterator[None]:
    previous = publishing.interceptor
    publishing.interceptor = handler
    try:
        yield
    finally:
        publishing.interceptor = previous


@contextmanager
def capture() -> Iterator[CapturedJobs]:
    """Record deferred jobs instead of publishing them."""
    jobs = CapturedJobs()
    with _intercepting(lambda job, wait_ms: jobs.append(job)):
        yield jobs


@contextmanager
def eager() -> Iterator[list[Job]]:
    """Run deferred jobs inline, at once, ignoring their delay; yields the jobs run.

    An exception raised by a task propagates out of ``defer()``, so a test
    sees it; retries are not attempted.
    """
    ran: list[Job] = []

    def handle(job: Job, wait_ms: int) -> None:
        ran.append(job)
        run_job(job)

    with _intercepting(handle):
        yield ran


def delay_of(job: Job) -> timedelta:
    """How long after it was deferred ``job`` is due (rounded up to the resolution)."""
    return job.due - job.created
