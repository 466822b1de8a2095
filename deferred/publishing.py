"""``defer()``: validate everything, then publish one job into the delay topology.

Every check happens before the broker is touched, so a call that raises has
published nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings, get_settings
from deferred.delays import delay_ms
from deferred.jobs import Job, new_job_id, utcnow
from deferred.tasks import Task, get_task
from deferred.topology import plan_topology


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
    publish(job, wait_ms, settings=settings)
    return job.id


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


def publish(job: Job, wait_ms: int, *, settings: DeferredSettings | None = None) -> None:
    """Publish ``job`` to wait ``wait_ms`` (already validated) in the current topology."""
    settings = settings or get_settings()
    body = job.encode()
    plan = plan_topology(settings)
    broker.publisher(settings.broker_url).publish(
        plan.ingest_exchange,
        plan.routing_key(wait_ms, job.queue),
        body,
        message_id=job.id,
    )
