"""Every pending job, from any process: ``deferred.pending()`` and ``deferred_jobs list``.

What is read (:mod:`deferred.records.checkpoints`): the newest checkpoint's
head, its pages from the first that may hold a job of the window (soonest
first, as many as the listing fills), the ledger's tail after the checkpoint,
the cancels stream, and, only when a listed job is already due, the results
since the checkpoint. A first page is a handful of messages whatever the
number of pending jobs; without a checkpoint yet (no worker has run on this
topology) the tail is the whole ledger.

Freshness: see :mod:`deferred.records.checkpoints`. A record lost (a worker
killed before its results went out) leaves a job that ran listed until its
checkpoint row's due time passes ``RESULT_TTL``; a record written twice (a
retried publish, a keeper's copy) is one row: rows are per job id. A job
removed by hand (a queue purged or deleted) is still listed: nothing tells.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime

from deferred.broker import BrokerUnavailable
from deferred.broker.ledger_index import StreamSession
from deferred.conf import get_settings
from deferred.core.ledger_index import Waiting
from deferred.core.pending_jobs import Filter, PendingJob
from deferred.records import checkpoints

#: How long a listing may read, by default: the streams together.
LIST_TIMEOUT_S = 60.0
#: The most rows ``pending()`` returns by default.
DEFAULT_LIMIT = 100


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
    ``ValueError``/``TypeError`` for a bad filter, ``deferred.BrokerUnavailable``
    when the broker cannot be read within ``timeout`` seconds, and
    ``deferred.TopologyNotDeclared`` without a ledger (``LEDGER = False``).
    """
    where = make_filter(task, queue, key, due_after, due_before)
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    return [row.public() for row in rows(where, limit, timeout=timeout)]


def rows(where: Filter, limit: int | None, *, timeout: float) -> list[Waiting]:
    """The rows :func:`pending` returns."""
    try:
        return _rows(where, limit, timeout=timeout)
    except BrokerUnavailable:
        # What this process kept was of streams since declared again, or a spare
        # connection had gone: once more, without them.
        checkpoints.forget(get_settings())
    try:
        return _rows(where, limit, timeout=timeout)
    except checkpoints.Stale:
        # The newest checkpoint's pages are gone (no keeper for longer than they are
        # kept): the whole ledger.
        return _rows(where, limit, timeout=timeout, whole=True)


def _rows(
    where: Filter, limit: int | None, *, timeout: float, whole: bool = False
) -> list[Waiting]:
    settings = get_settings()
    started = time.monotonic()
    with StreamSession(settings.broker_urls, timeout=timeout) as session:
        state = checkpoints.read_state(settings, session, whole=whole)
        head = state.head
        after_ms = None if where.due_after is None else int(where.due_after.timestamp() * 1000)
        before_ms = None if where.due_before is None else int(where.due_before.timestamp() * 1000)
        indexes = head.pages_from(after_ms, before_ms) if head is not None else []

        def base() -> Iterator[Waiting]:
            if head is None:
                return
            for page in checkpoints.read_pages(settings, session, head, indexes):
                yield from page

        # The results are read only if a job that may be listed is due already.
        now_ms = int(time.time() * 1000)
        dues = [r.due_ms for r in state.tail.values() if r.matches(where)]
        if head is not None and indexes:
            dues.append(max(head.pages[indexes[0]].first_ms, after_ms or 0))
        earliest = min(dues, default=None)
        out: list[Waiting] = []
        for row in checkpoints.pending_rows(
            settings,
            state,
            base(),
            timeout=max(0.1, timeout - (time.monotonic() - started)),
            started_from_ms=earliest - checkpoints.RESULTS_MARGIN_MS
            if earliest is not None and earliest <= now_ms + 1000
            else None,
        ):
            if row.matches(where):
                out.append(row)
                if limit is not None and len(out) >= limit:
                    break
        return out


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
