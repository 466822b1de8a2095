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

``deferred.cancel()`` works in both without a broker: under ``capture()`` it
removes the captured job (also while ``jobs.run()`` runs them, so a job can
cancel another); under ``eager()`` the job ran inside ``defer()`` already, so
a cancel finds nothing left to stop and is accepted quietly, as the real one
is for a job that finished.

``fire_schedule(task)`` runs a recurring task's next occurrence now, as the
worker would (``current_job().occurrence`` set), without waiting for it:

    def test_the_digest_runs(db):
        occurrence = fire_schedule(morning_digest)
        assert occurrence.hour == 6   # 07:30 Paris in winter, in UTC
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from deferred.core.jobs import Job
from deferred.producer import publishing
from deferred.producer.tasks import Task
from deferred.records import cancels
from deferred.worker.runnable import resolve


class CapturedJobs(list[Job]):
    """The jobs deferred inside ``capture()``, in the order they were deferred."""

    def for_task(self, task: Task[..., Any] | str | Any) -> list[Job]:
        """The jobs of one task: a ``@deferred.task``, a django.tasks task, or a name."""
        if isinstance(task, str):
            name = task
        elif isinstance(task, Task):
            name = task.name
        elif isinstance(getattr(task, "module_path", None), str):
            name = task.module_path  # a django.tasks task: jobs name it by its path
        else:
            raise TypeError(f"for_task() takes a task or a task name, not {task!r}.")
        return [job for job in self if job.task == name]

    def take(self, job: Job) -> None:
        """Capture ``job``; a keyed one supersedes the captured jobs of its key
        (what the worker does with them when they come due: ``deferred.core.keys``)."""
        if job.key is not None:
            self[:] = [other for other in self if other.key != job.key]
        self.append(job)

    def cancel(self, ids: list[str]) -> None:
        """Drop the jobs ``ids`` names (what ``deferred.cancel()`` does in this mode)."""
        gone = set(ids)
        self[:] = [job for job in self if job.id not in gone]

    def run(self, max_rounds: int = 100) -> None:
        """Run the captured jobs now, earliest due first, until none is left.

        Jobs deferred by the jobs that run are captured too and run in the
        next round (even after the ``with`` block). A task that always defers
        another job never ends: after ``max_rounds`` this raises.
        """
        cancelled: set[str] = set()

        def cancel(ids: list[str]) -> None:
            cancelled.update(ids)
            self.cancel(ids)

        with _intercepting(lambda job, wait_ms: self.take(job), cancel):
            for _ in range(max_rounds):
                if not self:
                    return
                batch = sorted(self, key=lambda j: j.due)
                self.clear()
                for job in batch:
                    if job.id not in cancelled:  # cancelled by a job of this round
                        run_job(job)
        if self:
            raise RuntimeError(
                f"Still {len(self)} job(s) after {max_rounds} rounds: do the tasks defer "
                "each other forever?"
            )


def run_job(job: Job) -> Any:
    """Run ``job``'s task inline, as the worker would: JSON arguments, ``current_job()`` set."""
    data = json.loads(job.encode())
    inline = replace(job, args=tuple(data["args"]), kwargs=data["kwargs"])
    return resolve(inline).run(inline, "eager", retries=False)


def _ignore_cancels(ids: list[str]) -> None:
    """Eager mode: each job ran inside ``defer()``; a cancel finds nothing to stop."""


@contextmanager
def _intercepting(
    handler: Callable[[Job, int], None],
    on_cancel: Callable[[list[str]], None] = _ignore_cancels,
) -> Iterator[None]:
    # A stack, not save-and-restore: blocks that overlap (in two threads)
    # may end in any order and each removes only its own handler.
    with publishing.interceptors_lock:
        publishing.interceptors.append(handler)
        cancels.interceptors.append(on_cancel)
    try:
        yield
    finally:
        with publishing.interceptors_lock:
            publishing.interceptors.remove(handler)
            cancels.interceptors.remove(on_cancel)


@contextmanager
def capture() -> Iterator[CapturedJobs]:
    """Record deferred jobs instead of publishing them."""
    jobs = CapturedJobs()
    with _intercepting(lambda job, wait_ms: jobs.take(job), jobs.cancel):
        yield jobs


@contextmanager
def eager() -> Iterator[list[Job]]:
    """Run deferred jobs inline, at once, ignoring their delay; yields the jobs run.

    An exception raised by a task propagates out of ``defer()``, so a test
    sees it; retries are not attempted. ``deferred.cancel()`` of a job that
    ran is accepted and does nothing, like a cancel of a finished job. A task
    that defers itself recurses: use ``capture()`` and ``run()`` for chains of
    jobs.
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


def fire_schedule(task: Task[..., Any] | str, after: datetime | None = None) -> datetime:
    """Run ``task``'s next scheduled occurrence (after ``after``, default now) inline.

    Returns the occurrence (aware, UTC). The job is the one the scheduler
    would defer for it: same id, same ``current_job().occurrence``.
    ``LookupError`` if the task has no schedule.
    """
    from deferred.conf import get_settings
    from deferred.core.jobs import utcnow
    from deferred.core.schedule import occurrence_id
    from deferred.records.schedules import scheduled_tasks
    from deferred.worker.scheduler import Occurrence, occurrence_job

    settings = get_settings()
    name = task if isinstance(task, str) else task.name
    schedules = scheduled_tasks(settings)
    if name not in schedules:
        raise LookupError(f"Task {name!r} has no schedule (@task(schedule=...) or SCHEDULES).")
    at = schedules[name].after(after or utcnow())
    run_job(occurrence_job(Occurrence(name, at, at, occurrence_id(name, at)), settings))
    return at
