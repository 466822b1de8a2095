"""``defer()``: validate everything, then publish one job into the delay topology.

Every check happens before the broker is touched, so a call that raises has
published nothing. Inside ``transaction.atomic()`` the publish waits for the
commit (by default), so a rolled-back view never leaves a job behind that
points at rows that do not exist.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from deferred import broker
from deferred.conf import DeferredSettings, get_settings
from deferred.delays import delay_ms
from deferred.jobs import Job, new_job_id, utcnow
from deferred.tasks import Task, get_task
from deferred.topology import plan_topology

logger = logging.getLogger("deferred.publishing")

#: Pushed by ``deferred.testing`` (eager and capture modes): the newest one
#: receives each job instead of the broker.
interceptors: list[Callable[[Job, int], None]] = []
interceptors_lock = threading.Lock()


def defer(
    task: Task[..., Any] | str,
    delay: int | float | timedelta | datetime,
    /,
    *args: Any,
    **kwargs: Any,
) -> str:
    """Run ``task(*args, **kwargs)`` once ``delay`` has passed; return the job id.

    ``delay`` is seconds (int or float), a ``timedelta``, or an aware
    ``datetime`` ("at that time"; a past time means now). It is rounded *up*
    to ``DEFERRED['RESOLUTION']``: a job never runs early. Raises
    ``ValueError`` or ``TypeError`` for a bad delay, an unknown task, a queue
    that is not configured or arguments the task cannot take or JSON cannot
    carry; ``deferred.broker.BrokerError`` if the broker cannot take the job.
    """
    settings = get_settings()
    resolved = _resolve(task)
    queue = resolved.target_queue or settings.default_queue
    if queue not in settings.queues:
        raise ValueError(
            f"Queue {queue!r} of task {resolved.name!r} is not in DEFERRED['QUEUES'] "
            f"{list(settings.queues)!r}: add it there and run declare_delay_topology."
        )
    resolved.check_arguments(args, kwargs)
    now = utcnow()
    wait_ms = delay_ms(
        delay, now=now, resolution_ms=settings.resolution_ms, max_delay_ms=settings.max_delay_ms
    )
    job = Job(
        id=new_job_id(),
        task=resolved.name,
        args=args,
        kwargs=kwargs,
        due=now + timedelta(milliseconds=wait_ms),
        queue=queue,
        created=now,
    )
    body = job.encode()  # TypeError now, in the caller, if the arguments are not JSON
    if interceptors:
        interceptors[-1](job, wait_ms)
        return job.id
    on_commit = resolved.options.on_commit
    aliases = _atomic_aliases() if (settings.on_commit if on_commit is None else on_commit) else []
    if not aliases:
        publish(job, wait_ms, settings=settings, body=body)
        return job.id
    # Published once every open transaction has committed; if any rolls back,
    # its callback is discarded and the job is never published.
    waiting = set(aliases)
    lock = threading.Lock()

    def committed(alias: str) -> None:
        with lock:
            waiting.discard(alias)
            last = not waiting
        if last:
            _publish_after_commit(job, settings)

    for alias in aliases:
        transaction.on_commit(partial(committed, alias), using=alias)
    return job.id


def _atomic_aliases() -> list[str]:
    """The database aliases with a transaction open here."""
    aliases = []
    if transaction.get_connection(DEFAULT_DB_ALIAS).in_atomic_block:
        aliases.append(DEFAULT_DB_ALIAS)
    for connection in connections.all(initialized_only=True):
        if connection.alias != DEFAULT_DB_ALIAS and connection.in_atomic_block:
            aliases.append(str(connection.alias))
    return aliases


def _publish_after_commit(job: Job, settings: DeferredSettings) -> None:
    """Publish once the transaction committed, waiting only for what is left of the delay.

    The commit has happened, so raising would only turn the caller's
    successful request into an error: the failure is logged loudly instead,
    with the whole job, so that it can be deferred again by hand.
    """
    try:
        wait_ms = delay_ms(
            job.due,
            now=utcnow(),
            resolution_ms=settings.resolution_ms,
            max_delay_ms=settings.max_delay_ms,
        )
        publish(job, wait_ms, settings=settings)
    except Exception:
        logger.critical(
            "Job %s of task %s was NOT published after its transaction committed; "
            "it will not run unless deferred again. Job: %s",
            job.id,
            job.task,
            job.encode().decode(),
            exc_info=True,
        )


def _resolve(task: object) -> Task[..., Any]:
    if isinstance(task, Task):
        # A Task object that was never registered (or was replaced) would be
        # unknown to the worker: insist on the registered one by name.
        registered = get_task(task.name)
        if registered.func is not task.func:
            raise ValueError(f"Task {task.name!r} is not the function registered under that name.")
        return task
    if isinstance(task, str):
        return get_task(task)
    raise TypeError(
        f"defer() needs a @task-decorated function or a registered task name, got {task!r}."
    )


def publish(
    job: Job, wait_ms: int, *, settings: DeferredSettings | None = None, body: bytes | None = None
) -> None:
    """Publish ``job`` to wait ``wait_ms`` (already validated) in the current topology."""
    settings = settings or get_settings()
    body = job.encode() if body is None else body
    plan = plan_topology(settings)
    broker.publisher(settings.broker_url).publish(
        plan.ingest_exchange,
        plan.routing_key(wait_ms, job.queue),
        body,
        message_id=job.id,
    )
