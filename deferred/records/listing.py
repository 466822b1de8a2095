"""Every pending job, from any process: ``deferred.pending()`` and ``deferred_jobs``.

What is read, in this order (:mod:`deferred.core.pending_jobs` folds it):

1. the ledger stream, from its start to a marker this read writes: every job
   published while the stream kept it (``LEDGER_KEEP_MS``; the keeper writes
   the record of a job still pending again before it gets that old,
   :func:`deferred.core.ledger.to_carry`);
2. the cancels stream, whole: the cancels, keys and moves in force;
3. the results stream, from the earliest due time among the jobs that match
   (no attempt starts before it is due): which of them started. A listing of
   jobs due later than now reads nothing there.

Freshness: a job is listed once its ``defer()`` returned, and leaves the list
once the stream that says so has its record: a cancel, key or move at once
(confirmed before it returned), a start within ``STARTED_AFTER_S`` and the
results writer's linger (a few hundred milliseconds) after it began. The
read is a snapshot: what happens while it reads may or may not be in it.

A record lost (a worker killed before its results went out) leaves a job that
ran listed until its due time passes ``RESULT_TTL``; a record written twice
(a retried publish, a keeper's copy) is one row: rows are per job id.

Cost: the read is of the whole ledger, so it grows with what was published
within the retention, not with what is pending. It is bounded by ``timeout``:
``BrokerUnavailable`` beyond it, never a partial list.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from deferred import broker
from deferred.broker.results import ReadEnd
from deferred.conf import DeferredSettings, get_settings
from deferred.core import signing
from deferred.core.jobs import BrokenMessage, Job
from deferred.core.pending_jobs import Filter, PendingJob, Starts, is_pending, newest, select
from deferred.core.topology import plan_topology
from deferred.records import pending as ledger_records
from deferred.records.cancels import CancelView, read_cancels
from deferred.records.recording import keeps_result
from deferred.records.result_format import CLOCK_SLACK_S, encode_marker, marker_of
from deferred.records.results import each_record

#: How long a listing may read, by default: the three streams together.
LIST_TIMEOUT_S = 60.0
#: The most rows ``pending()`` returns by default.
DEFAULT_LIMIT = 100
#: The first moment a stream read can start from: everything it keeps.
_START = datetime(1970, 1, 2, tzinfo=UTC)


@dataclass(frozen=True)
class Snapshot:
    """The pending jobs as one read found them: every one that matches, soonest first."""

    jobs: dict[str, Job]
    view: CancelView
    starts: Starts
    read_at: datetime


def pending(
    task: str | None = None,
    queue: str | None = None,
    key: str | None = None,
    due_after: datetime | None = None,
    due_before: datetime | None = None,
    limit: int | None = DEFAULT_LIMIT,
    *,
    timeout: float = LIST_TIMEOUT_S,
) -> list[PendingJob]:
    """The pending jobs that match, soonest due first: at most ``limit`` (``None``: all).

    ``task`` is a task's name (``@task(name=...)`` or its dotted path),
    ``due_after``/``due_before`` aware datetimes (a job due exactly at
    ``due_after`` matches, one due at ``due_before`` does not). Raises
    ``ValueError`` for a bad filter, ``deferred.BrokerUnavailable`` when the
    broker cannot be read within ``timeout`` seconds, and
    ``deferred.TopologyNotDeclared`` without a ledger (``LEDGER = False``).
    """
    where = make_filter(task, queue, key, due_after, due_before)
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    settings = get_settings()
    snap = snapshot(settings, where, timeout=timeout)
    return select(snap.jobs.values(), where, limit)


def make_filter(
    task: str | None,
    queue: str | None,
    key: str | None,
    due_after: datetime | None,
    due_before: datetime | None,
) -> Filter:
    """A :class:`Filter`, its values checked: ``ValueError``/``TypeError`` says which is bad."""
    for name, value in (("task", task), ("queue", queue), ("key", key)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"{name} must be a non-empty str or None, got {value!r}")
    for name, moment in (("due_after", due_after), ("due_before", due_before)):
        if moment is not None and (not isinstance(moment, datetime) or moment.tzinfo is None):
            raise ValueError(f"{name} must be an aware datetime or None, got {moment!r}")
    return Filter(task, queue, key, due_after, due_before)


def snapshot(settings: DeferredSettings, where: Filter, *, timeout: float) -> Snapshot:
    """Read the three streams (see the module's docstring) for the jobs ``where`` selects."""
    deadline = _Deadline(timeout)
    plan = plan_topology(settings)
    if plan.ledger_queue is None:
        raise broker.TopologyNotDeclared(
            "The ledger is off (DEFERRED['LEDGER'] = False): there is no record of pending jobs."
        )
    read_at = datetime.now(UTC)
    records = _read_ledger(settings, where, deadline.left())
    view = read_cancels(settings, timeout=deadline.left())
    jobs = newest(records, view.moves.gen)
    starts = Starts()
    dues = [j.due for j in jobs.values()]
    earliest = min(dues, default=None)
    if earliest is not None and earliest <= datetime.now(UTC) + timedelta(seconds=CLOCK_SLACK_S):
        _read_results(settings, earliest - timedelta(seconds=CLOCK_SLACK_S), starts, deadline)
    now = datetime.now(UTC)
    waiting = {
        job_id: job
        for job_id, job in jobs.items()
        if is_pending(
            job,
            starts=starts,
            cancelled=view.__contains__,
            superseded=view.keys.is_superseded,
            now=now,
            keeps_result=_keeps_result(settings),
        )
    }
    return Snapshot(waiting, view, starts, read_at)


def _keeps_result(settings: DeferredSettings) -> Any:
    if not settings.results:
        return lambda job: False
    return keeps_result


def _read_ledger(settings: DeferredSettings, where: Filter, timeout: float) -> list[Job]:
    """Every job record in the ledger that ``where`` may select, in stream order."""
    keys = settings.signing_keys if settings.signing else None
    out: list[Job] = []
    # Job bodies are compact JSON: a record of another task is skipped undecoded.
    task_needle = None if where.task is None else f'"task":{json.dumps(where.task)}'.encode()

    def on_message(body: bytes, headers: dict[str, Any]) -> bool:
        if not body or (task_needle is not None and task_needle not in body):
            return False
        try:
            job = Job.decode(body)
            if keys is not None:
                signing.verify(body, headers, keys)
        except (BrokenMessage, ValueError):
            return False  # a marker, or a record a worker would not run either
        out.append(job)
        return False

    plan = plan_topology(settings)
    assert plan.ledger_queue is not None
    reader = ledger_records._reader(
        settings.broker_urls,
        plan.ledger_queue.name,
        plan.ingest_exchange,
        settings.publish_timeout_s,
        ledger_records.CREDIT,
    )
    end = reader.read(
        _START, on_message, marker_body=encode_marker, is_marker=marker_of, timeout=timeout
    )
    if end is ReadEnd.OUT_OF_TIME:
        raise broker.BrokerUnavailable(
            f"Reading the ledger took more than {timeout:g} s; {len(out)} records read."
        )
    return out


def _read_results(
    settings: DeferredSettings, since: datetime, starts: Starts, deadline: _Deadline
) -> None:
    if not each_record(settings, since, starts.add, timeout=deadline.left()):
        raise broker.BrokerUnavailable(
            f"Reading the results from {since.isoformat()} took longer than the listing may."
        )


class _Deadline:
    """What is left of one listing's time, for each of its reads."""

    def __init__(self, timeout: float) -> None:
        self._end = time.monotonic() + timeout

    def left(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise broker.BrokerUnavailable("The listing ran out of time.")
        return left
