"""The last mile: jobs held in the worker, unacked, until their exact due time.

The delay topology carries a job to within ``HOLD_WINDOW`` of its due time
(:mod:`deferred.core.topology`); the worker that takes it from the hold queue keeps
the delivery unacked, so the job stays durable in RabbitMQ, and starts it at
the due time on its own clock. Lateness is then a timer's precision instead of
the sum of the lowest levels' broker hops, and those hops, most of the
broker's work for short delays, are gone.

:class:`Holder` is the timer: one thread, a heap of due times. It knows
nothing of AMQP; the worker gives it what to do when jobs come due
(``release``: hand them to the pool, all those due at once together, so that
the pool can start them by priority) and when a released job has waited
:data:`HAND_BACK_AFTER_S` while the pool started nothing at all (``stalled``
says so; ``hand_back``: a fresh copy goes back to its queue, for a worker with
a free thread). A held job is started or handed back exactly once:
:meth:`Holder.start` and the hand-back race on one lock.

Why the hand-back: a worker holds up to ``HOLD_PREFETCH`` jobs while its
threads run others. If they come due while its threads are all taken by slow
tasks, keeping them would make them late while other workers sit idle. A pool
that keeps starting jobs is busy, not stuck: its queue of short jobs drains
faster than a hand-back would, and handing back there would only add broker
work when the broker is the wall.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("deferred.worker")

#: A released job that no thread has started after this long, while the pool
#: started nothing either, goes back for another worker.
HAND_BACK_AFTER_S = 0.05
#: Released jobs this much younger than a stale one go back in its batch.
HAND_BACK_GATHER_S = 0.02

HELD, RELEASED, STARTED, HANDED_BACK = "held", "released", "started", "handed back"


@dataclass(eq=False)
class Held:
    """One held delivery: what it is (opaque here) and when it comes due."""

    #: The delivery and the job read from it, for the worker.
    delivery: Any
    job: Any
    #: ``time.monotonic()`` at the due time.
    due: float
    #: Its priority (-100..100): the highest goes back first when several are handed back.
    rank: int = 0
    state: str = HELD
    released_at: float = 0.0
    seq: int = field(default=0)


class Holder:
    """Keeps held jobs until they are due, then hands each to ``release``, once: the
    jobs due at the same moment in one call."""

    def __init__(
        self,
        release: Callable[[list[Held]], None],
        hand_back: Callable[[Held], None],
        *,
        stalled: Callable[[float], bool] = lambda seconds: True,
        hand_back_after_s: float = HAND_BACK_AFTER_S,
    ) -> None:
        self._release = release
        self._hand_back = hand_back
        #: Whether the pool has started no job for that many seconds.
        self._stalled = stalled
        self.hand_back_after_s = hand_back_after_s
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, Held]] = []
        #: Released and not started yet, in release order.
        self._released: list[Held] = []
        self._seq = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the worker's side

    def start_thread(self) -> None:
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="deferred-holder", daemon=True)
        self._thread.start()

    def hold(self, delivery: Any, job: Any, seconds: float, rank: int = 0) -> Held | None:
        """Hold ``delivery`` for ``seconds`` (from now); ``None`` once stopped: hand it back."""
        entry = Held(delivery, job, time.monotonic() + max(0.0, seconds), rank)
        with self._lock:
            if self._stopped:
                return None
            entry.seq = next(self._seq)
            heapq.heappush(self._heap, (entry.due, entry.seq, entry))
            self._lock.notify()
        return entry

    def start(self, entry: Held) -> bool:
        """A pool thread is about to run ``entry``: ``False`` if it was handed back."""
        with self._lock:
            if entry.state != RELEASED:
                return False
            entry.state = STARTED
            return True

    def count(self) -> int:
        """Jobs held and not started: waiting for their time, or for a thread."""
        with self._lock:
            return len(self._heap) + sum(1 for e in self._released if e.state == RELEASED)

    def stop(self) -> list[Held]:
        """Stop the timer; return every job neither started nor handed back, now the
        caller's to hand back (SIGTERM: at once, not when they come due)."""
        with self._lock:
            self._stopped = True
            left = [e for _, _, e in self._heap] + [e for e in self._released]
            self._heap.clear()
            self._released.clear()
            out = []
            for entry in left:
                if entry.state in (HELD, RELEASED):
                    entry.state = HANDED_BACK
                    out.append(entry)
            self._lock.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        return out

    # ------------------------------------------------------------------ the timer thread

    def _run(self) -> None:
        while True:
            due, stale = self._next()
            if due is None and not stale:
                return
            if due:
                try:
                    self._release(due)
                except Exception:
                    # All or none were released (Pool.submit_many): none run.
                    logger.exception("Could not release held jobs; they are handed back.")
                    with self._lock:
                        for entry in due:
                            entry.state = HANDED_BACK
                    for entry in sorted(due, key=lambda e: -e.rank):
                        self._hand_back(entry)
            # Highest priority first, then in due order: back in a queue whose levels
            # are coarser than the priorities, they keep that order among themselves.
            for entry in sorted(stale, key=lambda e: -e.rank):
                try:
                    self._hand_back(entry)
                except Exception:
                    logger.exception("Could not hand back a held job.")

    def _next(self) -> tuple[list[Held] | None, list[Held]]:
        """Wait until a job is due or a released one is stale; ``(None, [])`` once stopped."""
        with self._lock:
            while not self._stopped:
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    entry = heapq.heappop(self._heap)[2]
                    entry.state, entry.released_at = RELEASED, now
                    self._released.append(entry)
                    due.append(entry)
                # Forget the started ones; take back those no thread took in time.
                stale = []
                kept = []
                stalled: bool | None = None  # asked once per round, if needed
                # Jobs released within HAND_BACK_GATHER_S of a stale one go back with it,
                # in one batch sorted by priority: jobs due together come off the timer
                # a few at a time, and would otherwise go back in the order they came.
                oldest = min(
                    (e.released_at for e in self._released if e.state == RELEASED), default=now
                )
                ripe_after = self.hand_back_after_s - HAND_BACK_GATHER_S
                if now - oldest < self.hand_back_after_s:
                    ripe_after = self.hand_back_after_s
                for entry in self._released:
                    if entry.state != RELEASED:
                        continue
                    if now - entry.released_at >= ripe_after:
                        if stalled is None:
                            stalled = self._stalled(self.hand_back_after_s)
                        if stalled:
                            entry.state = HANDED_BACK
                            stale.append(entry)
                            continue
                        # The pool moves: look again one grace period on.
                        entry.released_at = now
                    kept.append(entry)
                self._released = kept
                if due or stale:
                    return due, stale
                wake = [self._heap[0][0]] if self._heap else []
                if self._released:
                    wake.append(self._released[0].released_at + self.hand_back_after_s)
                self._lock.wait(max(0.0, min(wake) - now) if wake else None)
            return None, []
