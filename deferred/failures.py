"""What goes into the failed queue: the whole job and why it failed.

A failed job is never dropped. Its record keeps everything needed to
understand it (reason, exception, traceback) and to run it again (the job
itself, or the raw body when it could not even be read).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import traceback
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.jobs import Job, utcnow
from deferred.topology import plan_topology

#: The job's task raised.
TASK_ERROR = "task_error"
#: No task is registered under the job's name in this worker.
UNKNOWN_TASK = "unknown_task"
#: The body is not a job this version can read.
UNDECODABLE = "undecodable"

REASON_HEADER = "x-deferred-reason"


def failure_record(
    *,
    reason: str,
    job: Job | None,
    body: bytes,
    error: BaseException | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    """The JSON document stored in the failed queue."""
    record: dict[str, Any] = {
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


def store_failure(settings: DeferredSettings, record: dict[str, Any], message_id: str) -> None:
    """Publish ``record`` to the failed queue, confirmed, before the job is acked."""
    plan = plan_topology(settings)
    broker.publisher(settings.broker_url).publish(
        "",
        plan.failed_queue.name,
        json.dumps(record, default=repr).encode(),
        message_id=message_id,
        headers={REASON_HEADER: record["reason"]},
    )
