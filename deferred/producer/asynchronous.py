"""``adefer()`` and ``adefer_many()``: ``defer()`` for async code, never blocking the loop.

The checks (task, arguments, delay, size) touch no socket: they run in the
caller's coroutine, so a bad call raises there exactly as ``defer()`` would.
The publish and its confirm happen in one publishing thread per process,
which takes the jobs waiting at that moment (up to :data:`BATCH_JOBS`) and
publishes them together (confirms pipelined, one round trip per batch): a
hundred coroutines calling at once cost about five round trips, not a
hundred, and one thread holds the GIL far less than a pool of them
(measured in ``python -m bench --only async``: a pool of eight threads
publishing one job each gave 2,000 jobs/s with the loop's lag p99 at 9-12 ms;
this thread gives 3,300-3,700 jobs/s at 3 ms, and a bare aio-pika publisher
4,500-5,200 at 3.4-5.4 ms, without any of deferred's checks, signing,
failover or TLS).

Transactions belong to the sync thread of ``sync_to_async`` (where an async
view's ORM calls run, and where ``async_to_sync`` was called from inside
``atomic()``): that is where the on-commit rule looks. Inside a transaction,
or in a test mode (whose eager run may use the ORM), the jobs are handed to
that thread, exactly as ``defer()`` would handle them there.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from asgiref.sync import AsyncToSync, sync_to_async

from deferred import broker
from deferred.conf import DeferredSettings, get_settings
from deferred.core.jobs import Job, utcnow
from deferred.producer.publishing import (
    Prepared,
    atomic_aliases,
    dispatch,
    interceptors,
    prepare,
    prepare_built,
    prepare_many,
    publish_prepared,
)
from deferred.producer.tasks import Task, publishers

logger = logging.getLogger("deferred.publishing")

#: At most this many jobs go out in one batch of the publishing thread: pika
#: frames messages in Python, holding the GIL, and a larger batch holds it
#: longer at a stretch (measured with 100 coroutines: 20 kept the loop's lag
#: p99 near 3 ms at 3,300-3,700 jobs/s; 50 gave 5.5-8 ms, 500 gave 9 ms).
BATCH_JOBS = 20


async def adefer(
    task: Task[..., Any] | str,
    delay: int | float | timedelta | datetime,
    /,
    *args: Any,
    **kwargs: Any,
) -> str:
    """``defer()`` for async code: same arguments, checks, errors and on-commit rule.

    ``await adefer(send_reminder, timedelta(hours=24), reminder.pk)`` returns
    the job id once the broker confirmed the job (or, inside a transaction,
    once it is registered to be published after the commit).
    """
    settings = get_settings()
    prepared = prepare(task, delay, args, kwargs, settings, utcnow())
    await _adispatch([prepared], settings)
    return prepared.job.id


async def adefer_many(calls: Iterable[Sequence[Any]]) -> list[str]:
    """``defer_many()`` for async code: all calls checked before any is published."""
    settings = get_settings()
    prepared = prepare_many(calls, settings)
    await _adispatch(prepared, settings)
    return [p.job.id for p in prepared]


async def asubmit(
    job: Job,
    wait_ms: int,
    *,
    on_commit: bool | None = None,
    settings: DeferredSettings | None = None,
    on_published: Callable[[], None] | None = None,
    body: bytes | None = None,
) -> None:
    """``publishing.submit()`` for async code (the django.tasks backend's ``aenqueue()``)."""
    settings = settings or get_settings()
    prepared = prepare_built(job, wait_ms, on_commit, settings, body)
    await _adispatch([prepared], settings, on_published)


async def _adispatch(
    prepared: list[Prepared],
    settings: DeferredSettings,
    on_published: Callable[[], None] | None = None,
) -> None:
    in_sync_thread = bool(interceptors)
    if not in_sync_thread and any(p.on_commit for p in prepared) and _below_a_sync_caller():
        in_sync_thread = bool(await sync_to_async(atomic_aliases, thread_sensitive=True)())
    if in_sync_thread:
        await sync_to_async(dispatch, thread_sensitive=True)(prepared, settings, on_published)
        return
    loop = asyncio.get_running_loop()
    request = _Request(prepared, settings, loop, loop.create_future())
    _publishing_thread().put(request)
    await request.done
    if on_published is not None:
        # Where dispatch() would call it: receivers of task_enqueued may use the ORM.
        await sync_to_async(on_published, thread_sensitive=True)()


def _below_a_sync_caller() -> bool:
    """Whether this coroutine runs under ``async_to_sync`` called from a sync thread.

    Only such a thread can hold a transaction open while a coroutine runs
    (Django refuses ``ATOMIC_REQUESTS`` for async views, and ``atomic()``
    cannot be entered in async code), so only then is that thread asked
    about its transactions: a hop per call that an async view does not pay
    (measured: 2,900 against 4,500 jobs/s and loop lag p99 11 against 7 ms).
    asgiref records that thread in ``AsyncToSync``; if a future asgiref
    moves the record, every call asks.
    """
    executors = getattr(AsyncToSync, "executors", None)
    loop_executors = getattr(AsyncToSync, "loop_thread_executors", None)
    if executors is None or not isinstance(loop_executors, dict):
        return True
    if getattr(executors, "current", None) is not None:
        return True
    return asyncio.get_running_loop() in loop_executors


@dataclass
class _Request:
    """Jobs of one call, waiting for the publishing thread."""

    prepared: list[Prepared]
    settings: DeferredSettings
    loop: asyncio.AbstractEventLoop
    #: Settled in ``loop``, with the outcomes of the whole batch at once.
    done: asyncio.Future[None]
    error: BaseException | None = None
    #: Whether its outcome is known (published, or its own error set).
    finished: bool = False


class _PublishingThread:
    """One thread per process that publishes what async callers hand it, in batches."""

    def __init__(self) -> None:
        self._waiting: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="deferred-publish", daemon=True)
        self._thread.start()

    def put(self, request: _Request) -> None:
        self._waiting.put(request)

    def _run(self) -> None:
        while True:
            batch = [self._waiting.get()]
            jobs = len(batch[0].prepared)
            while jobs < BATCH_JOBS:
                try:
                    request = self._waiting.get_nowait()
                except queue.Empty:
                    break
                batch.append(request)
                jobs += len(request.prepared)
            try:
                for group in _by_settings(batch):
                    self._publish(group)
            except BaseException as exc:
                for request in batch:
                    if request.error is None and not request.finished:
                        request.error = exc
                logger.exception("The publishing thread failed; the callers get the error.")
            _settle(batch)

    @staticmethod
    def _publish(group: list[_Request]) -> None:
        """Publish a group together (confirms pipelined); an error is every caller's.

        Not tried again one by one: ``publish_many`` may raise after some
        jobs were confirmed, and publishing those again would run them twice.
        As with ``defer()``, after a ``BrokerError`` a job's outcome is
        unknown; each caller's exception names its own jobs.
        """
        try:
            publish_prepared([p for r in group for p in r.prepared], group[0].settings)
        except Exception as exc:  # noqa: BLE001 - handed to the callers
            for request in group:
                error = copy.copy(exc) if len(group) > 1 else exc
                if isinstance(error, broker.BrokerError):
                    error.job_ids = tuple(p.job.id for p in request.prepared)
                    error.job_id = error.job_ids[0]
                request.error = error
                request.finished = True
        else:
            for request in group:
                request.finished = True


def _settle(batch: list[_Request]) -> None:
    """Wake the callers: one hand-off per event loop for the whole batch, not one per job."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Request]] = {}
    for request in batch:
        by_loop.setdefault(request.loop, []).append(request)
    for loop, requests in by_loop.items():
        try:
            loop.call_soon_threadsafe(_wake, requests)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more


def _wake(requests: list[_Request]) -> None:
    for request in requests:
        if request.done.done():  # the caller was cancelled meanwhile
            continue
        if request.error is None:
            request.done.set_result(None)
        else:
            request.done.set_exception(request.error)


def _by_settings(batch: list[_Request]) -> list[list[_Request]]:
    """Requests grouped by their settings (a batch goes to one broker and topology)."""
    groups: dict[DeferredSettings, list[_Request]] = {}
    for request in batch:
        groups.setdefault(request.settings, []).append(request)
    return list(groups.values())


_threads: dict[int, _PublishingThread] = {}
_threads_lock = threading.Lock()


def _publishing_thread() -> _PublishingThread:
    """This process's publishing thread (a forked child starts its own)."""
    pid = os.getpid()
    with _threads_lock:
        thread = _threads.get(pid)
        if thread is None:
            thread = _threads[pid] = _PublishingThread()
        return thread


publishers["adefer"] = adefer  # Task.adefer()
