"""What became of one delivery: the outcomes, the worker's line per job, and who is told.

One enum names the outcomes for the log line, the ``deferred_jobs_total``
metric and the generated reference, so that the three cannot drift apart.
Whoever watches the worker (the Prometheus metrics, the health file, the results
recorder) is an :class:`Observer`: the worker tells its observers what happens,
and knows nothing of what each does with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from enum import StrEnum
from typing import Any

from deferred.core.jobs import Job


class Outcome(StrEnum):
    """How one message left the worker. Each value is what the log line and the metric say."""

    #: The task ran and returned; the job is acked.
    SUCCEEDED = "succeeded"
    #: The task raised and its retry policy allows another attempt, published
    #: (confirmed) through the delay queues before the ack.
    RETRYING = "retrying"
    #: Kept in the failed queue: the task raised for good, names no known task,
    #: reached ``DELIVERY_LIMIT``, or the message was no job to run.
    FAILED = "failed"
    #: Cancelled: acked without running, or, cancelled while it ran, not retried.
    CANCELLED = "cancelled"
    #: A debounced job (``using(key=...)``) that a later job of its key replaced:
    #: acked without running (``deferred.core.keys``).
    SUPERSEDED = "superseded"
    #: Sent back to the delay queues without running: it arrived before its due
    #: time (clocks differ), or the cancels could not be read.
    RESCHEDULED = "rescheduled"
    #: On classic queues, a job redelivered after a worker died: put back in its
    #: ready queue carrying its delivery count, so that ``DELIVERY_LIMIT`` holds.
    REQUEUED = "requeued"
    #: An occurrence of a recurring job whose task left the code: dropped, as its
    #: schedule was.
    DROPPED = "dropped"
    #: A copy of an attempt that ran already (redelivered after a lost connection,
    #: or published twice): acked without running (``deferred.records.runs``).
    DUPLICATE = "duplicate"
    #: A copy of a job that ``run_now()`` or ``reschedule()`` published again later:
    #: acked without running; the moved copy runs (``deferred.core.moves``).
    MOVED = "moved"

    @property
    def level(self) -> int:
        """The log level of its line: a failure is an error, a retry or a
        redelivery a warning, the rest information."""
        return _LEVELS[self]


_LEVELS = {
    Outcome.SUCCEEDED: logging.INFO,
    Outcome.RETRYING: logging.WARNING,
    Outcome.FAILED: logging.ERROR,
    Outcome.CANCELLED: logging.INFO,
    Outcome.SUPERSEDED: logging.INFO,
    Outcome.RESCHEDULED: logging.INFO,
    Outcome.REQUEUED: logging.WARNING,
    Outcome.DROPPED: logging.WARNING,
    Outcome.DUPLICATE: logging.INFO,
    Outcome.MOVED: logging.INFO,
}

#: The worker's line per job (logger ``deferred.worker``), then ``key=value`` extras:
#: ``reason=`` and ``error=`` for a failure, ``retry_in_ms=`` for a retry, ``key=``
#: for a superseded job,
#: ``early_by_ms=`` or ``wait_for_cancels_ms=`` for a reschedule, ``deliveries=``
#: for a requeue, ``ran=here`` or ``ran=elsewhere`` for a duplicate.
JOB_LINE = "job=%s task=%s attempt=%d lateness_ms=%.1f outcome=%s duration_ms=%.1f%s"


class Observer:
    """Told what a worker does, to count or show it. Every method does nothing here:
    an observer overrides what it watches. Called from the worker's threads; an
    observer must be quick and must not raise."""

    def consuming(self, up: bool) -> None:
        """The worker started (``True``) or stopped (``False``) taking jobs."""

    def beat(self) -> None:
        """The consuming loop went round: it is not stuck."""

    def started(self) -> None:
        """A task starts running."""

    def finished(self) -> None:
        """A task that :meth:`started` returned or raised."""

    def timed_out(self, task: str, queue: str, *, hard: bool) -> None:
        """An attempt ran past its soft time limit, or (``hard``) past its grace too;
        its outcome (retrying or failed) follows."""

    def outcome(
        self,
        task: str,
        queue: str,
        outcome: Outcome,
        *,
        lateness_s: float | None = None,
        duration_s: float | None = None,
    ) -> None:
        """A job ended: ``task`` is a task this worker knows, or ``unknown``;
        ``lateness_s`` and ``duration_s`` are given when its task ran."""

    def attempt_started(self, job: Job, at: datetime, *, redelivered: bool) -> None:
        """An attempt of ``job`` starts running at ``at`` (``redelivered``: the broker
        delivered its message before). :meth:`started` counts; this names the job."""

    def job_ended(
        self,
        job: Job,
        outcome: Outcome,
        at: datetime,
        *,
        value: Any = None,
        error: BaseException | None = None,
        reason: str | None = None,
    ) -> None:
        """``job`` ended with ``outcome`` at ``at``, just before :meth:`outcome` is told:
        with what its task returned (``value``) or raised (``error``), and the failure's
        ``reason``. :meth:`outcome` is for counts (its labels are bounded); this is for
        a record of each job."""


class Observers(Observer):
    """Several observers as one: each is told in turn."""

    def __init__(self, observers: Iterable[Observer | None]) -> None:
        self._all = tuple(o for o in observers if o is not None)

    def consuming(self, up: bool) -> None:
        for observer in self._all:
            observer.consuming(up)

    def beat(self) -> None:
        for observer in self._all:
            observer.beat()

    def started(self) -> None:
        for observer in self._all:
            observer.started()

    def finished(self) -> None:
        for observer in self._all:
            observer.finished()

    def timed_out(self, task: str, queue: str, *, hard: bool) -> None:
        for observer in self._all:
            observer.timed_out(task, queue, hard=hard)

    def outcome(
        self,
        task: str,
        queue: str,
        outcome: Outcome,
        *,
        lateness_s: float | None = None,
        duration_s: float | None = None,
    ) -> None:
        for observer in self._all:
            observer.outcome(task, queue, outcome, lateness_s=lateness_s, duration_s=duration_s)

    def attempt_started(self, job: Job, at: datetime, *, redelivered: bool) -> None:
        for observer in self._all:
            observer.attempt_started(job, at, redelivered=redelivered)

    def job_ended(
        self,
        job: Job,
        outcome: Outcome,
        at: datetime,
        *,
        value: Any = None,
        error: BaseException | None = None,
        reason: str | None = None,
    ) -> None:
        for observer in self._all:
            observer.job_ended(job, outcome, at, value=value, error=error, reason=reason)
