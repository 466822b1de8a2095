"""Which jobs are pending: the ledger's records, less what the other streams say ended.

A job is pending from the moment its publish was confirmed until a worker
starts it (or drops it: cancelled, superseded, moved). Three streams say so,
and this module folds what was read of them into rows (:class:`PendingJob`):

- the ledger (:mod:`deferred.core.ledger`): every copy of every job as it was
  published. The newest record of an id is the job as it now waits (a retry,
  a moved copy, a carried record); of a moved job, the copy of its latest move.
- the results (:mod:`deferred.records.results`): a record when an attempt
  starts (``STARTED_AFTER_S`` after, or with its end for a short one) and when
  it ends. A job whose waiting attempt has a record there is running or done.
- the cancels stream: the cancels, the debounce keys and the moves in force
  (:class:`deferred.records.cancels.CancelView`).

A job that keeps no results (``@task(result=False)``, ``RESULTS = False``)
leaves no record when it runs: it is listed until it is due, and not after.

Pure: the reads are :mod:`deferred.records.pending`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from deferred.core.jobs import Job, due_ms_of

#: How much of a job's arguments a row carries, as JSON: the whole of them up to
#: this, a preview beyond (the job itself, in the ledger, keeps them all).
PREVIEW_BYTES = 1000


@dataclass(frozen=True)
class Filter:
    """What ``pending()`` and ``deferred_jobs list`` select: every field that is set must match."""

    task: str | None = None
    queue: str | None = None
    key: str | None = None
    due_after: datetime | None = None
    due_before: datetime | None = None


@dataclass(frozen=True)
class PendingJob:
    """One pending job, as listed: what it is, where it waits and when it is due."""

    id: str
    task: str
    queue: str
    priority: int
    key: str | None
    #: When it runs, at the earliest (UTC).
    due: datetime
    #: When ``defer()`` made it (UTC).
    enqueued: datetime
    attempt: int
    #: Its arguments, whole if they fit in :data:`PREVIEW_BYTES` of JSON, else ``None``.
    args: list[Any] | None
    kwargs: dict[str, Any] | None
    #: Its arguments as JSON, cut at :data:`PREVIEW_BYTES`.
    preview: str
    #: Whether ``run_now()`` or ``reschedule()`` moved it.
    moved: bool = False

    @property
    def truncated(self) -> bool:
        return self.args is None

    def as_dict(self) -> dict[str, Any]:
        """The row as ``--json`` prints it: times in ISO 8601, UTC."""
        return {
            "id": self.id,
            "task": self.task,
            "queue": self.queue,
            "priority": self.priority,
            "key": self.key,
            "due": self.due.astimezone(UTC).isoformat(),
            "enqueued": self.enqueued.astimezone(UTC).isoformat(),
            "attempt": self.attempt,
            "args": self.args,
            "kwargs": self.kwargs,
            "args_preview": self.preview,
            "truncated": self.truncated,
            "moved": self.moved,
        }


def run_of(job: Job) -> int | None:
    """The run a results record names for ``job`` (``"run"``): ``None`` for the first
    run, whose due time is the id's; a re-driven run's first due time (ms)."""
    run = math.floor(job.first_due.timestamp() * 1000)
    return None if run == due_ms_of(job.id) else run


class Starts:
    """What the results say of each job: the highest attempt of each run that has a
    record (started or ended). Fed the records in any order."""

    def __init__(self) -> None:
        self._highest: dict[tuple[str, int | None], int] = {}

    def add(self, record: dict[str, Any]) -> None:
        job_id = record.get("id")
        if not isinstance(job_id, str) or record.get("ev") not in RECORDED_EVENTS:
            return
        run = record.get("run")
        attempt = record.get("a")
        key = (job_id, run if isinstance(run, int) else None)
        a = attempt if isinstance(attempt, int) else 1
        if a > self._highest.get(key, 0):
            self._highest[key] = a

    def highest(self, job_id: str, run: int | None) -> int:
        """The highest attempt of that run of ``job_id`` with a record (0: none)."""
        return self._highest.get((job_id, run), 0)


#: The results events that mean an attempt began: a re-drive's "retrying" record,
#: written as the job is published again, names no attempt and does not count.
RECORDED_EVENTS = frozenset(
    {"started", "succeeded", "failed", "retrying", "cancelled", "superseded", "dropped"}
)
