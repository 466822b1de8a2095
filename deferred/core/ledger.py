"""The ledger: every job as it was published, kept in a stream by the broker itself.

Why it exists: a job moves from one delay queue to the next by RabbitMQ's
dead-lettering, and classic queues dead-letter without confirms. When the
broker stops (a graceful restart as well as a crash), a job that expires from
one queue as the next one is already down is dropped, with nothing left of it
anywhere. The nemesis soak measured 2 such losses in 17 restarts under load.
Quorum queues dead-letter at least once, but on RabbitMQ 3.10 their
dead-letter worker was seen to stall for minutes after a restart, and
RabbitMQ's own tracker lists stuck dead-letters on 4.2 too. Neither queue type
alone keeps the README's promise, so the repair does not rely on either.

What is written: the ``PREFIX.ledger`` stream is bound to the ingest exchange
with the patterns that lead into the delay, hold and ready queues, so the broker
puts a copy of each job published (``defer()``, retries, recurring occurrences,
transfers) into it, in the same publish and under the same confirm: no extra
message from Python, nothing to forget on any path. A job due at once makes no
hop and has nothing to repair; its record is how another process finds it while
it waits for a worker (:mod:`deferred.records.pending`). A stream keeps its messages on
disk.

What it is read for: the routing key and the due time of a job say exactly
when it left each delay queue (:func:`hop_times`): the queue TTLs are fixed,
and the job leaves its last delay queue at its due time (or up to one
``HOLD_WINDOW`` before it, into the hold queue). After a broker restart the
keeper (:mod:`deferred.worker.keeper`) knows when the broker went away and when it
was back, and publishes again every job that had a hop in that window
(:func:`at_risk`), as a copy (``x-deferred-copy``) due when the job is. A copy
runs only if no worker started that attempt of the job (the results stream
says), so a job that survived runs once, and one that was lost runs late by
the copy's two-second wait.

Retention: the stream keeps records for ``LEDGER_KEEP_MS`` (7 days). A job
due later than that would lose its record, so the keeper writes the record of
every job still pending again before it gets that old (:func:`to_carry`); a
job deferred for a year is written about 100 times, a job of a day once. The
newest record of a job id wins (:func:`latest`): a retry or a carried record
replaces the older one.

Pure: no broker I/O (``deferred.broker.ledger`` reads and writes the stream).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

#: Headers a carried record keeps the original routing key and exchange in: it
#: is written again through the default exchange, which would lose them.
KEY_HEADER = "x-deferred-key"
EXCHANGE_HEADER = "x-deferred-exchange"
#: A keeper's "the broker was up at" marker: an empty message with this header (ms).
ALIVE_HEADER = "x-deferred-alive"
#: ... and, while a restart's repair is not finished, where its window starts (ms).
UNSETTLED_HEADER = "x-deferred-unsettled"
#: How often the keeper carries the records of pending jobs forward, and how long
#: its read of the whole ledger may take: together they say how far past half the
#: retention the newest record of a pending job may be (deferred.records.pending reads it).
CARRY_EVERY_S = 3600.0
READ_TIMEOUT_S = 600.0
#: How late a hop may be under load (dead-lettering backlog): a hop due before a
#: restart window may happen inside it.
LATE_HOP_MS = 5_000

_TOPOLOGY = re.compile(
    r"\.delay\.r(\d+)\.(\d+)ms\.L(\d+)(?:\.H(\d+))?(?:\.P\d+)?\.([a-z]+)(\.quorum-delays)?\.ingest$"
)


@dataclass(frozen=True)
class Shape:
    """What the hop times depend on: the delay topology's radix, resolution and levels."""

    radix: int
    resolution_ms: int
    levels: int
    hold_levels: int
    #: Whether the delay queues are quorum queues, which dead-letter at least once:
    #: the source keeps a job until the next queue confirmed it, so none is dropped.
    quorum_delays: bool = False

    @property
    def window_ms(self) -> int:
        return self.radix**self.hold_levels * self.resolution_ms if self.hold_levels else 0


def shape_of(ingest_exchange: str) -> Shape | None:
    """The shape an ingest exchange's name carries (``None``: not one of ours)."""
    found = _TOPOLOGY.search(ingest_exchange)
    if found is None:
        return None
    radix, resolution, levels, held, queue_type, quorum_delays = found.groups()
    quorum = queue_type == "quorum" or quorum_delays is not None
    return Shape(int(radix), int(resolution), int(levels), int(held or 0), quorum)


@dataclass(frozen=True)
class Entry:
    """One job as the ledger keeps it: what is needed to publish it again."""

    job_id: str
    due_ms: int
    routing_key: str
    exchange: str
    body: bytes
    #: The message's headers as published (without the stream's own).
    headers: dict[str, Any]
    priority: int | None
    #: When the record was written (ms), for carrying it forward.
    written_ms: int
    offset: int

    @property
    def queue(self) -> str:
        """The target queue: the routing key's last word."""
        return self.routing_key.rsplit(".", 1)[-1]


def makes_no_hop(shape: Shape, routing_key: str) -> bool:
    """Whether a job published with ``routing_key`` went straight to its ready or hold
    queue: every delay digit zero. Nothing about such a job is repaired, and the
    keeper skips its record before decoding it (most jobs of a busy system)."""
    declared = shape.levels - shape.hold_levels
    return all(word == "0" for word in routing_key.split(".", declared)[:declared])


def hop_times(shape: Shape, routing_key: str, due_ms: int) -> list[tuple[int, int]]:
    """When the job left each delay queue it visited: (earliest, latest) in ms, in order.

    The last one is the move into the ready or hold queue. A job with no
    non-zero digit (due at once) made no hop. ``ValueError`` for a routing key
    that does not fit the shape.
    """
    words = routing_key.split(".")
    declared = shape.levels - shape.hold_levels
    if len(words) != declared + (1 if shape.hold_levels else 0) + 1:
        raise ValueError(f"routing key {routing_key!r} does not fit {shape}")
    digits = [int(w) for w in words[:declared]]
    held = shape.hold_levels and words[declared] == "1"
    ttls = [
        d * shape.radix ** (shape.levels - 1 - i) * shape.resolution_ms
        for i, d in enumerate(digits)
        if d
    ]
    # The last delay queue lets the job go at its due time, or into the hold
    # queue up to one window before it when the held digits are not all zero.
    end_lo = due_ms - (shape.window_ms if held else 0)
    out: list[tuple[int, int]] = []
    after = sum(ttls)
    for ttl in ttls:
        after -= ttl
        out.append((end_lo - after, due_ms - after))
    return out


def at_risk(entry: Entry, since_ms: int, until_ms: int) -> bool:
    """Whether ``entry`` had a hop between ``since_ms`` and ``until_ms``: it may have
    been dropped by a broker that was stopping or starting then. Never for quorum
    delay queues (they hand a job on at least once; a late one is late, not lost).
    A record whose topology cannot be read counts as at risk if it was due after
    ``since_ms``."""
    shape = shape_of(entry.exchange)
    if shape is not None and shape.quorum_delays:
        return False
    try:
        hops = hop_times(shape, entry.routing_key, entry.due_ms) if shape else None
    except ValueError:
        hops = None
    if hops is None:
        return entry.due_ms >= since_ms
    return any(lo <= until_ms and hi + LATE_HOP_MS >= since_ms for lo, hi in hops)


def latest(entries: Iterable[Entry]) -> dict[str, Entry]:
    """The newest entry of each job id, in stream order (a retry, a carried record or
    a copy replaces what came before it)."""
    out: dict[str, Entry] = {}
    for entry in entries:
        out.pop(entry.job_id, None)
        out[entry.job_id] = entry
    return out


def to_repair(entries: Iterable[Entry], since_ms: int, until_ms: int) -> list[Entry]:
    """The jobs to publish again after a restart between ``since_ms`` and ``until_ms``,
    soonest due first: the newest record of each job, if it had a hop then."""
    found = [e for e in latest(entries).values() if at_risk(e, since_ms, until_ms)]
    return sorted(found, key=lambda e: e.due_ms)


def to_carry(entries: Iterable[Entry], now_ms: int, keep_ms: int) -> Iterator[Entry]:
    """The records to write again so that they outlive the stream's retention: the
    newest of each job still to come due, written more than half of ``keep_ms`` ago."""
    for entry in latest(entries).values():
        if entry.written_ms <= now_ms - keep_ms // 2 and entry.due_ms > now_ms:
            yield entry


@dataclass(frozen=True)
class Marker:
    """A keeper's "up at" marker: the broker was up at ``alive_ms``; ``unsettled_ms``:
    the start of the oldest restart window whose repair was not finished then."""

    alive_ms: int
    unsettled_ms: int | None = None


def window_start(markers: Iterable[Marker], before_ms: int, margin_ms: int) -> int:
    """Where the window of a restart found at ``before_ms`` starts, for a keeper that
    did not see the broker go: ``margin_ms`` before the newest marker written before
    then, or before the oldest repair that marker says was not finished. 0 (the
    ledger's start) with no marker at all."""
    last = max(
        (m for m in markers if m.alive_ms < before_ms), key=lambda m: m.alive_ms, default=None
    )
    if last is None:
        return 0
    start = last.alive_ms if last.unsettled_ms is None else min(last.alive_ms, last.unsettled_ms)
    return max(0, start - margin_ms)


def overtaken(
    due_ms: int,
    others: list[tuple[int, bool]],
    *,
    after_ms: int = 2_000,
    span_ms: int = 10_000,
    share: float = 0.9,
    least: int = 5,
) -> bool | None:
    """Whether the jobs due just after ``due_ms`` (between ``after_ms`` and
    ``after_ms + span_ms`` later) have mostly started: ``others`` holds each job's
    due time and whether it started. A job not started while those that follow it
    did was passed by: it is not waiting in a backlog, it is gone. ``None`` when
    fewer than ``least`` jobs follow it: nothing to tell by.

    The delay line under load is a backlog no queue count shows: the broker's
    dead-lettering falls behind, and jobs reach the ready queues late, in due
    order at each hop. Their progress is the measure of "late" versus "lost".
    """
    followers = [
        started for due, started in others if due_ms + after_ms < due <= due_ms + after_ms + span_ms
    ]
    if len(followers) < least:
        return None
    return sum(followers) >= share * len(followers)
