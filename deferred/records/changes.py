"""Changing what is pending: ``run_now()``, ``reschedule()``, and cancels by filter.

A move publishes the job again under its id, due at the new time, as
:mod:`deferred.core.moves` explains; the copy left in the delay line is
dropped when it comes due. What this module adds is the look first: only a
job that is still pending is moved (:func:`look`), and a job whose current
copy is due within :data:`RACE_S` of the publish (it may be starting now) is
moved as a copy that a worker runs only if no attempt of it started. So
whichever way a move meets the job's own due time, the job runs once.

A job that keeps no results cannot be moved once it is due (or within
:data:`RACE_S` of it): nothing would tell whether its copy in the delay line
started.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from deferred.broker import COPY_HEADER
from deferred.conf import DeferredSettings, get_settings
from deferred.core.delays import delay_ms
from deferred.core.jobs import Job, looks_like_id
from deferred.core.moves import MOVED_COPY, new_gen
from deferred.core.pending_jobs import Starts, is_pending
from deferred.producer.publishing import Prepared, dispatch, prepare_built
from deferred.records import pending as ledger_records
from deferred.records.cancels import read_cancels
from deferred.records.recording import keeps_result
from deferred.records.result_format import CLOCK_SLACK_S
from deferred.records.results import each_record

#: A job whose current copy is due within this of the move may be starting as it is
#: moved (clocks apart, the time the look took): its moved copy runs only if it did not.
RACE_S = 2.0
#: How long the look at one job may read.
LOOK_TIMEOUT_S = 30.0


class JobNotPending(ValueError):
    """The job cannot be changed: it is not waiting to run (``state`` says why)."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(f"Job {job_id} is not pending ({state}): there is nothing to change.")
        self.job_id = job_id
        self.state = state


@dataclass(frozen=True)
class Look:
    """A job as one look found it: its newest record and its state."""

    job: Job | None
    #: "pending", "started" (running or ended: its result says which), "cancelled",
    #: "superseded", or "unknown" (no record in the ledger).
    state: str


def look(settings: DeferredSettings, job_id: str, *, timeout: float = LOOK_TIMEOUT_S) -> Look:
    """Whether ``job_id`` is pending, and the job as it waits (its newest record)."""
    found = ledger_records.find(settings, job_id, timeout=timeout, newest=True)
    job = found.job
    if job is None:
        return Look(None, "unknown")
    view = read_cancels(settings, timeout=timeout)
    gen = view.moves.gen(job_id)
    if gen is not None and job.gen != gen:
        # A move's copy is in the ledger before its record in the cancels is read.
        again = ledger_records.find(settings, job_id, timeout=timeout, newest=True).job
        job = again if again is not None else job
    starts = Starts()
    since = job.due - timedelta(seconds=CLOCK_SLACK_S)
    if since <= datetime.now(UTC) and settings.results:
        each_record(settings, since, starts.add, timeout=timeout)
    if job_id in view:
        return Look(job, "cancelled")
    if view.keys.is_superseded(job_id):
        return Look(job, "superseded")
    pending = is_pending(
        job,
        starts=starts,
        cancelled=lambda _: False,
        superseded=lambda _: False,
        now=datetime.now(UTC),
        keeps_result=keeps_result if settings.results else (lambda _: False),
    )
    return Look(job, "pending" if pending else "started")


def reschedule(job_id: str, delay: object) -> datetime:
    """Move the pending job ``job_id`` to run after ``delay`` (as ``defer()`` takes it:
    seconds, a ``timedelta`` or an aware ``datetime``) from now; return its new due time.

    The job keeps its id, task and arguments, runs once and never before the
    new time; the copy it had in the delay line is dropped when it comes due.
    Raises ``JobNotPending`` for a job that started, ended, was cancelled or
    superseded, or that the ledger has no record of; ``TypeError`` or
    ``ValueError`` for a bad id or delay; ``deferred.BrokerError`` if the
    broker cannot take the move.
    """
    settings = get_settings()
    if not looks_like_id(job_id):
        raise ValueError(f"{job_id!r} is not a job id (32 hexadecimal digits).")
    # The delay first: a bad one is refused before any read.
    delay_ms(
        delay,
        now=datetime.now(UTC),
        resolution_ms=settings.resolution_ms,
        max_delay_ms=settings.max_delay_ms,
    )
    found = look(settings, job_id)
    if found.state != "pending" or found.job is None:
        raise JobNotPending(job_id, found.state)
    return _move(settings, found.job, delay)


def run_now(job_id: str) -> datetime:
    """Run the pending job ``job_id`` as soon as a worker is free, once: ``reschedule``
    with no delay. Returns the time it is due now; raises as ``reschedule`` does."""
    return reschedule(job_id, 0)


def _move(settings: DeferredSettings, job: Job, delay: object) -> datetime:
    now = datetime.now(UTC)
    wait = delay_ms(
        delay, now=now, resolution_ms=settings.resolution_ms, max_delay_ms=settings.max_delay_ms
    )
    due = now + timedelta(milliseconds=wait)
    moved = replace(job, due=due, first_due_at=job.first_due, gen=new_gen())
    prepared = prepare_built(moved, wait, False, settings)
    if job.due <= now + timedelta(seconds=RACE_S):
        if not (settings.results and keeps_result(job)):
            raise JobNotPending(job.id, "due now, and it keeps no results to tell if it started")
        # Its copy may be starting as this publishes: run only if it did not.
        prepared = Prepared(
            prepared.job,
            prepared.wait_ms,
            prepared.body,
            prepared.on_commit,
            {**prepared.headers, COPY_HEADER: MOVED_COPY},
        )
    dispatch([prepared], settings)
    return due
