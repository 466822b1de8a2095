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
from dataclasses import dataclass
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.jobs import BrokenMessage, Job, new_job_id, utcnow
from deferred.topology import plan_topology

#: The task raised and is not retried (no retries configured, or a permanent error).
TASK_ERROR = "task_error"
#: The task raised on its last allowed attempt.
RETRIES_EXHAUSTED = "retries_exhausted"
#: No task is registered under the job's name in this worker.
UNKNOWN_TASK = "unknown_task"
#: The body is not JSON at all.
UNDECODABLE = "undecodable"
#: JSON, but not a job of a format this version knows.
INVALID = "invalid"
#: Delivered too many times without being acked: it keeps killing workers.
DELIVERY_LIMIT = "delivery_limit"
#: A delayed job found no route after its first hop (e.g. an undeclared queue).
UNROUTABLE = "unroutable"

REASON_HEADER = "x-deferred-reason"


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
        "detail": detail or (str(error) if error else reason),
        "failed_at": utcnow().isoformat(),
        "worker": f"{socket.gethostname()}:{os.getpid()}",
        "job": job.to_dict() if job else None,
        "attempts": job.attempt if job else None,
        "due": job.due.isoformat() if job else None,
        "error": None,
    }
    if error is not None:
        record["error"] = {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error)),
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
    broker.publisher(settings.broker_url).publish(
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
        job = Job.decode(body)
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
            job = Job.decode(json.dumps(data["job"]).encode())
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
