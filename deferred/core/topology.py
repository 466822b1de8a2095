"""The delay topology as data: a pure function of the settings, no broker I/O.

A delay of ``D`` units (``RESOLUTION`` each) is written in base ``b`` with ``L``
digits. For every level ``i`` and digit ``d`` in ``1..b-1`` there is one queue
whose messages all share the TTL ``d * b**i`` units. Because every message in a
queue has the same TTL, the queue expires them in FIFO order, which is due
order: this is what avoids the head-of-line blocking of per-message TTLs.

A message carries its digits in the routing key (highest level first, then the
target queue name, e.g. ``0.0.1.0.1.default``) and visits one queue per non-zero
digit, highest first. Each level dead-letters into its own topic exchange,
whose bindings send the message on to the next non-zero digit or, once none is
left, to the ready queue of its target.

``mandatory`` publishing only checks the first hop. A message that finds no
route at a later hop (a ready queue that was never declared or was deleted)
would be dropped by RabbitMQ, so every level exchange has the shared
``<prefix>.failed`` exchange as its alternate exchange: such a job lands in the
failed queue instead. Ready queues dead-letter there too.

**The last mile** (``HOLD_WINDOW``): the lowest ``hold_levels`` levels are not
declared. Their digits never reach the broker: the routing key carries the
digits of the declared levels, then one word, ``0`` when the lower digits are
all zero (the job is due when it leaves the last delay queue) or ``1`` when
they are not. A ``1`` job goes to the *hold queue* of its target instead of the
ready queue, at most one window early, and the worker that takes it holds it
unacked until its due time (:mod:`deferred.worker.holding`). The hold queue has its
own consumer and prefetch in each worker, so held jobs never take the slots of
jobs to run.

Everything that defines the routing (radix, resolution, level count, held
levels, queue type) is part of the names, so a changed setting declares a new
topology beside the old one instead of clashing with it; all drain into the
same ready and hold queues.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from deferred.core.priorities import MAX_LEVEL

#: RabbitMQ refuses an ``x-message-ttl`` above this many milliseconds (10 years).
MAX_TTL_MS = 315_360_000_000
#: AMQP 0-9-1 routing keys are short strings: at most 255 bytes.
MAX_ROUTING_KEY_BYTES = 255
#: How long a cancel stays in force after its job was due, by default (DEFERRED['CANCEL_MARGIN']).
CANCEL_MARGIN_MS = 7 * 24 * 3600 * 1000
#: How long the results stream keeps a result, by default (DEFERRED['RESULT_TTL']): a day.
RESULT_TTL_MS = 24 * 3600 * 1000
#: The cancels stream's segment size: about 100,000 cancels.
STREAM_SEGMENT_BYTES = 16_000_000


class TopologyError(ValueError):
    """The settings describe a topology RabbitMQ cannot hold."""


@dataclass(frozen=True)
class Exchange:
    name: str
    type: str = "topic"
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Queue:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    #: The TTL in milliseconds of a delay queue; ``None`` for ready/failed queues.
    ttl_ms: int | None = None
    level: int | None = None
    digit: int | None = None


@dataclass(frozen=True)
class Binding:
    source: str
    destination: str
    routing_key: str
    #: ``"queue"`` or ``"exchange"`` (an exchange-to-exchange binding).
    destination_type: str = "queue"


@dataclass(frozen=True)
class Plan:
    """Every exchange, queue and binding of one topology, plus the shared queues."""

    prefix: str
    topology_id: str
    radix: int
    resolution_ms: int
    levels: int
    max_delay_ms: int
    queue_type: str
    ingest_exchange: str
    #: Owned by this topology; removed with it once it is empty.
    exchanges: tuple[Exchange, ...]
    delay_queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]
    #: Shared by every topology of the prefix; never removed by the library.
    ready_queues: dict[str, Queue]
    #: Jobs that arrive up to one window early, held by a worker until due;
    #: declared (and consumed) whatever the window, so that a changed
    #: ``HOLD_WINDOW`` never strands a job an older topology sent there.
    hold_queues: dict[str, Queue]
    failed_queue: Queue
    #: Fanout into the failed queue: the alternate and dead-letter exchange.
    failed_exchange: Exchange
    registry_queue: Queue
    #: Recurring jobs (deferred.worker.scheduler): the single-active-consumer queue whose
    #: token makes one worker the scheduler, and the queue of its records.
    scheduler_queue: Queue
    schedules_queue: Queue
    #: Cancelled job ids (deferred.records.cancels): a stream every worker reads from the start.
    cancels_queue: Queue
    #: Jobs' starts and outcomes (deferred.records.results): a stream read by timestamp.
    results_queue: Queue
    #: Every job as it was published (deferred.core.ledger): a stream the broker fills
    #: from the ingest exchanges, read after a broker restart to repair losses.
    ledger_queue: Queue | None = None
    #: The keeper's lease (deferred.worker.keeper): a single-active-consumer queue.
    keeper_queue: Queue | None = None
    #: One non-persistent message while the broker runs: its absence tells the
    #: keeper that the broker restarted (deferred.worker.keeper).
    up_queue: Queue | None = None
    #: The ledger's checkpoints (deferred.core.ledger_index): pages of pending jobs,
    #: and the heads that say where each checkpoint's pages are.
    ledger_pages_queue: Queue | None = None
    ledger_heads_queue: Queue | None = None
    #: The lowest levels left to the workers (``HOLD_WINDOW``): not declared.
    hold_levels: int = 0
    #: The classic ready and hold queues' ``x-max-priority`` (0: FIFO queues).
    max_priority: int = 0
    #: The delay queues' type: quorum (dead-lettering with confirms) unless asked
    #: otherwise; empty: ``queue_type`` (topologies recorded before it existed).
    delay_queue_type: str = ""

    @property
    def delay_type(self) -> str:
        """The delay queues' type (``quorum`` or ``classic``)."""
        return self.delay_queue_type or self.queue_type

    @property
    def legacy_queues(self) -> tuple[dict[str, str], dict[str, str]]:
        """The classic ready and hold queues (by target name) that older topologies of
        this prefix may still deliver to, when this one has others: the FIFO ones when
        this topology has priorities, the ``p9`` ones when ``PRIORITIES`` was turned
        off. Workers drain them too, as long as they exist."""
        if self.queue_type != "classic":
            return {}, {}
        other = 0 if self.max_priority else MAX_LEVEL
        return (
            {q: _ready_name(self.prefix, "ready", q, other) for q in self.ready_queues},
            {q: _ready_name(self.prefix, "hold", q, other) for q in self.hold_queues},
        )

    @property
    def legacy_label(self) -> str:
        """What :attr:`legacy_queues` are, for listings and logs."""
        if self.max_priority:
            return "FIFO ready and hold queues (before PRIORITIES)"
        return "priority ready and hold queues (before PRIORITIES was turned off)"

    @property
    def window_ms(self) -> int:
        """The span of the levels left to the workers: a job reaches its hold queue
        less than this before it is due (0: no level is left to them)."""
        return self.radix**self.hold_levels * self.resolution_ms if self.hold_levels else 0

    @property
    def key_words(self) -> int:
        """Words in a job's routing key: a digit per declared level, the hold word
        (when levels are held), the target queue."""
        return self.levels - self.hold_levels + (1 if self.hold_levels else 0) + 1

    @property
    def shared_queues(self) -> tuple[Queue, ...]:
        return (
            *self.ready_queues.values(),
            *self.hold_queues.values(),
            self.failed_queue,
            self.registry_queue,
            self.scheduler_queue,
            self.schedules_queue,
            self.cancels_queue,
            self.results_queue,
            *self.keeping_queues,
        )

    @property
    def keeping_queues(self) -> tuple[Queue, ...]:
        """The ledger, its checkpoints, the keeper's lease and the up marker (none with
        ``LEDGER`` off)."""
        return tuple(
            q
            for q in (
                self.ledger_queue,
                self.ledger_pages_queue,
                self.ledger_heads_queue,
                self.keeper_queue,
                self.up_queue,
            )
            if q
        )

    @property
    def streams(self) -> tuple[Queue, ...]:
        """The queues that are streams: the cancels, the results, the ledger and its
        checkpoints."""
        ledger = tuple(
            q for q in (self.ledger_queue, self.ledger_pages_queue, self.ledger_heads_queue) if q
        )
        return (self.cancels_queue, self.results_queue, *ledger)

    @property
    def shared_bindings(self) -> tuple[Binding, ...]:
        return (Binding(self.failed_exchange.name, self.failed_queue.name, ""),)

    @property
    def all_exchanges(self) -> tuple[Exchange, ...]:
        """Every exchange to declare, the shared failed exchange first."""
        return (self.failed_exchange, *self.exchanges)

    @property
    def all_queues(self) -> tuple[Queue, ...]:
        """Every queue to declare, the shared ones first."""
        return (*self.shared_queues, *self.delay_queues)

    @property
    def all_bindings(self) -> tuple[Binding, ...]:
        """Every binding to declare, the shared one first."""
        return (*self.shared_bindings, *self.bindings)

    def units(self, delay_ms: int) -> int:
        """Whole resolution units for ``delay_ms``, rounded up: never early."""
        return -(-delay_ms // self.resolution_ms)

    def digits(self, units: int) -> list[int]:
        """The ``levels`` base-``radix`` digits of ``units``, highest level first."""
        if not 0 <= units < self.radix**self.levels:
            raise TopologyError(f"{units} units do not fit in {self.levels} levels")
        out = []
        for _ in range(self.levels):
            units, digit = divmod(units, self.radix)
            out.append(digit)
        return out[::-1]

    def routing_key(self, delay_ms: int, queue: str) -> str:
        """The routing key that makes a message wait ``delay_ms`` (rounded up).

        With held levels, their digits become one word: ``1`` sends the job
        to the hold queue, early by what they add up to, ``0`` to the ready queue.
        """
        digits = self.digits(self.units(delay_ms))
        declared = digits[: self.levels - self.hold_levels]
        words = [str(d) for d in declared]
        if self.hold_levels:
            words.append("1" if any(digits[len(declared) :]) else "0")
        return ".".join([*words, queue])

    def hops(self, delay_ms: int) -> int:
        """How many delay queues a message of ``delay_ms`` passes through."""
        digits = self.digits(self.units(delay_ms))
        return sum(1 for d in digits[: self.levels - self.hold_levels] if d)

    def size(self) -> str:
        """How many queues and exchanges, and of which kind, in words: the one count that
        ``declare_delay_topology``, its ``--delete`` and the docs give."""
        bookkeeping = len(self.shared_queues) - len(self.ready_queues) - len(self.hold_queues)
        return (
            f"{len(self.all_queues)} queues ({len(self.delay_queues)} delay, "
            f"{len(self.ready_queues)} ready, {len(self.hold_queues)} hold, {bookkeeping} "
            f"bookkeeping) and {len(self.all_exchanges)} exchanges"
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description (``declare_delay_topology --format json``)."""
        return {
            "topology": self.topology_id,
            "prefix": self.prefix,
            "radix": self.radix,
            "resolution_ms": self.resolution_ms,
            "levels": self.levels,
            "hold_levels": self.hold_levels,
            "window_ms": self.window_ms,
            "max_priority": self.max_priority,
            "max_delay_ms": self.max_delay_ms,
            "queue_type": self.queue_type,
            "delay_queue_type": self.delay_type,
            "ingest_exchange": self.ingest_exchange,
            "exchanges": [asdict(e) for e in (*self.exchanges, self.failed_exchange)],
            "queues": [asdict(q) for q in (*self.delay_queues, *self.shared_queues)],
            "bindings": [asdict(b) for b in (*self.bindings, *self.shared_bindings)],
        }

    def record(self) -> str:
        """What the topology registry keeps to find this topology again."""
        return json.dumps(
            {
                "topology": self.topology_id,
                "radix": self.radix,
                "resolution_ms": self.resolution_ms,
                "levels": self.levels,
                "max_delay_ms": self.max_delay_ms,
                "queue_type": self.queue_type,
                "delay_queue_type": self.delay_type,
                "hold_levels": self.hold_levels,
                "max_priority": self.max_priority,
            },
            sort_keys=True,
        )


def widest_plan(
    *,
    prefix: str,
    radix: int,
    resolution_ms: int,
    levels: int,
    queue_type: str,
    queues: tuple[str, ...] | list[str],
    hold_levels: int = 0,
    max_priority: int = 0,
    delay_queue_type: str | None = None,
    ledger: bool = True,
) -> Plan:
    """Every queue a topology of this shape may have, whatever MAX_DELAY it was declared with.

    Raising MAX_DELAY without changing the level count adds top-level queues
    to a live topology; inspecting or removing an old topology must see them.
    """
    capacity_ms = (radix**levels - 1) * resolution_ms
    return build_plan(
        prefix=prefix,
        radix=radix,
        resolution_ms=resolution_ms,
        max_delay_ms=min(capacity_ms, MAX_TTL_MS),
        queue_type=queue_type,
        queues=queues,
        levels=levels,
        hold_levels=hold_levels,
        max_priority=max_priority,
        delay_queue_type=delay_queue_type,
    )


def recorded_plan(record: Mapping[str, Any], *, prefix: str, queues: tuple[str, ...]) -> Plan:
    """The plan of a topology from its registry record (:meth:`Plan.record`).

    It has every queue a topology of that shape may have (:func:`widest_plan`),
    since the record does not say which MAX_DELAY declared it.
    """
    return widest_plan(
        prefix=prefix,
        radix=int(record["radix"]),
        resolution_ms=int(record["resolution_ms"]),
        levels=int(record["levels"]),
        queue_type=str(record["queue_type"]),
        queues=queues,
        # Recorded before the last mile: every level declared.
        hold_levels=int(record.get("hold_levels", 0)),
        # Recorded before priorities: FIFO ready queues.
        max_priority=int(record.get("max_priority", 0)),
        # Recorded before quorum delay queues: the delay queues were of queue_type.
        delay_queue_type=str(record.get("delay_queue_type") or record["queue_type"]),
    )


def levels_for(max_units: int, radix: int) -> int:
    """The fewest base-``radix`` digits that can write ``max_units``."""
    levels = 1
    while radix**levels - 1 < max_units:
        levels += 1
    return levels


#: The delivery limit of quorum queues whose messages must never be dropped
#: for being handed back: RabbitMQ 4 gives every quorum queue a limit of 20
#: unless told otherwise. (-1, "none", is refused before 4.0.)
NO_DELIVERY_LIMIT = 1_000_000_000


def _queue_arguments(queue_type: str, group_size: int) -> dict[str, Any]:
    # The type is always sent: a vhost's default queue type (quorum on some
    # hosted brokers) applies to a queue declared without one, and would turn
    # a classic topology into quorum queues without the arguments quorum mode
    # needs (at-least-once dead-lettering, reject-publish, delivery limits).
    if queue_type == "quorum":
        return {
            "x-queue-type": "quorum",
            # Copies on this many nodes (RabbitMQ caps it at the cluster's size).
            "x-quorum-initial-group-size": group_size,
            # Leaders spread over the nodes, not all on the node the topology
            # was declared through: the hops' work is spread with them.
            "x-queue-leader-locator": "balanced",
        }
    return {"x-queue-type": "classic"}


def _ready_queue_arguments(
    queue_type: str,
    group_size: int,
    failed_exchange: str,
    delivery_limit: int,
    consumer_timeout_ms: int | None = None,
) -> dict[str, Any]:
    # A job that kills the worker every time is redelivered every time: a
    # quorum queue counts deliveries and, past the limit, dead-letters the job
    # to the failed queue instead of looping forever (classic queues cannot
    # count; the worker does it for them). Nothing else makes a ready queue
    # dead-letter.
    args = {**_queue_arguments(queue_type, group_size), "x-dead-letter-exchange": failed_exchange}
    if queue_type == "quorum":
        args["x-delivery-limit"] = delivery_limit
        # The move to the failed queue is confirmed too, like the delay hops.
        args["x-dead-letter-strategy"] = "at-least-once"
        args["x-overflow"] = "reject-publish"
        if consumer_timeout_ms is not None:
            # How long a worker may hold a job before the queue takes it back
            # for another worker (RabbitMQ 3.12+; 4.3 classic queues have no
            # such timeout, earlier ones only the broker-wide one).
            args["x-consumer-timeout"] = consumer_timeout_ms
    return args


def _kept_queue_arguments(queue_type: str, group_size: int) -> dict[str, Any]:
    # The failed and registry queues are read by taking messages and handing
    # them back. RabbitMQ 4 gives quorum queues a default delivery limit of 20
    # and would drop an entry read that often: set one that is never reached.
    args = _queue_arguments(queue_type, group_size)
    if queue_type == "quorum":
        args["x-delivery-limit"] = NO_DELIVERY_LIMIT
    return args


def _stream_arguments(queue_type: str, group_size: int, keep_ms: int) -> dict[str, Any]:
    # A cancel must outlive its job: a job may wait MAX_DELAY, and the cancel
    # stays in force CANCEL_MARGIN after that. RabbitMQ drops a stream's
    # messages by whole segments once all of a segment is older than
    # x-max-age: small segments keep little more than that.
    args: dict[str, Any] = {
        "x-queue-type": "stream",
        "x-max-age": f"{math.ceil(keep_ms / 1000)}s",
        "x-stream-max-segment-size-bytes": STREAM_SEGMENT_BYTES,
    }
    if queue_type == "quorum":
        args["x-initial-cluster-size"] = group_size
    return args


def _checkpoint_arguments(queue_type: str, group_size: int) -> dict[str, Any]:
    return {
        **_stream_arguments(queue_type, group_size, LEDGER_CHECKPOINTS_KEEP_MS),
        "x-stream-max-segment-size-bytes": CHECKPOINT_SEGMENT_BYTES,
    }


def _delay_queue_arguments(
    queue_type: str, group_size: int, ttl_ms: int, dead_letter_exchange: str
) -> dict[str, Any]:
    args: dict[str, Any] = {
        **_queue_arguments(queue_type, group_size),
        "x-message-ttl": ttl_ms,
        "x-dead-letter-exchange": dead_letter_exchange,
    }
    if queue_type == "quorum":
        # Dead-letter with publisher confirms between quorum queues, so a
        # message moving from one level to the next survives a broker crash.
        # at-least-once requires reject-publish overflow.
        args["x-dead-letter-strategy"] = "at-least-once"
        args["x-overflow"] = "reject-publish"
        # Nothing consumes a delay queue, but a job read out of one (moving
        # to another broker) must not be dropped for having been handed back.
        args["x-delivery-limit"] = NO_DELIVERY_LIMIT
    return args


class TopologySettings(Protocol):
    """What the plan needs of the settings (``deferred.conf.DeferredSettings`` has it).

    Named here so that the plan, which is pure, depends on nothing above it.
    """

    @property
    def prefix(self) -> str: ...
    @property
    def radix(self) -> int: ...
    @property
    def resolution_ms(self) -> int: ...
    @property
    def max_delay_ms(self) -> int: ...
    @property
    def queue_type(self) -> str: ...
    @property
    def queues(self) -> tuple[str, ...]: ...
    @property
    def delivery_limit(self) -> int: ...
    @property
    def consumer_timeout_ms(self) -> int | None: ...
    @property
    def quorum_group_size(self) -> int: ...
    @property
    def cancel_margin_ms(self) -> int: ...
    @property
    def hold_window_ms(self) -> int: ...
    @property
    def priorities(self) -> bool: ...
    @property
    def result_ttl_ms(self) -> int: ...
    @property
    def delay_queue_type(self) -> str: ...
    @property
    def ledger(self) -> bool: ...
    def __hash__(self) -> int: ...


@lru_cache(maxsize=8)
def plan_topology(settings: TopologySettings) -> Plan:
    """Compute the whole topology for ``settings``. Pure and cached."""
    return build_plan(
        prefix=settings.prefix,
        radix=settings.radix,
        resolution_ms=settings.resolution_ms,
        max_delay_ms=settings.max_delay_ms,
        queue_type=settings.queue_type,
        queues=settings.queues,
        delivery_limit=settings.delivery_limit,
        consumer_timeout_ms=settings.consumer_timeout_ms,
        group_size=settings.quorum_group_size,
        cancel_margin_ms=settings.cancel_margin_ms,
        hold_window_ms=settings.hold_window_ms,
        max_priority=MAX_LEVEL if settings.priorities else 0,
        result_ttl_ms=settings.result_ttl_ms,
        delay_queue_type=settings.delay_queue_type,
        ledger=settings.ledger,
    )


def _ready_name(prefix: str, kind: str, queue: str, max_priority: int) -> str:
    """``<prefix>.ready.<queue>``, or ``<prefix>.ready.p9.<queue>`` with priorities."""
    return (
        f"{prefix}.{kind}.p{max_priority}.{queue}" if max_priority else f"{prefix}.{kind}.{queue}"
    )


def hold_levels_for(window_ms: int, radix: int, resolution_ms: int, levels: int) -> int:
    """The lowest levels a window of ``window_ms`` covers whole: ``radix**k`` units
    fit in it. At least one level stays declared: the window never holds the
    longest delays."""
    held = 0
    while held + 1 < levels and radix ** (held + 1) * resolution_ms <= window_ms:
        held += 1
    return held


#: The routing key of a cancel, on the ingest exchange.
CANCEL_ROUTING_KEY = "cancel"
#: The routing key of result records and the readers' markers, on the ingest exchange.
RESULT_ROUTING_KEY = "result"
#: The routing key of a ledger reader's end marker (deferred.records.pending): through the
#: ingest exchange, which a web process may write to, like the results reader's.
LEDGER_ROUTING_KEY = "ledger"
#: How long the ledger stream keeps a record. The keeper writes a pending job's
#: record again before it gets this old (deferred.worker.keeper).
LEDGER_KEEP_MS = 7 * 24 * 3600 * 1000
#: How long the checkpoints' streams keep a page or a head: a few checkpoints (a
#: listing reads the newest; the keeper writes one every few minutes at most).
LEDGER_CHECKPOINTS_KEEP_MS = 3600 * 1000
#: Their segments: small, so that what is past its age goes soon.
CHECKPOINT_SEGMENT_BYTES = 4_000_000


def build_plan(
    *,
    prefix: str,
    radix: int,
    resolution_ms: int,
    max_delay_ms: int,
    queue_type: str,
    queues: tuple[str, ...] | list[str],
    levels: int | None = None,
    delivery_limit: int = 5,
    consumer_timeout_ms: int | None = None,
    group_size: int = 3,
    cancel_margin_ms: int = CANCEL_MARGIN_MS,
    hold_window_ms: int = 0,
    hold_levels: int | None = None,
    max_priority: int = 0,
    result_ttl_ms: int = RESULT_TTL_MS,
    delay_queue_type: str | None = None,
    ledger: bool = True,
) -> Plan:
    """Compute a topology from its defining values.

    ``levels`` is derived from ``max_delay_ms`` unless given, and
    ``hold_levels`` from ``hold_window_ms``: an old topology recorded in the
    registry is rebuilt from what it was declared with.

    ``max_priority``: classic ready and hold queues take ``x-max-priority``.
    A queue's arguments cannot change, so they get names of their own
    (``<prefix>.ready.p9.<queue>``) and the topology an id of its own
    (``....P9.classic``): the older topologies keep delivering into the FIFO
    queues, whose messages the workers forward to the new ones
    (:attr:`Plan.legacy_queues`). Quorum queues order by priority with no
    argument (RabbitMQ 4.0+), so nothing changes for them.

    ``delay_queue_type``: the delay queues' type (``None``: ``queue_type``).
    Quorum delay queues under classic ready queues make a topology of their
    own (``....classic.quorum-delays``): the id says both.
    """
    delay_type = delay_queue_type or queue_type
    if radix < 2:
        raise TopologyError(f"The radix must be at least 2, got {radix}.")
    if resolution_ms < 1:
        raise TopologyError(f"The resolution must be at least 1 ms, got {resolution_ms}.")
    max_units = max(1, math.ceil(max_delay_ms / resolution_ms))
    if levels is None:
        levels = levels_for(max_units, radix)
    longest_word = len(str(radix - 1))
    longest_queue = max((len(q.encode()) for q in queues), default=0)
    key_bytes = levels * (longest_word + 1) + longest_queue
    if key_bytes > MAX_ROUTING_KEY_BYTES:
        raise TopologyError(
            f"Routing keys would be up to {key_bytes} bytes ({levels} levels of radix {radix} "
            f"plus the queue name), above AMQP's limit of {MAX_ROUTING_KEY_BYTES}: use a "
            "larger RADIX or RESOLUTION, a smaller MAX_DELAY, or shorter queue names."
        )

    if hold_levels is None:
        hold_levels = hold_levels_for(hold_window_ms, radix, resolution_ms, levels)
    held = hold_levels
    # The hold word, after the declared digits: any value on the way, "0" into
    # the ready queue, "1" into the hold queue. None without held levels.
    on_the_way, to_ready, to_hold = (["*"], ["0"], ["1"]) if held else ([], [], [])
    if queue_type != "classic":
        max_priority = 0
    if not 0 <= max_priority <= MAX_LEVEL:
        raise TopologyError(f"max_priority must be from 0 to {MAX_LEVEL}, got {max_priority}.")
    marks = f"{f'.H{held}' if held else ''}{f'.P{max_priority}' if max_priority else ''}"
    topology_id = f"r{radix}.{resolution_ms}ms.L{levels}{marks}.{queue_type}"
    if delay_type != queue_type:
        topology_id += f".{delay_type}-delays"
    base = f"{prefix}.delay.{topology_id}"
    ingest = f"{base}.ingest"
    failed = f"{prefix}.failed"

    def level_exchange(level: int) -> str:
        return f"{base}.after.L{level:02d}"

    def pattern(words: list[str]) -> str:
        # The final "*" is the target queue name: always exactly one word.
        return ".".join([*words, "*"])

    # Only the digits a delay up to the maximum can use; above the top level's
    # largest digit a queue would only hold TTLs no job may ask for (and could
    # exceed RabbitMQ's 10-year TTL limit).
    top_digit = min(radix - 1, max_units // radix ** (levels - 1))
    exchanges = [Exchange(ingest)]
    delay_queues: list[Queue] = []
    positions: list[tuple[int, int, str]] = []
    bindings: list[Binding] = []
    for level in range(levels - 1, held - 1, -1):
        exchanges.append(Exchange(level_exchange(level), arguments={"alternate-exchange": failed}))
        last_digit = top_digit if level == levels - 1 else radix - 1
        for digit in range(1, last_digit + 1):
            ttl_ms = digit * radix**level * resolution_ms
            if ttl_ms > MAX_TTL_MS:
                raise TopologyError(
                    f"Level {level} digit {digit} needs a TTL of {ttl_ms} ms, above RabbitMQ's "
                    f"limit of {MAX_TTL_MS} ms (10 years): lower MAX_DELAY."
                )
            delay_queues.append(
                Queue(
                    name=f"{base}.L{level:02d}.d{digit:02d}",
                    arguments=_delay_queue_arguments(
                        delay_type, group_size, ttl_ms, level_exchange(level)
                    ),
                    ttl_ms=ttl_ms,
                    level=level,
                    digit=digit,
                )
            )
            positions.append((level, digit, delay_queues[-1].name))

    for level, digit, queue_name in positions:
        # From the ingest exchange: every digit above ``level`` is zero.
        words = ["0"] * (levels - 1 - level) + [str(digit)] + ["*"] * (level - held) + on_the_way
        bindings.append(Binding(ingest, queue_name, pattern(words)))
        # From the exchange of each higher level ``above``: levels >= above are
        # done, the ones between are zero, this one is ``digit``.
        for above in range(level + 1, levels):
            words = (
                ["*"] * (levels - above)
                + ["0"] * (above - 1 - level)
                + [str(digit)]
                + ["*"] * (level - held)
                + on_the_way
            )
            bindings.append(Binding(level_exchange(above), queue_name, pattern(words)))
    # Cancels go through the ingest exchange too (one word: no delay pattern,
    # which has levels + 1 words, matches it), so a user that may publish
    # there may cancel, and needs no right on the default exchange.
    bindings.append(Binding(ingest, f"{prefix}.cancels", CANCEL_ROUTING_KEY))
    # Results the same way: a web process reading one writes a marker there.
    bindings.append(Binding(ingest, f"{prefix}.results", RESULT_ROUTING_KEY))
    # No digit left: to the ready queue named by the last word.
    ready_args = _ready_queue_arguments(
        queue_type, group_size, failed, delivery_limit, consumer_timeout_ms
    )
    if max_priority:
        ready_args["x-max-priority"] = max_priority
    ready_queues = {
        name: Queue(_ready_name(prefix, "ready", name, max_priority), dict(ready_args))
        for name in queues
    }
    hold_queues = {
        name: Queue(_ready_name(prefix, "hold", name, max_priority), dict(ready_args))
        for name in queues
    }
    # With held levels, "1" in the hold word: to the hold queue instead.
    targets = [(ready_queues, to_ready)] + ([(hold_queues, to_hold)] if held else [])
    for by_name, last in targets:
        for name, queue in by_name.items():
            words = ["0"] * (levels - held) + last + [name]
            bindings.append(Binding(ingest, queue.name, ".".join(words)))
            for above in range(held, levels):
                words = ["*"] * (levels - above) + ["0"] * (above - held) + last + [name]
                bindings.append(Binding(level_exchange(above), queue.name, ".".join(words)))

    # Every job published, as published, into the ledger too: the broker makes the
    # copy (one publish, one confirm for both queues). With the patterns that lead
    # into the delay, ready and hold queues (the jobs' routes), not a catch-all:
    # cancels and results have routes of their own. A job due at once is kept
    # too, for it is pending until a worker takes it (deferred.records.pending reads it
    # back); the cost is that one for a ready queue deleted by hand is kept by
    # the ledger alone rather than refused as unroutable.
    if ledger:
        job_queues = {q.name for q in delay_queues}
        job_queues.update(q.name for q in (*ready_queues.values(), *hold_queues.values()))
        patterns = dict.fromkeys(
            b.routing_key for b in bindings if b.source == ingest and b.destination in job_queues
        )
        bindings.extend(Binding(ingest, f"{prefix}.ledger", p) for p in patterns)
        bindings.append(Binding(ingest, f"{prefix}.ledger", LEDGER_ROUTING_KEY))

    return Plan(
        prefix=prefix,
        topology_id=topology_id,
        radix=radix,
        resolution_ms=resolution_ms,
        levels=levels,
        max_delay_ms=max_delay_ms,
        queue_type=queue_type,
        ingest_exchange=ingest,
        exchanges=tuple(exchanges),
        delay_queues=tuple(delay_queues),
        bindings=tuple(bindings),
        ready_queues=ready_queues,
        hold_queues=hold_queues,
        hold_levels=held,
        max_priority=max_priority,
        delay_queue_type=delay_type,
        failed_queue=Queue(failed, _kept_queue_arguments(queue_type, group_size)),
        failed_exchange=Exchange(failed, "fanout"),
        registry_queue=Queue(f"{prefix}.topologies", _kept_queue_arguments(queue_type, group_size)),
        scheduler_queue=Queue(
            f"{prefix}.scheduler",
            {**_kept_queue_arguments(queue_type, group_size), "x-single-active-consumer": True},
        ),
        schedules_queue=Queue(f"{prefix}.schedules", _kept_queue_arguments(queue_type, group_size)),
        cancels_queue=Queue(
            f"{prefix}.cancels",
            _stream_arguments(queue_type, group_size, max_delay_ms + cancel_margin_ms),
        ),
        results_queue=Queue(
            f"{prefix}.results", _stream_arguments(queue_type, group_size, result_ttl_ms)
        ),
        ledger_queue=(
            Queue(f"{prefix}.ledger", _stream_arguments(queue_type, group_size, LEDGER_KEEP_MS))
            if ledger
            else None
        ),
        ledger_pages_queue=(
            Queue(f"{prefix}.ledger-pages", _checkpoint_arguments(queue_type, group_size))
            if ledger
            else None
        ),
        ledger_heads_queue=(
            Queue(f"{prefix}.ledger-heads", _checkpoint_arguments(queue_type, group_size))
            if ledger
            else None
        ),
        keeper_queue=(
            Queue(
                f"{prefix}.keeper",
                {**_kept_queue_arguments(queue_type, group_size), "x-single-active-consumer": True},
            )
            if ledger
            else None
        ),
        # Classic whatever QUEUE_TYPE: its one message must not survive a restart.
        up_queue=Queue(f"{prefix}.up", {"x-queue-type": "classic"}) if ledger else None,
    )
