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
import math
import threading
import traceback
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from deferred import broker
from deferred.broker.results import ReadEnd
from deferred.conf import DeferredSettings, get_settings
from deferred.core import signing
from deferred.core.jobs import Job, due_ms_of, due_of, utcnow
from deferred.core.topology import RESULT_ROUTING_KEY, plan_topology
from deferred.records import result_cache

FORMAT_VERSION = 1
#: How far before a job's due time the reader starts. A worker starts an attempt
#: once its own clock reaches the due time (the instant the id carries; the
#: deferring host's clock does not enter into it), and the stream stamps the
#: record with the broker's clock. A worker whose clock runs ahead of the
#: broker's by ``d`` writes a record stamped up to ``d`` before the due time; the
#: slack covers ``d`` up to this much. A worker clock behind the broker's only
#: stamps records later, which costs nothing ("never early" asks clocks to
#: agree anyway). Every message stamped within the slack is read before the job's
#: own: at 100 jobs/s, 2 s of slack was about 160 messages and most of a look-up's
#: time, so the slack is what NTP-kept clocks need, with a wide margin.
CLOCK_SLACK_S = 0.25
#: A job shows "running" once it has run this long: the "started" record of an
#: attempt that ends sooner is folded into its final one (one record per job).
STARTED_AFTER_S = 0.2
#: The longest traceback kept with an error.
MAX_TRACEBACK_CHARS = 8000
#: The longest error message kept.
MAX_MESSAGE_CHARS = 2000

#: The states of a result.
PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    "pending",
    "running",
    "succeeded",
    "failed",
    "cancelled",
)
#: Record events that end a run of a job.
FINAL_EVENTS = frozenset({"succeeded", "failed", "cancelled", "superseded", "dropped"})
#: Final events no later run can follow, so the reader stops at one. A "failed" job
#: is in the failed list, and a re-drive runs it again under the same id: after
#: one, the reader reads on to the end of the stream.
LAST_EVENTS = FINAL_EVENTS - {"failed"}
_STATE_OF = {
    "started": RUNNING,
    "retrying": PENDING,
    "succeeded": SUCCEEDED,
    "failed": FAILED,
    "dropped": FAILED,
    "cancelled": CANCELLED,
    "superseded": CANCELLED,
}


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
            "started_at": _iso(self.started_at),
            "last_attempted_at": _iso(self.last_attempted_at),
            "finished_at": _iso(self.finished_at),
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
    if _beyond_retention(job_id, settings) or since > utcnow():
        # Not due yet: a worker writes its first record once the job is due.
        return Result(id=job_id)
    cached = _from_cache(settings, job_id)
    if cached is not None:
        return cached
    records, complete = _read(settings, job_id, since, timeout)
    found = fold(job_id, records)
    return found if complete else replace(found, complete=False)


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
    marker = _id_marker(job_id)

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
    first_run = _id_ms(job_id)
    current: int | None = None
    for record in records:
        event = record.get("ev")
        if event not in _STATE_OF or record.get("id") != job_id:
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
        at = _moment(record.get("at"))
        task = record.get("task", task)
        attempt = record.get("a")
        if isinstance(attempt, int):
            attempts = max(attempts, attempt)
        if isinstance(record.get("b"), str) and not extra:
            extra = {
                "backend": record["b"],
                "args": tuple(record.get("args") or ()),
                "kwargs": dict(record.get("kwargs") or {}),
                "enqueued_at": _moment(record.get("c")),
                "queue": record.get("q") if isinstance(record.get("q"), str) else None,
                "priority": record.get("p") if type(record.get("p")) is int else None,
                "run_after": _moment(record.get("ra")),
            }
        # A final record of an attempt that ended within STARTED_AFTER_S carries
        # its start ("st", "w"): that attempt had no "started" record of its own.
        start = at if event == "started" else _moment(record.get("st"))
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
        state, outcome = _STATE_OF[event], event
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


def _id_ms(job_id: str) -> int:
    """The due time ``job_id`` carries, in ms (0 for what is not a job id): its first
    48 bits, as :func:`deferred.core.jobs.new_job_id` lays them out."""
    return due_ms_of(job_id) or 0


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
        ("started", _iso(found.started_at)),
        ("finished", _iso(found.finished_at)),
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


def encode(records: list[dict[str, Any]]) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, "r": records}, separators=(",", ":")).encode()


def decode(
    body: bytes, headers: dict[str, Any] | None, keys: tuple[str | bytes, ...] | None
) -> list[dict[str, Any]]:
    """The records of one stream message; none if it is not one, or (``keys`` given)
    its signature does not match: a forged record is never read."""
    if keys is not None:
        try:
            signing.verify(body, headers, keys)
        except signing.BadSignature:
            return []
    try:
        data = json.loads(body)
    except ValueError:
        return []
    if not isinstance(data, dict) or data.get("v") != FORMAT_VERSION:
        return []
    records = data.get("r")
    if not isinstance(records, list):
        return []
    return [r for r in records if isinstance(r, dict)]


def encode_marker(token: str) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, "marker": token}).encode()


def marker_of(body: bytes) -> str | None:
    if b'"marker"' not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    token = data.get("marker") if isinstance(data, dict) else None
    return token if isinstance(token, str) else None


def _id_marker(job_id: str) -> bytes:
    return json.dumps(job_id).encode()


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _moment(value: Any) -> datetime | None:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
        return moment if moment.tzinfo is not None else None
    return None


def error_of(error: BaseException) -> dict[str, str]:
    """An exception as a record carries it: class path, message, traceback (cut)."""
    kind = type(error)
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the outcome
        message = f"<{kind.__name__} whose message cannot be printed>"
    try:
        tb = "".join(traceback.format_exception(error))
    except Exception:  # noqa: BLE001
        tb = ""
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "msg": message[:MAX_MESSAGE_CHARS],
        "tb": tb[-MAX_TRACEBACK_CHARS:],
    }


def value_record(value: Any, max_bytes: int) -> dict[str, Any]:
    """``{"value": v}`` if JSON carries ``value`` in ``max_bytes``, else ``{"kept": False}``."""
    if value is None and max_bytes >= 4:  # most tasks return nothing: "null", at no cost
        return {"value": None}
    try:
        text = json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return {"kept": False}
    if len(text.encode()) > max_bytes:
        return {"kept": False}
    return {"value": json.loads(text)}


# ---------------------------------------------------------------------- writing


#: The most attempts whose "started" record a worker keeps for the cache: far more
#: than run at once; past it, the oldest (an attempt that never ended) goes.
MAX_STARTS = 10_000


class Recorder:
    """The worker's side: turns what happens to a job into records for the writer."""

    def __init__(self, settings: DeferredSettings, worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        plan = plan_topology(settings)
        keys = settings.signing_keys
        self.writer = broker.ResultWriter(
            settings.broker_urls,
            plan.ingest_exchange,
            RESULT_ROUTING_KEY,
            lambda records: _signed(encode(records), keys),
            timeout=settings.publish_timeout_s,
        )
        self._started = False
        self._lock = threading.Lock()
        #: Puts finished results in ``RESULT_CACHE`` too, if one is set.
        self.cache = (
            None
            if settings.result_cache is None
            else result_cache.CachePutter(
                settings, settings.result_cache, lambda records: _signed(encode(records), keys)
            )
        )
        #: With a cache: the "started" record of each attempt running, which the
        #: cache entry needs even once it went out on its own (``None``: a
        #: redelivered attempt, which is not cached).
        self._starts: dict[str, dict[str, Any] | None] = {}

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self.writer.start()
                self._started = True

    def stop(self) -> None:
        self.writer.stop()
        if self.cache is not None:
            self.cache.stop()

    def started(self, job: Job, at: datetime, *, redelivered: bool = False) -> None:
        """An attempt starts: its "started" record goes out ``STARTED_AFTER_S`` from now,
        unless the attempt ended first and :meth:`ended` folded it into its own.

        ``redelivered``: the broker delivered this message before, so another
        worker may be running the same attempt (its connection lost): the stream
        keeps the first end of the two, which no single worker knows, so neither
        goes in the cache."""
        record: dict[str, Any] = {
            "id": job.id,
            "ev": "started",
            "at": at.timestamp(),
            "a": job.attempt,
            "w": self.worker_id,
            "task": job.task,
        }
        _with_run(record, job)
        _with_call(record, job)
        if self.cache is not None:
            if len(self._starts) >= MAX_STARTS:  # attempts that never ended (a lost broker)
                self._starts.pop(next(iter(self._starts)), None)
            self._starts[_attempt_key(job)] = None if redelivered else record
        self.writer.delay(_attempt_key(job), record, STARTED_AFTER_S)

    def ended(
        self,
        job: Job,
        event: str,
        at: datetime,
        *,
        value: Any = None,
        error: BaseException | None = None,
        reason: str | None = None,
    ) -> broker.Written:
        """An attempt ended (or the job was dropped): its record goes out in the
        returned message, within ``LINGER_S``. The worker acks the job without
        waiting for it (see the module's docstring)."""
        record: dict[str, Any] = {
            "id": job.id,
            "ev": event,
            "at": at.timestamp(),
            "a": job.attempt,
            "task": job.task,
        }
        _with_run(record, job)
        start = self.writer.take(_attempt_key(job))
        if start is not None:  # ended before its "started" record went out: one record
            record.update(st=start["at"], w=start["w"])
        if event == "succeeded":
            record.update(value_record(value, self.settings.result_max_bytes))
        if error is not None:
            record["err"] = error_of(error)
        if reason is not None:
            record["reason"] = reason
        written = self.writer.write(_with_call(record, job))
        if self.cache is not None:
            self._to_cache(self.cache, written, job, record, folded=start is not None)
        return written

    def _to_cache(
        self,
        cache: result_cache.CachePutter,
        written: broker.Written,
        job: Job,
        record: dict[str, Any],
        *,
        folded: bool,
    ) -> None:
        """Hand the cache the records of an attempt that just ended, if it may hold them
        (``folded``: its start went out in ``record``, not in a record of its own)."""
        key = _attempt_key(job)
        started = None
        if key in self._starts:
            started = self._starts.pop(key)
            if started is None:  # a redelivery (see started())
                return
        # else it never started: dropped as cancelled or superseded
        if not cacheable(record):
            return
        cache.add(written, job.id, [record] if folded or started is None else [started, record])


def record_redrive(settings: DeferredSettings, job: Job) -> None:
    """Write that ``job`` was re-driven from the failed list (``job``: as re-published,
    a fresh first attempt of a new run), so that it reads ``pending`` (``retrying``)
    at once instead of ``failed`` until its new run starts. Nothing when results
    are off for it. ``BrokerError`` if the record cannot be written: the caller
    re-drives the job all the same, and its new run's records say as much later.
    """
    if not settings.results or not keeps_result(job):
        return
    record: dict[str, Any] = {
        "id": job.id,
        "ev": "retrying",
        "at": utcnow().timestamp(),
        "task": job.task,
    }
    _with_run(record, job)
    body, headers = _signed(encode([_with_call(record, job)]), settings.signing_keys)
    plan = plan_topology(settings)
    broker.publisher_for(settings).publish(
        plan.ingest_exchange, RESULT_ROUTING_KEY, body, message_id=uuid.uuid4().hex, headers=headers
    )


def cacheable(record: dict[str, Any]) -> bool:
    """Whether ``record`` (a final record) ends a job whose worker wrote every record
    of it, for ``RESULT_CACHE``: the first attempt of the first run, ended with an
    event no later record changes (:data:`LAST_EVENTS`)."""
    return record.get("ev") in LAST_EVENTS and record.get("a") in (1, None) and "run" not in record


def keeps_result(job: Job) -> bool:
    """Whether ``job``'s results are written: not for ``@task(result=False)``."""
    from deferred.producer.tasks import UnknownTask, get_task

    if job.backend is not None:
        return True
    try:
        return get_task(job.task).result
    except UnknownTask:
        return True


def _attempt_key(job: Job) -> str:
    return f"{job.id}/{job.attempt}"


def _with_run(record: dict[str, Any], job: Job) -> None:
    """A re-driven job's records carry its run: its first due time, in ms, which a
    re-drive sets anew (``deferred.records.failures.redrive``) while retries and
    duplicate deliveries keep it. A first run's equals the id's, and is left out."""
    run = math.floor(job.first_due.timestamp() * 1000)
    if run != _id_ms(job.id):
        record["run"] = run


def _with_call(record: dict[str, Any], job: Job) -> dict[str, Any]:
    """A django.tasks job's records carry its call: the framework's ``TaskResult``
    has its arguments and enqueue time, and ``get_result()`` rebuilds one from any
    record (a job cancelled before it started has no "started" one)."""
    if job.backend is not None:
        record.update(
            b=job.backend,
            args=list(job.args),
            kwargs=job.kwargs,
            c=job.created.isoformat(),
            q=job.queue,
            p=job.priority,
        )
        first_due = due_of(job.id)
        if first_due is not None and first_due > job.created:
            record["ra"] = first_due.isoformat()  # enqueued with a run_after
    return record


def _signed(body: bytes, keys: tuple[str | bytes, ...]) -> tuple[bytes, dict[str, Any]]:
    return body, signing.sign(body, keys)
