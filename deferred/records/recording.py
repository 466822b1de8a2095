"""Writing results: the worker's :class:`Recorder` (a record when an attempt starts
and one when it ends, many jobs to a stream message) and the record of a re-drive.

Why the records go out after the ack, batched, and what that costs a worker
killed outright: see :mod:`deferred.records.results`.
"""

from __future__ import annotations

import math
import threading
import uuid
from datetime import datetime
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.core.jobs import Job, due_of, utcnow
from deferred.core.outcomes import Observer, Outcome
from deferred.core.topology import RESULT_ROUTING_KEY, plan_topology
from deferred.records import result_cache
from deferred.records.result_format import (
    LAST_EVENTS,
    STARTED_AFTER_S,
    encode,
    error_of,
    id_ms,
    signed,
    value_record,
)

#: The most attempts whose "started" record a worker keeps for the cache: far more
#: than run at once; past it, the oldest (an attempt that never ended) goes.
MAX_STARTS = 10_000


#: The outcomes a result records, as its events; the others leave the job pending.
RESULT_EVENTS = {
    Outcome.SUCCEEDED: "succeeded",
    Outcome.FAILED: "failed",
    Outcome.RETRYING: "retrying",
    Outcome.CANCELLED: "cancelled",
    Outcome.SUPERSEDED: "superseded",
    Outcome.DROPPED: "dropped",
}


class Recorder(Observer):
    """The worker's side: turns what happens to a job into records for the writer.

    One of the worker's observers: told each attempt that starts and each job that
    ends, it records those of jobs that keep results (:func:`keeps_result`)."""

    def __init__(self, settings: DeferredSettings, worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        plan = plan_topology(settings)
        keys = settings.signing_keys
        self.writer = broker.ResultWriter(
            settings.broker_urls,
            plan.ingest_exchange,
            RESULT_ROUTING_KEY,
            lambda records: signed(encode(records), keys),
            timeout=settings.publish_timeout_s,
        )
        self._started = False
        self._lock = threading.Lock()
        #: Puts finished results in ``RESULT_CACHE`` too, if one is set.
        self.cache = (
            None
            if settings.result_cache is None
            else result_cache.CachePutter(
                settings, settings.result_cache, lambda records: signed(encode(records), keys)
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

    def attempt_started(self, job: Job, at: datetime, *, redelivered: bool) -> None:
        if keeps_result(job):
            self.record_start(job, at, redelivered=redelivered)

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
        if outcome is Outcome.MOVED:
            # The copy left behind by a move: where the moved copy's records are.
            if isinstance(value, int) and keeps_result(job):
                self.writer.write({"id": job.id, "ev": "moved", "at": at.timestamp(), "to": value})
            return
        event = RESULT_EVENTS.get(outcome)
        if event is not None and keeps_result(job):
            self.record_end(job, event, at, value=value, error=error, reason=reason)

    def record_start(self, job: Job, at: datetime, *, redelivered: bool = False) -> None:
        """An attempt starts: its "started" record goes out ``STARTED_AFTER_S`` from now,
        unless the attempt ended first and :meth:`record_end` folded it into its own.

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

    def record_end(
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
            if started is None:  # a redelivery (see record_start())
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
    body, headers = signed(encode([_with_call(record, job)]), settings.signing_keys)
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
    if run != id_ms(job.id):
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
