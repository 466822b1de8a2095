"""The attempts a worker runs or ran lately, so that a copy of one is not run again.

RabbitMQ hands a message back when the connection that delivered it goes: a
dropped connection, a broker restart, ``close_all_connections``. The worker
that had it may be running it still, or may have run it and queued the ack
that the lost connection never carried; RabbitMQ then redelivers it, often to
that same worker once it has reconnected. Without a memory of its own the
worker runs it again, and a job that ran while the connection dropped twice
runs three times. Two other copies have the same id and attempt: the copy a
publish sends again when its connection is lost before the confirm, and the
copy that carries a classic queue's delivery count (:mod:`deferred.worker.copies`),
whose original may come back too.

So each worker keeps, per attempt (job id, run, attempt number), what it did:

- **running**: a copy that arrives meanwhile joins the run. It is not run; it
  is settled as the run ends (acked with it, or handed back with it), and the
  broker's copy, on the new connection, is what that ack reaches;
- **done** (ran and settled, cancelled, superseded...): a copy is acked without
  running, for :data:`KEEP_S`;
- **requeued** with a delivery count: a copy that carries a lower count is the
  stale original, acked without running; one at that count or higher runs.

An attempt sent back to wait (early, cancels unreadable) or not settled (its
outcome could not be stored) is forgotten: its copy is what must run.

Bounded: an attempt is remembered for :data:`KEEP_S` after it ended, and at
most :data:`MAX_ENTRIES` at once (the oldest go first). A redelivery comes
within seconds of the reconnect, which the worker's reconnect backoff bounds
(30 s at most), so two minutes is plenty; what this cannot see is a copy that
reaches another worker, which the results records may answer
(:meth:`deferred.worker.pipeline.Pipeline.process`). Pure: no broker, thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

#: How long an ended attempt is remembered, in seconds.
KEEP_S = 120.0
#: The most attempts remembered at once: at 1,000 jobs/s, the last 100 s or so.
MAX_ENTRIES = 100_000

T = TypeVar("T")


class Claim(enum.Enum):
    """What a worker is to do with a delivery of an attempt."""

    #: Not seen (or forgotten): run it.
    RUN = "run"
    #: Running in this worker now: the delivery joined that run.
    JOINED = "joined"
    #: Run (or settled) by this worker already, or a stale copy: ack it, do not run it.
    DONE = "done"


class End(enum.Enum):
    """How an attempt left the worker, for what to do with its later copies."""

    #: Settled for good (ran, failed, cancelled...): later copies are duplicates.
    SETTLED = "settled"
    #: Sent on with a delivery count: later copies with a lower count are stale.
    REQUEUED = "requeued"
    #: Not settled, or sent back to wait: its copy must run, so forget it.
    FORGOTTEN = "forgotten"


class RecentRuns(Generic[T]):
    """Per attempt key, what this worker did with it lately (see the module's docstring).

    ``T`` is the worker's delivery type: joined deliveries are handed back
    from :meth:`end` to be settled with the run.
    """

    def __init__(
        self,
        keep_s: float = KEEP_S,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        #: Attempts running now, each with the deliveries that joined it.
        self._running: dict[str, _Running[T]] = {}
        #: Ended attempts, the oldest first: key -> (when it ended, its delivery count).
        self._ended: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._running) + len(self._ended)

    def claim(self, key: str, delivery: T, count: int = 0) -> Claim:
        """A delivery of attempt ``key`` arrived, carrying delivery count ``count``:
        whether to run it."""
        with self._lock:
            self._expire()
            running = self._running.get(key)
            if running is not None:
                running.joined.append(delivery)
                return Claim.JOINED
            ended = self._ended.get(key)
            if ended is not None:
                sent_with = ended[1]
                if not (sent_with and count >= sent_with):
                    return Claim.DONE
                # The copy this worker sent on with its count (or a later one): it runs.
                del self._ended[key]
            self._running[key] = _Running(delivery)
            return Claim.RUN

    def first(self, key: str) -> T | None:
        """The delivery whose run of attempt ``key`` is under way, if one is."""
        with self._lock:
            running = self._running.get(key)
            return None if running is None else running.delivery

    def end(self, key: str, how: End, count: int = 0) -> list[T]:
        """Attempt ``key``'s run ended ``how`` (``count``: the delivery count it was
        sent on with, for ``REQUEUED``); returns the deliveries that joined it."""
        with self._lock:
            running = self._running.pop(key, None)
            if how is not End.FORGOTTEN:
                self._ended.pop(key, None)
                self._ended[key] = (self._clock(), count if how is End.REQUEUED else 0)
                while len(self._ended) > self.max_entries:
                    self._ended.popitem(last=False)
            return [] if running is None else running.joined

    def _expire(self) -> None:
        cutoff = self._clock() - self.keep_s
        ended = self._ended
        while ended and next(iter(ended.values()))[0] <= cutoff:
            ended.popitem(last=False)


@dataclass
class _Running(Generic[T]):
    #: The delivery being run.
    delivery: T
    #: Deliveries of the same attempt that arrived while it ran, settled with it.
    joined: list[T] = field(default_factory=list)
