"""The failed queue: what goes in, and how to read it back.

A failed job is never dropped. The worker stores a record with the whole job
(or the raw body when it could not even be read), the reason and the
exception with its traceback. Two other kinds of message reach the failed
queue through RabbitMQ itself, as the bare job: a delayed job that found no
route after its first hop (alternate exchange) and a job dead-lettered by a
quorum ready queue past its delivery limit. :func:`parse_failed` reads all
three the same way.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.delays import delay_ms
from deferred.jobs import INVALID as INVALID
from deferred.jobs import UNDECODABLE as UNDECODABLE
from deferred.jobs import BrokenMessage, Job, new_job_id, utcnow
from deferred.publishing import publish
from deferred.retries import RETRIES_EXHAUSTED as RETRIES_EXHAUSTED
from deferred.retries import TASK_ERROR as TASK_ERROR
from deferred.topology import plan_topology

# Why a job is in the failed queue: TASK_ERROR and RETRIES_EXHAUSTED (decided by
# the retry policy), UNDECODABLE and INVALID (by the job format), imported above
# from where they are decided, and these:

#: No task is registered under the job's name in this worker.
UNKNOWN_TASK = "unknown_task"
#: Delivered too many times without being acked: it keeps killing workers.
DELIVERY_LIMIT = "delivery_limit"
#: A delayed job found no route after its first hop (e.g. an undeclared queue).
UNROUTABLE = "unroutable"

REASON_HEADER = "x-deferred-reason"


def describe(error: BaseException) -> str:
    """``str(error)``, even for an exception whose ``__str__`` itself fails."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the job
        return f"<{type(error).__name__} whose message cannot be printed>"


def _traceback(error: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(error))
    except Exception:  # noqa: BLE001
        return f"<traceback of {type(error).__name__} cannot be printed>"


def failure_record(
    *,
    reason: str,
    job: Job | None,
    body: bytes,
    error: BaseException | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    """The JSON document the worker stores in the failed queue."""
    record: dict[str, Any] = {
        # A job keeps its id; an unreadable body gets one, so it can be purged by id.
        "id": job.id if job else new_job_id(),
        "task": job.task if job else None,
        "reason": reason,
        "detail": detail or (describe(error) if error else reason),
        "failed_at": utcnow().isoformat(),
        "worker": f"{socket.gethostname()}:{os.getpid()}",
        "job": job.to_dict() if job else None,
        "attempts": job.attempt if job else None,
        # When the job was first due; a retried job's last attempt was due later.
        "due": job.first_due.isoformat() if job else None,
        "error": None,
    }
    if error is not None:
        record["error"] = {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": describe(error),
            "traceback": _traceback(error),
        }
    if job is None:
        try:
            record["raw_body"] = body.decode()
        except UnicodeDecodeError:
            record["raw_body_base64"] = base64.b64encode(body).decode()
    return record


def store_failure(settings: DeferredSettings, record: dict[str, Any]) -> None:
    """Publish ``record`` to the failed queue, confirmed, before the job is acked."""
    plan = plan_topology(settings)
    broker.publisher(settings.broker_urls, settings.publish_timeout_s).publish(
        "",
        plan.failed_queue.name,
        json.dumps(record, default=repr).encode(),
        message_id=record["id"],
        headers={REASON_HEADER: record["reason"]},
    )


@dataclass(frozen=True)
class FailedJob:
    """One entry of the failed queue, whatever put it there."""

    id: str
    task: str | None
    reason: str
    attempts: int | None
    #: ``"module.Type: message"``, or a description of what went wrong.
    error: str | None
    traceback: str | None
    due: str | None
    failed_at: str | None
    #: The job itself, when it can be run again.
    job: Job | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task,
            "reason": self.reason,
            "attempts": self.attempts,
            "error": self.error,
            "traceback": self.traceback,
            "due": self.due,
            "failed_at": self.failed_at,
            "queue": self.job.queue if self.job else None,
            "args": list(self.job.args) if self.job else None,
            "kwargs": self.job.kwargs if self.job else None,
        }


def parse_failed(body: bytes, headers: dict[str, Any], message_id: str | None) -> FailedJob:
    """Read one message of the failed queue."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and "reason" in data and "job" in data:
        return _from_record(data)
    try:
        job = Job.from_dict(data) if isinstance(data, dict) else Job.decode(body)
    except BrokenMessage as exc:
        return FailedJob(
            id=message_id or "",
            task=None,
            reason=INVALID,
            attempts=None,
            error=str(exc),
            traceback=None,
            due=None,
            failed_at=None,
            job=None,
        )
    deaths = headers.get("x-death") or []
    death_reason = str(deaths[0].get("reason", "")) if deaths else ""
    if death_reason == "delivery_limit":
        reason, error = DELIVERY_LIMIT, "delivered too many times without an ack (worker crashes?)"
    else:
        reason, error = UNROUTABLE, "no route to its ready queue (run declare_delay_topology)"
    return FailedJob(
        id=job.id,
        task=job.task,
        reason=reason,
        attempts=job.attempt,
        error=error,
        traceback=None,
        due=job.due.isoformat(),
        failed_at=None,
        job=job,
    )


def _from_record(data: dict[str, Any]) -> FailedJob:
    job = None
    if isinstance(data.get("job"), dict):
        try:
            job = Job.from_dict(data["job"])
        except BrokenMessage:
            job = None
    error = data.get("error")
    error_text: str | None
    if isinstance(error, dict):
        error_text = f"{error.get('type')}: {error.get('message')}"
        trace = error.get("traceback")
    else:
        error_text, trace = data.get("detail"), None
    return FailedJob(
        id=str(data.get("id") or (job.id if job else "")),
        task=data.get("task") or (job.task if job else None),
        reason=str(data["reason"]),
        attempts=data.get("attempts"),
        error=error_text,
        traceback=trace,
        due=data.get("due"),
        failed_at=data.get("failed_at"),
        job=job,
    )


# --------------------------------------------------------------------------- operations


@dataclass
class Outcome:
    """What a re-drive or purge did, by job id."""

    done: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def list_failed(settings: DeferredSettings) -> list[FailedJob]:
    """Every entry of the failed queue, oldest first; the queue is left as it was."""
    plan = plan_topology(settings)
    with broker.admin_channel(settings.broker_urls) as admin:
        if not admin.queue_exists(plan.failed_queue.name):
            raise broker.TopologyNotDeclared(
                f"The failed queue {plan.failed_queue.name!r} does not exist. "
                "Run `python manage.py declare_delay_topology`."
            )
        with admin.take_all(plan.failed_queue.name) as (_channel, taken):
            return [parse_failed(t.body, t.headers, t.message_id) for t in taken]


def _select(
    settings: DeferredSettings,
    ids: list[str] | None,
    act: Callable[[FailedJob], str | None],
) -> Outcome:
    """Apply ``act`` to the chosen entries (``ids``, or all if ``None``), acking each
    one only after ``act`` succeeded for it. ``act`` returns a reason to skip, or None.

    Entries not acked go back to the queue when the channel closes, so a
    crash at any point leaves each job either still failed or handled.
    """
    plan = plan_topology(settings)
    outcome = Outcome()
    wanted = None if ids is None else set(ids)
    with broker.admin_channel(settings.broker_urls) as admin:
        with admin.take_all(plan.failed_queue.name) as (channel, taken):
            chosen = []
            for message in taken:
                entry = parse_failed(message.body, message.headers, message.message_id)
                if wanted is None or entry.id in wanted:
                    chosen.append((message, entry))
            for message, entry in chosen:
                skip = act(entry)
                if skip:
                    outcome.skipped.append((entry.id, skip))
                    continue
                channel.basic_ack(message.tag)
                outcome.done.append(entry.id)
    found = set(outcome.done) | {entry_id for entry_id, _ in outcome.skipped}
    outcome.missing = sorted((wanted or set()) - found)
    return outcome


def redrive(settings: DeferredSettings, ids: list[str] | None, delay_s: float = 0) -> Outcome:
    """Defer the chosen failed jobs again, after ``delay_s``, as a fresh first attempt.

    Each one is published (and confirmed) before its failed entry is acked.
    """

    # A bad delay is refused before any entry is touched. A number of
    # seconds gives the same wait whenever it is asked, so once is enough.
    wait_ms = delay_ms(
        delay_s,
        now=utcnow(),
        resolution_ms=settings.resolution_ms,
        max_delay_ms=settings.max_delay_ms,
    )

    def act(entry: FailedJob) -> str | None:
        if entry.job is None:
            return "its body could not be read, so there is nothing to run"
        if entry.job.queue not in settings.queues:
            return f"its queue {entry.job.queue!r} is not in DEFERRED['QUEUES']"
        now = utcnow()
        job = replace(
            entry.job,
            attempt=1,
            due=now + timedelta(milliseconds=wait_ms),
            first_due_at=None,
            workers=(),
        )
        publish(job, wait_ms, settings=settings)
        return None

    return _select(settings, ids, act)


def purge(settings: DeferredSettings, ids: list[str] | None) -> Outcome:
    """Delete the chosen failed jobs (all of them if ``ids`` is ``None``)."""
    return _select(settings, ids, lambda entry: None)
