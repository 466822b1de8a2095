"""``defer()``: validate everything, then publish one job into the delay topology.

Every check happens before the broker is touched, so a call that raises has
published nothing. Inside ``transaction.atomic()`` the publish waits for the
commit (by default), so a rolled-back view never leaves a job behind that
points at rows that do not exist.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import connections, transaction

from deferred import broker
from deferred.conf import DeferredSettings, get_settings
from deferred.core import priorities, signing, tracing
from deferred.core.delays import delay_ms
from deferred.core.jobs import Job, new_job_id, utcnow
from deferred.core.topology import CANCEL_ROUTING_KEY, plan_topology
from deferred.producer.tasks import Task, get_task, publishers

logger = logging.getLogger("deferred.publishing")

#: Pushed by ``deferred.testing`` (eager and capture modes): the newest one
#: receives each job instead of the broker.
interceptors: list[Callable[[Job, int], None]] = []
interceptors_lock = threading.Lock()

#: With ``DECLARE`` off, the (process, settings) whose topology was found
#: complete: checked before the first publish of each process, not every job.
#: The process id is part of the key, so a forked child checks for itself.
_verified: set[tuple[int, DeferredSettings]] = set()
_verified_lock = threading.Lock()


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
    prepared = prepare(task, delay, args, kwargs, settings, utcnow())
    dispatch([prepared], settings)
    return prepared.job.id


def defer_many(calls: Iterable[Sequence[Any]]) -> list[str]:
    """Defer many jobs at once; return their ids in order.

    Each call is ``(task, delay, args)`` or ``(task, delay, args, kwargs)``.
    Every call is validated before anything is published: if one is bad,
    none is. The jobs are then published in one AMQP transaction (with the
    on-commit rule of ``defer()``), which is several times faster than one
    ``defer()`` per job.
    """
    settings = get_settings()
    prepared = prepare_many(calls, settings)
    dispatch(prepared, settings)
    return [p.job.id for p in prepared]


def prepare_many(calls: Iterable[Sequence[Any]], settings: DeferredSettings) -> list[Prepared]:
    """Every check ``defer_many()`` makes, for every call, before any is published."""
    now = utcnow()
    prepared = []
    for n, call in enumerate(calls):
        if not isinstance(call, Sequence) or isinstance(call, str) or len(call) not in (3, 4):
            raise TypeError(
                f"defer_many() call #{n} must be (task, delay, args) or "
                f"(task, delay, args, kwargs), got {call!r}."
            )
        task, delay, args, *rest = call
        kwargs = rest[0] if rest else {}
        if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
            raise TypeError(f"defer_many() call #{n}: args must be a tuple, kwargs a dict.")
        prepared.append(prepare(task, delay, tuple(args), kwargs, settings, now))
    return prepared


def submit(
    job: Job,
    wait_ms: int,
    *,
    on_commit: bool | None = None,
    settings: DeferredSettings | None = None,
    on_published: Callable[[], None] | None = None,
    body: bytes | None = None,
) -> None:
    """Publish a job built elsewhere (by the django.tasks backend) under ``defer()``'s rules.

    The caller has validated the job; this encodes it (``TypeError`` for
    arguments JSON cannot carry) and publishes it now, after the commit of the
    surrounding transactions, or into a test mode, exactly as ``defer()`` would.
    ``on_published`` runs once it is, never for a rolled-back transaction.
    ``body`` is ``job.encode()`` when the caller has it already.
    """
    settings = settings or get_settings()
    dispatch([prepare_built(job, wait_ms, on_commit, settings, body)], settings, on_published)


def prepare_built(
    job: Job,
    wait_ms: int,
    on_commit: bool | None,
    settings: DeferredSettings,
    body: bytes | None = None,
) -> Prepared:
    """A job built elsewhere, ready to publish: encoded, size-checked, traced."""
    body = job.encode() if body is None else body
    check_size(job, body, settings)
    commit = settings.on_commit if on_commit is None else on_commit
    return Prepared(job, wait_ms, body, commit, _headers(job, wait_ms))


def _headers(job: Job, wait_ms: int) -> dict[str, Any]:
    """The headers a new job is published with: its trace context, and for a keyed
    job the routing key that also puts a copy of it in the cancels stream
    (``BCC``, which the broker removes on delivery; ``deferred.core.keys``)."""
    headers: dict[str, Any] = dict(tracing.producer_headers(job, wait_ms))
    if job.key is not None or job.gen is not None:  # a moved job too (deferred.core.moves)
        headers["BCC"] = [CANCEL_ROUTING_KEY]
    return headers


@dataclass(frozen=True)
class Prepared:
    """A checked job, its body and whether it waits for the commit: ready to publish."""

    job: Job
    wait_ms: int
    body: bytes
    on_commit: bool
    #: The trace context of the ``defer`` span (deferred.core.tracing), and a keyed job's
    #: ``BCC`` (``_headers``); empty for a plain job without OpenTelemetry.
    headers: Mapping[str, Any] = field(default_factory=dict)


def prepare(
    task: object,
    delay: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    settings: DeferredSettings,
    now: datetime,
) -> Prepared:
    """Every check ``defer()`` makes, and the job it would publish."""
    resolved = _resolve(task)
    queue = resolved.target_queue or settings.default_queue
    if queue not in settings.queues:
        raise ValueError(
            f"Queue {queue!r} of task {resolved.name!r} is not in DEFERRED['QUEUES'] "
            f"{list(settings.queues)!r}: add it there and run declare_delay_topology."
        )
    resolved.check_arguments(args, kwargs)
    wait_ms = delay_ms(
        delay, now=now, resolution_ms=settings.resolution_ms, max_delay_ms=settings.max_delay_ms
    )
    due = now + timedelta(milliseconds=wait_ms)
    job = Job(
        id=new_job_id(due, now=now),
        task=resolved.name,
        args=args,
        kwargs=kwargs,
        due=due,
        queue=queue,
        created=now,
        priority=resolved.target_priority,
        key=resolved.options.key,
    )
    body = encode(job, settings)  # now, in the caller: arguments not JSON, or too big
    on_commit = resolved.options.on_commit
    return Prepared(
        job,
        wait_ms,
        body,
        settings.on_commit if on_commit is None else on_commit,
        _headers(job, wait_ms),
    )


def dispatch(
    prepared: list[Prepared],
    settings: DeferredSettings,
    on_published: Callable[[], None] | None = None,
) -> None:
    """Hand prepared jobs to a test mode, publish them now, or after the commit.

    ``on_published`` runs once all of them are published (or handed to a test
    mode); never if a transaction rolls back or the publish fails.
    """
    if interceptors:
        for p in prepared:
            interceptors[-1](p.job, p.wait_ms)
        if on_published:
            on_published()
        return
    aliases = atomic_aliases() if any(p.on_commit for p in prepared) else []
    immediate = [p for p in prepared if not (aliases and p.on_commit)]
    later = [p for p in prepared if aliases and p.on_commit]
    if immediate:
        try:
            publish_prepared(immediate, settings)
        except broker.BrokerError as exc:
            exc.job_ids = tuple(p.job.id for p in immediate)
            exc.job_id = exc.job_ids[0]
            raise
    if not later:
        if on_published:
            on_published()
        return
    # Published once every open transaction has committed; if any rolls back,
    # its callback is discarded and the jobs are never published.
    waiting = set(aliases)
    lock = threading.Lock()

    def committed(alias: str) -> None:
        with lock:
            waiting.discard(alias)
            last = not waiting
        if last and _publish_after_commit(later, settings) and on_published:
            on_published()

    for alias in aliases:
        transaction.on_commit(partial(committed, alias), using=alias)


def _check_topology(settings: DeferredSettings) -> None:
    """With ``DECLARE`` off, make sure the infrastructure created the topology.

    Without this, a missing delay queue would only show up as jobs in the
    failed queue (or an unroutable publish): better a clear error naming it
    before the first job is published.
    """
    if settings.declare:
        return
    key = (os.getpid(), settings)
    if key in _verified:
        return
    # Only what defer() and cancel() publish to: a publisher's broker user
    # may have no right on the rest (see deferred.operate.permissions).
    broker.verify_exchange(
        settings.broker_urls,
        plan_topology(settings),
        plan_topology(settings).ingest_exchange,
        timeout=settings.publish_timeout_s,
    )
    note_verified(settings)


def note_verified(settings: DeferredSettings) -> None:
    """Someone in this process (the worker, at connect) found the topology complete."""
    with _verified_lock:
        _verified.add((os.getpid(), settings))


def publish_prepared(prepared: list[Prepared], settings: DeferredSettings) -> None:
    if len(prepared) == 1:
        p = prepared[0]
        publish(p.job, p.wait_ms, settings=settings, body=p.body, headers=p.headers)
        return
    _check_topology(settings)
    plan = plan_topology(settings)
    broker.publisher_for(settings).publish_many(
        [
            broker.Outgoing(
                plan.ingest_exchange,
                plan.routing_key(p.wait_ms, p.job.queue),
                p.body,
                p.job.id,
                {**p.headers, **signing.sign(p.body, settings.signing_keys)},
                priorities.level(p.job.priority),
            )
            for p in prepared
        ]
    )


def atomic_aliases() -> list[str]:
    """The database aliases with a transaction open here."""
    # A connection in an atomic block has been used in this thread, so it is
    # among the initialized ones.
    return [str(c.alias) for c in connections.all(initialized_only=True) if c.in_atomic_block]


def _publish_after_commit(prepared: list[Prepared], settings: DeferredSettings) -> bool:
    """Publish once the transaction committed, waiting only for what is left of each delay.

    The commit has happened, so raising would only turn the caller's
    successful request into an error: the failure is logged loudly instead,
    with the whole jobs, so that they can be deferred again by hand.
    """
    try:
        now = utcnow()
        due_now = [
            replace(
                p,
                wait_ms=delay_ms(
                    p.job.due,
                    now=now,
                    resolution_ms=settings.resolution_ms,
                    max_delay_ms=settings.max_delay_ms,
                ),
            )
            for p in prepared
        ]
        publish_prepared(due_now, settings)
        return True
    except Exception:
        for p in prepared:
            logger.critical(
                "Job %s of task %s was NOT published after its transaction committed; "
                "it will not run unless deferred again. Job: %s",
                p.job.id,
                p.job.task,
                p.body.decode(),
                exc_info=True,
            )
        return False


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
    job: Job,
    wait_ms: int,
    *,
    settings: DeferredSettings | None = None,
    body: bytes | None = None,
    headers: Mapping[str, Any] | None = None,
) -> None:
    """Publish ``job`` to wait ``wait_ms`` (already validated) in the current topology.

    ``headers`` go with it besides its signature (a trace context).
    """
    settings = settings or get_settings()
    if body is None:
        # A retry carries one more worker name: it may outgrow the limit, and
        # the worker would then refuse it unread. ValueError here instead:
        # the worker records the whole job as failed, to be re-driven.
        body = job.encode()
        check_size(job, body, settings)
    _check_topology(settings)
    plan = plan_topology(settings)
    broker.publisher_for(settings).publish(
        plan.ingest_exchange,
        plan.routing_key(wait_ms, job.queue),
        body,
        message_id=job.id,
        headers={**(headers or {}), **signing.sign(body, settings.signing_keys)},
        priority=priorities.level(job.priority),
    )


def encode(job: Job, settings: DeferredSettings) -> bytes:
    """The job's body; ``TypeError`` for arguments JSON cannot carry, ``ValueError`` if too big.

    A big body would sit in the broker's memory or disk for the whole delay:
    pass an id and load the data when the task runs.
    """
    body = job.encode()
    check_size(job, body, settings)
    return body


def check_size(job: Job, body: bytes, settings: DeferredSettings) -> None:
    """``ValueError`` if ``body`` is over ``MAX_MESSAGE_BYTES``."""
    if len(body) > settings.max_message_bytes:
        raise ValueError(
            f"The job of task {job.task!r} is {len(body):,} bytes once encoded, more than "
            f"DEFERRED['MAX_MESSAGE_BYTES'] ({settings.max_message_bytes:,}): pass the id of "
            "the data (a row, a file) rather than the data itself."
        )


publishers["defer"] = defer  # Task.defer()
