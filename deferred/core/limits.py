"""Time limits: stop a job that runs too long, softly first, then for good.

A task stuck on a socket with no timeout would hold one of the worker's
threads for ever, and enough of them stop a worker whose health file stays
fresh. On quorum queues it is worse: past the consumer timeout the broker
takes the delivery back and another worker starts the job a second time
while the first copy still runs. So every attempt runs under a limit
(``@task(time_limit=...)``, ``DEFERRED['TIME_LIMIT']``):

- **soft**: when it passes, :class:`TimeLimitExceeded` is raised in the job's
  own thread (``PyThreadState_SetAsyncExc``, as Dramatiq's ``TimeLimit``
  middleware does). Python raises it at the next bytecode the thread runs,
  so a task may catch it and clean up; a thread blocked in C code (a socket
  read, ``time.sleep``) sees it only when the call returns. An ``async def``
  task is cancelled at its current ``await`` instead, by the event loop
  (:func:`run_async`): an exception set in the waiting thread would leave its
  loop running.
- **hard**: a job still running ``TIME_LIMIT_GRACE`` after the soft limit
  cannot be stopped inside the process. :class:`Watchdog` takes it over
  (:meth:`Watch.finish` then tells its thread that the job is no longer its
  own), and the worker records the attempt as ``timed_out``, acks it, hands
  back what it holds and ends the process with :data:`deferred.worker.exits.TIMED_OUT`
  for a fresh one to take its place (``--processes``' parent, systemd or
  Kubernetes).

Exactly one side settles a job: the thread that ran it (it returned or raised
before the hard limit) or the watchdog (it did not), decided under the
watch's lock.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

logger = logging.getLogger("deferred.worker")

T = TypeVar("T")

RUNNING, FINISHED, ABANDONED = "running", "finished", "abandoned"


class TimeLimitExceeded(Exception):
    """The attempt ran past its time limit (``@task(time_limit=...)``, ``DEFERRED['TIME_LIMIT']``).

    Raised inside the task, in its own thread (an ``async def`` task is
    cancelled at its current ``await``, and the attempt then ends with this).
    A task may catch it to clean up; the attempt is recorded as
    ``timed_out``, or retried as its retry policy says.
    """

    # The path results and the failed store record, and django.tasks imports the
    # class from: the public one, whichever module defines it.
    __module__ = "deferred"

    def __init__(self, *args: object) -> None:
        # Raised from another thread as a bare class: it still says what happened.
        super().__init__(*(args or ("the task ran past its time limit",)))


def parse_time_limit(value: Any, name: str = "time_limit") -> float | None:
    """A time limit in seconds (a number of seconds or a ``timedelta``); ``None``: none.

    ``ValueError`` or ``TypeError`` naming ``name`` for anything else: a limit
    must be positive and finite.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a number of seconds, a timedelta or None, got {value!r}.")
    if not (seconds > 0 and seconds < float("inf")):
        raise ValueError(f"{name} must be a positive, finite duration, got {value!r}.")
    return seconds


class Watch:
    """One attempt under a limit: when it passes, and who settles the job."""

    def __init__(self, limit_s: float, grace_s: float, thread_id: int, context: Any = None) -> None:
        now = time.monotonic()
        self.limit_s = limit_s
        self.grace_s = grace_s
        #: ``time.monotonic()`` at the soft and the hard limit.
        self.soft_at = now + limit_s
        self.hard_at = self.soft_at + grace_s
        self.thread_id = thread_id
        #: What the worker needs to settle the job if the watchdog takes it over.
        self.context = context
        self.state = RUNNING
        #: Whether the soft limit passed while the attempt ran.
        self.fired = False
        #: An ``async def`` task: its event loop enforces the soft limit.
        self.in_loop = False
        self._lock = threading.Lock()

    def remaining(self) -> float:
        """Seconds until the soft limit (negative once it passed)."""
        return self.soft_at - time.monotonic()

    def finish(self) -> bool:
        """Called by the job's thread when the attempt returned or raised: whether the
        job is still its own to settle (``False``: the watchdog took it over).

        Idempotent. A soft-limit exception set but not raised yet is withdrawn,
        so that it cannot surface in the code that settles the job.
        """
        with self._lock:
            if self.state == ABANDONED:
                return False
            if self.state == RUNNING and self.fired and not self.in_loop:
                _set_async_exc(self.thread_id, None)
            self.state = FINISHED
            return True

    def _fire_soft(self) -> None:
        with self._lock:
            if self.state != RUNNING or self.fired:
                return
            self.fired = True
            if not self.in_loop:
                _set_async_exc(self.thread_id, TimeLimitExceeded)

    def _abandon(self) -> bool:
        with self._lock:
            if self.state != RUNNING:
                return False
            self.state = ABANDONED
            return True


class Watchdog:
    """One thread that fires the soft and hard limits of every running attempt."""

    def __init__(self, on_hard: Callable[[Watch], None]) -> None:
        #: Told, on the watchdog's thread, of an attempt it took over.
        self._on_hard = on_hard
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, limit_s: float | None, grace_s: float, context: Any = None) -> Watch | None:
        """Start watching an attempt that runs on the calling thread; ``None`` for no limit."""
        if limit_s is None:
            return None
        watch = Watch(limit_s, grace_s, threading.get_ident(), context)
        with self._cond:
            heapq.heappush(self._heap, (watch.soft_at, next(self._seq), watch))
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(
                    target=self._run, name="deferred-time-limits", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return watch

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    # Finished attempts leave the heap as they reach its top.
                    while self._heap and self._heap[0][2].state != RUNNING:
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                at, _, watch = heapq.heappop(self._heap)
                if at < watch.hard_at:
                    # The soft limit: back in the heap for the hard one.
                    heapq.heappush(self._heap, (watch.hard_at, next(self._seq), watch))
            if at < watch.hard_at:
                watch._fire_soft()
            elif watch._abandon():
                try:
                    self._on_hard(watch)
                except Exception:
                    logger.exception("Could not settle a job past its hard time limit.")


def run_async(awaitable: Awaitable[T], watch: Watch | None) -> T:
    """Run ``awaitable`` to its end on an event loop of its own (``async_to_sync``),
    cancelled at its soft limit: the attempt then raises :class:`TimeLimitExceeded`."""
    from asgiref.sync import async_to_sync

    if watch is not None:
        watch.in_loop = True
    return async_to_sync(_limited)(awaitable, watch)


async def _limited(awaitable: Awaitable[T], watch: Watch | None) -> T:
    if watch is None:
        return await awaitable
    timeout = asyncio.timeout(watch.remaining())
    try:
        async with timeout:
            return await awaitable
    except TimeoutError:
        if not timeout.expired():
            raise  # the task's own
        with watch._lock:
            watch.fired = True
        raise TimeLimitExceeded(
            f"the task ran past its time limit of {watch.limit_s:g} s"
        ) from None


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode; ``None`` withdraws it."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )
