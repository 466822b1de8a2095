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

import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from deferred.broker import COPY_HEADER, BrokerUnavailable
from deferred.broker import ledger_index as ledger_io
from deferred.conf import DeferredSettings, get_settings
from deferred.core.delays import delay_ms
from deferred.core.jobs import BrokenMessage, Job, due_ms_of, looks_like_id
from deferred.core.ledger_index import Waiting
from deferred.core.moves import MOVED_COPY, RACE_S, new_gen
from deferred.core.topology import plan_topology
from deferred.producer.publishing import Prepared, dispatch, prepare_built
from deferred.records import checkpoints
from deferred.records.recording import keeps_result

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
    #: Its row, when it is pending.
    row: Waiting | None = None


def look(
    settings: DeferredSettings,
    job_id: str,
    *,
    timeout: float = LOOK_TIMEOUT_S,
    with_job: bool = True,
) -> Look:
    """Whether ``job_id`` is pending, and the job as it waits (its newest record; not
    read without ``with_job``: its row says what a listing shows).

    Reads, on one connection, the newest checkpoint's head, the ledger's tail, the
    cancels, the page that holds the job and its record; and, if it is due
    already, the results."""
    if not isinstance(job_id, str) or not looks_like_id(job_id):
        raise ValueError(f"{job_id!r} is not a job id (32 hexadecimal digits).")
    try:
        return _look(settings, job_id, timeout, with_job)
    except BrokerUnavailable:
        # What this process kept was of streams since declared again, or a spare
        # connection had gone: once more, without them.
        checkpoints.forget(settings)
    try:
        return _look(settings, job_id, timeout, with_job)
    except checkpoints.Stale:
        # The newest checkpoint's pages are gone: the whole ledger.
        return _look(settings, job_id, timeout, with_job, whole=True)


def _look(
    settings: DeferredSettings, job_id: str, timeout: float, with_job: bool, whole: bool = False
) -> Look:
    started = time.monotonic()
    first_due = due_ms_of(job_id)
    with ledger_io.StreamSession(settings.broker_urls, timeout=timeout) as session:
        # The page of the job's first due time (or the away page of an id without
        # one), beside the head's tail and the cancels.
        head = None if whole else checkpoints.cached_head(settings)
        page = (
            checkpoints.in_parallel(
                checkpoints.find_row_alone, settings, head, job_id, first_due, timeout
            )
            if head is not None
            else None
        )
        state = checkpoints.read_state(settings, session, whole=whole)
        view = state.view
        if page is not None and state.head is not head:
            page.cancel()  # the head changed meanwhile: its own page
            page = None
        if page is None and state.head is not None:
            page = checkpoints.in_parallel(
                checkpoints.find_row_alone, settings, state.head, job_id, first_due, timeout
            )
        row = state.tail.get(job_id) or (page.result() if page is not None else None)
        moved = view.moves.due(job_id)
        if row is None and state.head is not None and moved is not None:
            row = checkpoints.find_row(settings, session, state.head, job_id, int(moved * 1000))
        job = _job_at(settings, session, row) if with_job else None
        if job_id in view:
            return Look(job, "cancelled", row)
        if view.keys.is_superseded(job_id):
            return Look(job, "superseded", row)
        if row is None or view.moves.is_stale(job_id, row.gen, row.attempt):
            return Look(None, "unknown")
    left = max(0.1, timeout - (time.monotonic() - started))
    pending = list(
        checkpoints.pending_rows(
            settings,
            state,
            iter([row]) if job_id not in state.tail else iter(()),
            timeout=left,
            started_from_ms=row.due_ms - checkpoints.RESULTS_MARGIN_MS
            if row.due_ms <= time.time() * 1000 + 1000
            else None,
        )
    )
    if any(r.id == job_id for r in pending):
        return Look(job, "pending", row)
    return Look(job, "started", row)


def _job_at(
    settings: DeferredSettings, session: ledger_io.StreamSession, row: Waiting | None
) -> Job | None:
    """The job whose newest record ``row`` points at, read from the ledger."""
    if row is None:
        return None
    plan = plan_topology(settings)
    assert plan.ledger_queue is not None
    for offset, body, _headers in session.read_at(plan.ledger_queue.name, row.offset, 1):
        if offset == row.offset:
            try:
                job = Job.decode(body)
            except BrokenMessage:
                return None
            return job if job.id == row.id else None
    return None


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
    if not isinstance(job_id, str) or not looks_like_id(job_id):
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
    # Its copy may be starting as this publishes, or another move of it due now may
    # be (a double click): run only if no attempt of it started.
    if job.due <= now + timedelta(seconds=RACE_S) or due <= now + timedelta(seconds=RACE_S):
        if job.due <= now + timedelta(seconds=RACE_S) and not (
            settings.results and keeps_result(job)
        ):
            raise JobNotPending(job.id, "due now, and it keeps no results to tell if it started")
        prepared = Prepared(
            prepared.job,
            prepared.wait_ms,
            prepared.body,
            prepared.on_commit,
            {**prepared.headers, COPY_HEADER: MOVED_COPY},
        )
    dispatch([prepared], settings)
    return due
