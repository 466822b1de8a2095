"""Results without a table: ``deferred.result(job_id)``, read from a RabbitMQ stream.

Where they live: ``PREFIX.results``, a stream (replicated on a cluster like
the cancels) that RabbitMQ keeps for ``RESULT_TTL`` and trims by whole
segments. A worker appends a record when an attempt starts and one when it
ends (succeeded, failed, retrying, cancelled or superseded); a record is a few
hundred bytes of JSON, and the records of many jobs share one stream message
(:class:`deferred.broker.results.ResultWriter` sends what arrived within its
linger, or while the previous message waited for its confirm), so the broker
sees a few messages a second per worker, not two per job.

A job is acked as soon as it ends. Its records go out with other jobs' within
the writer's ``LINGER_S`` (50 ms): one message for many jobs, which a look-up
reads as one (see below), and no job waits for a confirm. The price is a
window: a worker killed outright (``SIGKILL``, the machine lost) takes with it
the records of the jobs that ended in its last ``LINGER_S`` or so. Such a job
reads as the last record of it that did go out: "running" if it ran longer
than ``STARTED_AFTER_S``, else "pending", until ``RESULT_TTL``. A worker that
stops (``SIGTERM``, recycling, a hard time limit) writes everything first. A
record the broker cannot take within ``PUBLISH_TIMEOUT`` is lost the same
way, and logged. Acking each job only once its record was confirmed closed
the window, but held the job's prefetch slot through the linger and the
confirm: a worker draining a backlog ran at 27-29% of its rate without
results (``docs/bench/capacity.md``). A job never runs twice for a result.

How a result is found without an index: a job id carries the job's first due
time (:func:`deferred.core.jobs.due_of`), and no attempt starts before it (never
early). RabbitMQ streams can be read from a timestamp, so the reader starts
at the due time (less ``CLOCK_SLACK_S``, for a worker whose clock runs ahead
of the broker's) and reads forward until the job's final record, which for a
job that ran on time is a few messages in. The cost is what was written
between the job's due time and its end, not the stream's length: a job that
finished a day ago costs the same as one that finished a minute ago, and a
look-up that finds the end in what the stream first delivers writes nothing.
A job still waiting or running is read to the end of the stream, which the
reader proves with a marker of its own, written once the stream has gone
quiet (a fresh stream consumer learns of the stream's contents a moment
after it subscribed, so nothing short of a message it wrote itself says
"nothing more"). So is a failed one: the failed list may run it again
(``deferred_failed retry``) under the same id, and that new run, whose
records follow the failure, supersedes it (see :func:`fold`).

What bounds a look-up: an id whose due time is older than ``RESULT_TTL``
reads ``pending`` at once, without a read (the stream keeps nothing older,
give or take a segment). The price: once ``RESULT_TTL`` has passed since its
id's due time, a job reads ``pending`` even if it ran within ``RESULT_TTL``
(after a backlog that long, retries spread that far, or a late re-drive).
Within ``RESULT_TTL``, a job due
long ago that never ran (an unknown id, or a backlog) costs a read of
everything written since, and ``timeout`` bounds it: a read that runs out of
time returns what it read so far with ``Result.complete`` false, rather than
raising, since it is no broker failure and a partial answer (a failed job,
say, that no later run was found for) is usually right.

A shared Django cache can answer first (``RESULT_CACHE``): workers put
there the results of jobs that ended on their first attempt, once the stream
confirmed them, and a look-up that finds one reads nothing from the stream
(:mod:`deferred.records.result_cache`). The stream stays the record.

Why not the alternatives: a table is what the app does not have; a cache
alone may drop a result at any moment; a queue per job does not scale to
millions of jobs; and the cancels' approach, every reader holding every
record in memory, is right for ids that stay few but not for a record per
job. Stream filtering (RabbitMQ 3.13+) could let the broker skip chunks of
other jobs; the read is already bounded by the job's own life, so it is not
used.

Records are signed with the jobs' key: a reader ignores a record whose
signature does not match, so a forged "succeeded" is never shown. Results
are off for a task with ``@task(result=False)`` and for the whole project
with ``DEFERRED['RESULTS'] = False``: then nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from deferred import broker
from deferred.broker.results import ReadEnd
from deferred.conf import DeferredSettings, get_settings
from deferred.core.jobs import due_of, utcnow
from deferred.core.topology import RESULT_ROUTING_KEY, plan_topology
from deferred.records import result_cache
from deferred.records.result_format import (
    CANCELLED,
    CLOCK_SLACK_S,
    FAILED,
    FINAL_EVENTS,
    LAST_EVENTS,
    PENDING,
    STATE_OF,
    SUCCEEDED,
    decode,
    encode_marker,
    id_marker,
    id_ms,
    iso,
    marker_of,
    moment,
)


class JobCancelled(Exception):
    """How django.tasks sees a cancelled or superseded job: FAILED with this error
    (the framework has no status for a task that was not to run)."""

    # The path a result records and the framework imports it from: the public one.
    __module__ = "deferred.results"


@dataclass(frozen=True)
class ResultError:
    """An attempt's exception: its class path, message and traceback."""

    type: str
    message: str
    traceback: str = ""


@dataclass(frozen=True)
class Result:
    """What is known of one job. ``state`` is one of ``pending`` (not started, waiting
    for a retry, or an id nothing was recorded for), ``running``, ``succeeded``,
    ``failed`` and ``cancelled`` (cancelled, or superseded by a later job of its key)."""

    id: str
    state: str = PENDING
    #: The last event recorded: ``started``, ``retrying``, ``succeeded``, ``failed``,
    #: ``cancelled``, ``superseded`` or ``dropped``; ``None`` if none.
    outcome: str | None = None
    task: str | None = None
    #: Attempts started (retries included).
    attempts: int = 0
    started_at: datetime | None = None
    last_attempted_at: datetime | None = None
    finished_at: datetime | None = None
    #: The worker of each attempt started, in order.
    workers: tuple[str, ...] = ()
    #: The return value, if it succeeded and the value was kept.
    value: Any = None
    #: False when the task returned a value JSON cannot carry or over RESULT_MAX_BYTES.
    value_kept: bool = True
    #: Every failed attempt's error, oldest first; ``error`` is the last.
    errors: tuple[ResultError, ...] = ()
    #: Why it failed, for a failed job (``task_error``, ``timed_out``...).
    reason: str | None = None
    #: django.tasks jobs: the backend alias, the arguments and when it was enqueued.
    backend: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    enqueued_at: datetime | None = None
    #: django.tasks jobs: the DEFERRED queue, the priority and the ``run_after`` (its first
    #: due time; ``None`` for a task enqueued to run at once) it was enqueued with.
    queue: str | None = None
    #: ``None`` in records written before it was recorded: the task's own then stands.
    priority: int | None = None
    run_after: datetime | None = None
    #: False when the look-up ran out of its ``timeout`` before it could rule out
    #: later records: the state is what the records read by then add up to.
    complete: bool = True

    @property
    def worker(self) -> str | None:
        """The worker of the last attempt."""
        return self.workers[-1] if self.workers else None

    @property
    def error(self) -> ResultError | None:
        return self.errors[-1] if self.errors else None

    @property
    def finished(self) -> bool:
        return self.state in (SUCCEEDED, FAILED, CANCELLED)

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for JSON (the status page, ``deferred_status --result``)."""
        return {
            "id": self.id,
            "state": self.state,
            "outcome": self.outcome,
            "task": self.task,
            "attempts": self.attempts,
            "started_at": iso(self.started_at),
            "last_attempted_at": iso(self.last_attempted_at),
            "finished_at": iso(self.finished_at),
            "worker": self.worker,
            "workers": list(self.workers),
            "value": self.value,
            "value_kept": self.value_kept,
            "errors": [vars(e) for e in self.errors],
            "reason": self.reason,
            "complete": self.complete,
        }


# ---------------------------------------------------------------------- reading


def result(job_id: str, *, timeout: float | None = None) -> Result:
    """What is known of job ``job_id`` (the id ``defer()`` returned), from the results
    stream: its state and, once it ended, its outcome.

    An id nothing was recorded for reads ``pending``: not started yet, or
    unknown, or older than ``RESULT_TTL``; nothing can tell these apart
    without a table. An id whose due time is older than ``RESULT_TTL`` reads
    ``pending`` at once, without reading the stream.

    The read takes ``timeout`` seconds at most (default: ``PUBLISH_TIMEOUT``):
    if it runs out first, the result is what the records read by then say,
    with ``complete`` false (a job due long ago behind a busy stream). Raises
    ``ValueError`` for a string that is not a job id, and
    ``deferred.BrokerUnavailable`` if no broker node answers or the
    connection is lost.
    """
    return lookup(get_settings(), job_id, timeout=timeout)


def lookup(settings: DeferredSettings, job_id: str, *, timeout: float | None = None) -> Result:
    """:func:`result` under ``settings`` (the worker's, which may not be the project's)."""
    since = _since(job_id)
    if _beyond_retention(job_id, settings):
        return Result(id=job_id)
    # Before the id's due time too: a job run_now() moved may have ended.
    cached = _from_cache(settings, job_id)
    if cached is not None:
        return cached
    if since > utcnow():
        # Not due yet: a worker writes its first record once the job is due.
        return Result(id=job_id)
    records, complete = _read(settings, job_id, since, timeout)
    to_ms = moved_to(records)
    if to_ms is not None and to_ms / 1000 < since.timestamp():
        # Moved earlier (deferred.core.moves): its run's records are from there on.
        records, complete = _read(settings, job_id, _ms(to_ms - CLOCK_SLACK_S * 1000), timeout)
    found = fold(job_id, records)
    return found if complete else replace(found, complete=False)


def lookup_from(
    settings: DeferredSettings, job_id: str, since: datetime, *, timeout: float | None = None
) -> Result:
    """:func:`lookup`, reading from ``since``: for a copy of a job moved earlier than the
    time its id carries (``deferred.core.moves``), whose runs are recorded from then."""
    records, complete = _read(settings, job_id, since, timeout)
    found = fold(job_id, records)
    return found if complete else replace(found, complete=False)


def moved_to(records: Iterable[dict[str, Any]]) -> int | None:
    """Where the latest ``moved`` record among ``records`` says the job's run went (ms)."""
    to = None
    for record in records:
        if record.get("ev") == "moved" and type(record.get("to")) is int:
            to = record["to"]
    return to


def _ms(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


async def aresult(job_id: str, *, timeout: float | None = None) -> Result:
    """:func:`result` for async code: the read runs in a thread, not on the loop."""
    from asgiref.sync import sync_to_async

    return await sync_to_async(result, thread_sensitive=False)(job_id, timeout=timeout)


def _since(job_id: str) -> datetime:
    due = due_of(job_id)
    if due is None:
        raise ValueError(f"{job_id!r} is not a job id (defer() returns one).")
    return due - timedelta(seconds=CLOCK_SLACK_S)


def _from_cache(settings: DeferredSettings, job_id: str) -> Result | None:
    """The job's result from ``RESULT_CACHE``, if it is there, signed right, and final
    (:mod:`deferred.records.result_cache` says what is put there); else ``None``."""
    entry = result_cache.get(settings, job_id)
    if entry is None:
        return None
    found = fold(job_id, decode(*entry, settings.signing_keys if settings.signing else None))
    return found if found.outcome in LAST_EVENTS else None


def _beyond_retention(job_id: str, settings: DeferredSettings) -> bool:
    """Whether ``job_id``'s due time is older than the stream keeps records: reading
    would cost everything the stream holds, to find what it no longer has."""
    due = due_of(job_id)
    return due is not None and due < utcnow() - timedelta(milliseconds=settings.result_ttl_ms)


def _read(
    settings: DeferredSettings, job_id: str, since: datetime, timeout: float | None
) -> tuple[list[dict[str, Any]], bool]:
    """The records of ``job_id`` from ``since`` on, and whether the read is complete:
    it reached a record no later one can change, or the end of the stream."""
    found: list[dict[str, Any]] = []
    keys = settings.signing_keys if settings.signing else None
    marker = id_marker(job_id)

    def on_message(body: bytes, headers: dict[str, Any]) -> bool:
        # Cheap first: most messages hold other jobs' records only.
        if marker not in body:
            return False
        records = decode(body, headers, keys)
        mine = [r for r in records if r.get("id") == job_id]
        if not mine:
            return False
        found.extend(mine)
        # Not the first final record seen: a duplicate run's end after a
        # re-driven one's start must not stop the read (fold has the rules).
        return fold(job_id, found).outcome in LAST_EVENTS

    reader = _reader(settings)
    end = reader.read(
        since,
        on_message,
        marker_body=encode_marker,
        is_marker=marker_of,
        timeout=settings.publish_timeout_s if timeout is None else timeout,
    )
    return found, end is not ReadEnd.OUT_OF_TIME


def started_attempts(settings: DeferredSettings, since: datetime, timeout: float) -> dict[str, int]:
    """Every job with a record from ``since`` on, and the highest attempt its records
    name: one read of the stream for many jobs (the keeper's check after a restart).

    ``BrokerUnavailable`` if the read cannot reach the end within ``timeout``:
    a partial answer would make jobs look as if they never started.
    """
    keys = settings.signing_keys if settings.signing else None
    seen: dict[str, int] = {}

    def on_message(body: bytes, headers: dict[str, Any]) -> bool:
        for record in decode(body, headers, keys):
            job_id, attempt = record.get("id"), record.get("a")
            if isinstance(job_id, str):
                a = attempt if isinstance(attempt, int) else 1
                seen[job_id] = max(seen.get(job_id, 0), a)
        return False

    end = _reader(settings).read(
        since, on_message, marker_body=encode_marker, is_marker=marker_of, timeout=timeout
    )
    if end is ReadEnd.OUT_OF_TIME:
        raise broker.BrokerUnavailable(
            f"Reading the results from {since.isoformat()} took more than {timeout:g} s."
        )
    return seen


def each_record(
    settings: DeferredSettings,
    since: datetime,
    on_record: Callable[[dict[str, Any]], None],
    *,
    timeout: float,
    pace: Callable[[], None] | None = None,
) -> bool:
    """Hand ``on_record`` every record written from ``since`` on, up to the end of the
    stream; ``False`` if that took more than ``timeout`` (the records read so far
    were handed over). ``pace``: called at each message (a checkpoint's reads keep
    to a rate with it)."""
    keys = settings.signing_keys if settings.signing else None

    def on_message(body: bytes, headers: dict[str, Any]) -> bool:
        if pace is not None:
            pace()
        for record in decode(body, headers, keys):
            on_record(record)
        return False

    end = _reader(settings).read(
        since, on_message, marker_body=encode_marker, is_marker=marker_of, timeout=timeout
    )
    return end is not ReadEnd.OUT_OF_TIME


def _reader(settings: DeferredSettings) -> broker.ResultReader:
    plan = plan_topology(settings)
    return _cached_reader(
        settings.broker_urls,
        plan.results_queue.name,
        plan.ingest_exchange,
        settings.publish_timeout_s,
    )


@lru_cache(maxsize=8)
def _cached_reader(
    urls: tuple[str, ...], stream: str, exchange: str, timeout: float
) -> broker.ResultReader:
    return broker.ResultReader(urls, stream, exchange, RESULT_ROUTING_KEY, timeout)


def fold(job_id: str, records: Iterable[dict[str, Any]]) -> Result:
    """The result the records of ``job_id`` (in stream order) add up to. Pure.

    Records come in runs: a job deferred runs once, with its retries; a
    re-drive from the failed list runs it again under the same id, and its
    records carry ``"run"``, the re-driven job's first due time in ms (the
    first run's records leave it out: it is the id's due time). A later run
    supersedes what an earlier one ended with; its attempts, workers and
    errors add to the earlier ones'. Within a run the first end stands: a
    record after it is a duplicate delivery (at least once), and is ignored,
    as is a record of an earlier run than one already seen.
    """
    state, outcome, task, reason = PENDING, None, None, None
    attempts = earlier_attempts = 0
    started_at = last_at = finished_at = None
    workers: list[str] = []
    errors: list[ResultError] = []
    value, kept = None, True
    extra: dict[str, Any] = {}
    first_run = id_ms(job_id)
    current: int | None = None
    for record in records:
        event = record.get("ev")
        if event not in STATE_OF or record.get("id") != job_id:
            continue
        run = _run_of(record, first_run)
        if current is not None and run < current:
            continue  # an earlier run's record, after a later run began
        if current is not None and run > current:
            # A re-driven run: what the earlier one ended with no longer stands.
            earlier_attempts += attempts
            attempts = 0
            finished_at = reason = None
            value, kept = None, True
        elif outcome in FINAL_EVENTS:
            continue  # a duplicate run after the end (at least once): the first end stands
        current = run
        at = moment(record.get("at"))
        task = record.get("task", task)
        attempt = record.get("a")
        if isinstance(attempt, int):
            attempts = max(attempts, attempt)
        if isinstance(record.get("b"), str) and not extra:
            extra = {
                "backend": record["b"],
                "args": tuple(record.get("args") or ()),
                "kwargs": dict(record.get("kwargs") or {}),
                "enqueued_at": moment(record.get("c")),
                "queue": record.get("q") if isinstance(record.get("q"), str) else None,
                "priority": record.get("p") if type(record.get("p")) is int else None,
                "run_after": moment(record.get("ra")),
            }
        # A final record of an attempt that ended within STARTED_AFTER_S carries
        # its start ("st", "w"): that attempt had no "started" record of its own.
        start = at if event == "started" else moment(record.get("st"))
        if start is not None:
            started_at = started_at or start
            last_at = start
            if isinstance(record.get("w"), str):
                workers.append(record["w"])
        if event != "started":
            if isinstance(record.get("err"), dict):
                err = record["err"]
                errors.append(
                    ResultError(str(err.get("type")), str(err.get("msg")), str(err.get("tb", "")))
                )
            if event in FINAL_EVENTS:
                finished_at = at
                reason = record.get("reason")
            if event == "succeeded":
                kept = bool(record.get("kept", True))
                value = record.get("value") if kept else None
        state, outcome = STATE_OF[event], event
    return Result(
        id=job_id,
        state=state,
        outcome=outcome,
        task=task,
        attempts=earlier_attempts + attempts,
        started_at=started_at,
        last_attempted_at=last_at,
        finished_at=finished_at,
        workers=tuple(workers),
        value=value,
        value_kept=kept,
        errors=tuple(errors),
        reason=reason,
        **extra,
    )


def _run_of(record: dict[str, Any], first_run: int) -> int:
    run = record.get("run")
    return run if isinstance(run, int) and not isinstance(run, bool) else first_run


def render_text(found: Result) -> str:
    """A result as ``deferred_status --job`` prints it."""
    state = found.state + (
        f" ({found.outcome})" if found.outcome and found.outcome != found.state else ""
    )
    if found.outcome is None:
        state += ": not started yet, or no record (an unknown id, or older than RESULT_TTL)"
    lines = [f"job {found.id}: {state}"]
    if not found.complete:
        lines.append("  (the look-up ran out of time: this is as far as the stream was read)")
    rows = [
        ("task", found.task),
        ("attempts", found.attempts or None),
        ("started", iso(found.started_at)),
        ("finished", iso(found.finished_at)),
        ("worker", found.worker),
        ("reason", found.reason),
    ]
    lines += [f"  {name}: {value}" for name, value in rows if value is not None]
    if found.state == SUCCEEDED:
        kept = json.dumps(found.value) if found.value_kept else "not kept (not JSON, or too large)"
        lines.append(f"  returned: {kept}")
    for n, error in enumerate(found.errors, 1):
        lines.append(f"  error {n}: {error.type}: {error.message}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the records
