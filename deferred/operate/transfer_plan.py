"""What a transfer to a new broker moves, where, and how it reports: pure.

The keys that name a message through a transfer, the routing key it is
staged with (what is left of its delay), the staging objects, the old
broker's queues in the order they are drained, and the progress said to
people. The moving itself, and why it moves each message exactly once, is
:mod:`deferred.operate.transfer`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from deferred.core.delays import capped_delay_ms
from deferred.core.jobs import BrokenMessage, Job, due_of
from deferred.core.topology import Binding, Plan, Queue, recorded_plan
from deferred.records import cancels

#: What a message of the old broker is: a job to run, or an entry of the failed queue.
JOB, FAILED = "job", "failed"
#: The routing key that sends a staged message to the failed queue.
FAILED_ROUTE = "failed"
#: Headers the broker wrote for the old broker's queues; brokers before 4.0.1
#: would read them and may drop a re-published message as a dead-letter cycle.
BROKER_HEADERS = ("x-death", "x-delivery-count", "x-stream-offset", "x-received-from")


def transfer_key(kind: str, body: bytes) -> str:
    """The name of a message through a transfer: the same message, the same key."""
    return hashlib.sha256(kind.encode() + b"\0" + body).hexdigest()[:32]


def carried(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers a moved message keeps: all but those its old broker wrote."""
    return {
        k: v
        for k, v in headers.items()
        if k not in BROKER_HEADERS and not k.startswith(("x-first-death-", "x-last-death-"))
    }


def route(
    kind: str, body: bytes, message_id: str | None, routing_key: str, plan: Plan, now: datetime
) -> str:
    """The routing key a message is staged with: where it goes once moved.

    A job waits what is left of its delay (rounded up: never early, and at
    most MAX_DELAY: a job due later comes back to wait again, as the worker
    does for any early job). A body that is not a job goes to its ready queue
    (the last word of its routing key) when the time its id carries has come,
    and the worker there deals with it; a job for a queue these settings do
    not have goes to the failed queue.
    """
    if kind == FAILED:
        return FAILED_ROUTE
    try:
        job = Job.decode(body)
        queue, due = job.queue, job.due
    except BrokenMessage:
        queue, due = routing_key.rsplit(".", 1)[-1], due_of(message_id or "") or now
    if queue not in plan.ready_queues:
        return FAILED_ROUTE
    wait_ms = capped_delay_ms(
        due, now=now, resolution_ms=plan.resolution_ms, max_delay_ms=plan.max_delay_ms
    )
    return plan.routing_key(wait_ms, queue)


@dataclass(frozen=True)
class StagingPlan:
    """The staging queue, its way in (a fanout exchange) and its way out."""

    queue: Queue
    exchange: str
    out: str
    bindings: tuple[Binding, ...]


def staging_plan(plan: Plan) -> StagingPlan:
    """The staging objects of ``plan``'s prefix, from the plan's own queue arguments.

    The queue is of the plan's type, like the failed queue (a quorum one never
    reaches its delivery limit, and dead-letters with confirms). ``out`` sends
    a job's key (one word per level, then the queue) to the ingest exchange,
    and ``failed`` to the failed exchange.
    """
    out = f"{plan.prefix}.transfer.out"
    arguments = {**plan.failed_queue.arguments, "x-dead-letter-exchange": out}
    if plan.queue_type == "quorum":
        arguments["x-dead-letter-strategy"] = "at-least-once"
        arguments["x-overflow"] = "reject-publish"
    job_keys = ".".join(["*"] * plan.key_words)
    return StagingPlan(
        queue=Queue(f"{plan.prefix}.transfer", arguments),
        exchange=f"{plan.prefix}.transfer",
        out=out,
        bindings=(
            Binding(out, plan.ingest_exchange, job_keys, "exchange"),
            Binding(out, plan.failed_exchange.name, FAILED_ROUTE, "exchange"),
        ),
    )


@dataclass(frozen=True)
class SourceQueue:
    name: str
    kind: str
    #: A ready or hold queue: its jobs are due now, or within the hold window.
    ready: bool = False
    #: A hold queue: its jobs may move on to their ready queue (handed back).
    hold: bool = False


def source_queues(plan: Plan, records: Iterable[Mapping[str, Any]]) -> list[SourceQueue]:
    """The old broker's queues to drain, soonest due first: the ready and hold queues, the
    delay queues of every topology of the prefix by TTL, then the failed queue."""
    plans = [plan] + [
        recorded_plan(r, prefix=plan.prefix, queues=tuple(plan.ready_queues)) for r in records
    ]
    delay = {q.name: q.ttl_ms or 0 for p in plans for q in p.delay_queues}
    # Every topology's ready and hold queues: those of the other PRIORITIES setting
    # too (dict keys: each once, the current ones first).
    legacy_ready, legacy_hold = plan.legacy_queues
    ready = dict.fromkeys(
        [*(q.name for p in plans for q in p.ready_queues.values()), *legacy_ready.values()]
    )
    hold = dict.fromkeys(
        [*(q.name for p in plans for q in p.hold_queues.values()), *legacy_hold.values()]
    )
    return [
        *(SourceQueue(name, JOB, ready=True) for name in ready),
        # Due within the hold window, or held by a worker (taken once it lets go).
        *(SourceQueue(name, JOB, ready=True, hold=True) for name in hold),
        *(SourceQueue(name, JOB) for name in sorted(delay, key=lambda n: (delay[n], n))),
        SourceQueue(plan.failed_queue.name, FAILED),
    ]


def flow_order(queues: list[SourceQueue]) -> list[SourceQueue]:
    """``queues`` (as :func:`source_queues` orders them) in the order messages flow
    through them: delay queues from the longest TTL (a message only ever moves to a
    lower level), then the hold queues (a held job may be handed back to its ready
    queue), then the ready queues, then the failed queue."""
    delay = [q for q in queues if q.kind == JOB and not q.ready]
    return [
        *reversed(delay),
        *(q for q in queues if q.hold),
        *(q for q in queues if q.ready and not q.hold),
        *(q for q in queues if q.kind == FAILED),
    ]


def in_force(body: bytes, margin_s: float, now: float) -> bool:
    """Whether a record of the cancels stream still matters (a record not readable: no):
    a cancel that still cancels something, or a keyed job (``deferred.core.keys``) that can
    still come due, and supersede or be superseded."""
    try:
        record = cancels.decode_record(body)
    except ValueError:
        return False
    if isinstance(record, Job):
        return record.first_due.timestamp() + margin_s > now
    ids, at = record
    return any(cancels.expires(job_id, at, margin_s) > now for job_id in ids)


@dataclass
class Progress:
    """What a transfer has done so far; :meth:`line` says it to people."""

    #: Pending jobs moved into the new broker's topology.
    jobs: int = 0
    #: Entries of the failed queue moved.
    failed: int = 0
    #: Jobs for a queue not in QUEUES, moved to the failed queue.
    unroutable: int = 0
    #: Of those, staged by an interrupted run and moved by this one.
    resumed: int = 0
    #: Messages left in the old broker's queues, as last counted.
    remaining: int = 0
    #: Seconds since the start, and from the first batch to the last one moved (the
    #: checks and set-up before, and the final checks after, are not moving).
    elapsed_s: float = 0.0
    moving_s: float = 0.0

    @property
    def moved(self) -> int:
        return self.jobs + self.failed + self.unroutable

    @property
    def rate(self) -> float:
        """Messages moved per second since the first batch."""
        return self.moved / self.moving_s if self.moving_s > 0 else 0.0

    def line(self) -> str:
        left = f"about {self.remaining:,} left on the old broker"
        if self.remaining and self.rate:
            left += f" (~{self.remaining / self.rate:.0f} s)"
        return (
            f"moved {self.jobs:,} job(s), {self.failed + self.unroutable:,} to the failed queue "
            f"({self.rate:,.0f}/s); {left}"
        )


@dataclass
class Summary:
    progress: Progress
    interrupted: bool = False
    #: Cancel records copied, found on the new broker already, and no longer in force.
    cancels_copied: int = 0
    cancels_present: int = 0
    cancels_expired: int = 0
    #: The schedules of the old scheduler's record, copied: name -> paused.
    schedules: dict[str, bool] = field(default_factory=dict)
    #: Schedule commands sent to the old broker and never applied (not copied).
    schedule_commands: int = 0
    #: The new broker's scheduler had a record of its own already: nothing copied.
    schedules_kept: bool = False
    #: The staging queue when it was kept (a quorum queue, or not empty).
    staging_kept: str | None = None
