"""The worker's threads: jobs waiting for one start highest priority first.

``concurrent.futures.ThreadPoolExecutor`` would do, but for three things:

- **order**: its queue is first in, first out. Jobs wait here when more are
  due than threads are free (held jobs coming due together, mostly); among
  them a job of higher priority must start first, as it would from a
  priority queue of the broker.
- **a thread given up**: a job past its hard time limit keeps its thread for
  ever (:mod:`deferred.core.limits`); :meth:`Pool.abandon` puts a fresh thread in
  its place, so the jobs still waiting can run while the worker stops.
- **exit**: the threads are daemons, so a process whose thread is stuck in C
  code can still exit; :meth:`Pool.shutdown` joins every thread that was not
  given up, so a clean stop never cuts a running job short.

It returns no futures: the worker's function settles each job itself.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("deferred.worker")


class Pool:
    """``size`` threads running submitted calls, highest ``priority`` first, then in order."""

    def __init__(self, size: int, name: str = "deferred-job") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self._threads: dict[int, threading.Thread] = {}
        self._names = itertools.count()
        self._shutdown = False
        with self._cond:
            for _ in range(size):
                self._spawn()

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = 0) -> None:
        """Run ``fn(*args)`` on a thread; ``RuntimeError`` once shut down."""
        with self._cond:
            if self._shutdown:
                raise RuntimeError("the pool is shut down")
            heapq.heappush(self._heap, (-priority, next(self._seq), fn, args))
            self._cond.notify()

    def submit_many(self, calls: list[tuple[Callable[..., Any], tuple[Any, ...], int]]) -> None:
        """Submit ``(fn, args, priority)`` calls at once, or none (``RuntimeError`` once
        shut down). No thread takes one before all are in: jobs coming due together
        start in priority order even when a thread runs each faster than they could be
        submitted one by one."""
        with self._cond:
            if self._shutdown:
                raise RuntimeError("the pool is shut down")
            for fn, args, priority in calls:
                heapq.heappush(self._heap, (-priority, next(self._seq), fn, args))
            self._cond.notify(len(calls))

    def waiting(self) -> int:
        """Calls submitted and not started yet."""
        with self._cond:
            return len(self._heap)

    def abandon(self, thread_id: int) -> None:
        """Give up the thread ``thread_id`` (stuck in a job): never joined, replaced now.
        Should its job ever end, that thread leaves: it takes nothing more."""
        with self._cond:
            if self._threads.pop(thread_id, None) is not None and not self._shutdown:
                self._spawn()
            self._cond.notify_all()

    def shutdown(self, wait: bool = True) -> None:
        """Take no more calls; the threads run what is waiting, then end. ``wait``:
        return once they all did, but those given up (even given up meanwhile)."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
            if not wait:
                return
            me = threading.get_ident()
            while any(ident != me for ident in self._threads):
                self._cond.wait()

    def _spawn(self) -> None:
        """Start a thread; called holding ``_cond``, so that it is known before it runs."""
        thread = threading.Thread(
            target=self._work, name=f"{self.name}_{next(self._names)}", daemon=True
        )
        thread.start()
        assert thread.ident is not None
        self._threads[thread.ident] = thread

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self._cond:
                while not self._heap and not self._shutdown and me in self._threads:
                    self._cond.wait()
                if not self._heap or me not in self._threads:
                    # Done, or given up: a thread whose job outlived its limit takes no more.
                    if self._threads.pop(me, None) is not None:
                        self._cond.notify_all()
                    return
                _, _, fn, args = heapq.heappop(self._heap)
            try:
                fn(*args)
            except BaseException:  # a thread that dies would shrink the pool
                logger.exception("Unexpected error in a worker thread.")
