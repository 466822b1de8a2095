"""Consuming: the worker's connection lives on one I/O thread, and other threads
hand acks back to it with ``add_callback_threadsafe``.

The worker never holds more unacked jobs than its concurrency, across all its
queues. RabbitMQ caps unacked deliveries per consumer, and a consumer's cap
is fixed once it consumes; the cap shared by a channel's consumers
(``basic.qos`` with ``global``) is the deprecated feature ``global_qos``,
which 4.3 denies by default and then ignores without a word, and which quorum
queues never had. So :class:`Slots` splits the concurrency: a queue gets a
consumer whose prefetch RabbitMQ enforces when there are slots for every
queue, and the other slots *roam*: the consumer fills them itself with
``basic.get``, from whichever queue has jobs. An idle queue's consumer lends
its slot to a queue with jobs waiting (it is cancelled, and consumed again
once that queue is drained): ``--concurrency N`` runs N jobs of one queue at
once, however many queues the worker has.

Held jobs (the last mile, :mod:`deferred.worker.holding`) come from the hold queues,
each through a consumer of its own whose prefetch is the worker's hold
allowance (``HOLD_PREFETCH``): held jobs are counted apart from the jobs to
run, and never take their slots.

Legacy queues: the FIFO ready and hold queues of a prefix whose topology has
moved to priority queues, where older topologies still deliver. Nothing runs
from them: a consumer on a channel of its own forwards each message to the
queue that replaced its queue (``forward``, a confirmed publish) and only then
acks it, outside the slots, so they cost the worker's jobs nothing. They are
looked for at each connect; when ``declare_delay_topology --remove-empty``
deletes one, RabbitMQ cancels its consumer and the worker goes on without it.
A message delivered to the forwarder when its queue went is still forwarded:
the ack is what fails, on the forwarder's channel alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel

from deferred.broker.admin import admin_channel, declared_queue, quiet_probes
from deferred.broker.connection import (
    CONNECTION_ERRORS,
    Node,
    Urls,
    as_urls,
    close_quietly,
    open_connection,
    setting_up,
)
from deferred.broker.errors import NOT_DECLARED_HINT, BrokerUnavailable, TopologyNotDeclared

logger = logging.getLogger("deferred.broker")

#: With free roaming slots and no queue known to hold jobs, the queues are looked
#: into again after this long at first,
PROBE_FIRST_S = 0.002
#: and the wait doubles while they stay empty, up to this: how late a job may
#: start for want of a consumer on its queue, against how often an idle worker asks.
PROBE_CAP_S = 0.05
#: With every slot taken or kept by a consumer, a queue whose consumer is busy is looked
#: into (for jobs an idle queue's consumer could lend its slot to) after a wait that
#: doubles up to this: a long job must not cost the broker a passive declare every 50 ms.
LEND_PROBE_CAP_S = 0.5
#: Messages of the legacy queues in flight to the forwarder at once.
FORWARD_PREFETCH = 50
#: A job's thread that finds the I/O thread silent for this long (the process was
#: paused, say) waits for its next turn before it takes a delivery as still ours,
#: for up to STALE_WAIT_S: the connection may have died meanwhile, unnoticed.
STALE_AFTER_S = 1.0
STALE_WAIT_S = 5.0
#: Why the consuming connection went, as :attr:`Consumer.lost` says it.
LOST_CONNECTION = "connection"
LOST_CONSUMER_TIMEOUT = "consumer_timeout"
#: How many generations' reasons are kept: a job outlives a few reconnects at most.
LOST_KEPT = 16


@dataclass(frozen=True)
class Delivery:
    """One message handed to the worker, with what is needed to ack it later."""

    body: bytes
    tag: int
    queue: str
    redelivered: bool
    #: Which connection the tag belongs to: tags of a lost connection are void.
    generation: int
    headers: dict[str, Any]
    #: The publisher's ``message_id`` (a job's id), if any.
    message_id: str | None = None
    #: From a hold queue: a job due within the hold window, to be held.
    hold: bool = False
    #: Its AMQP priority (0-9), as published; ``None`` if it had none.
    priority: int | None = None
    #: When it arrived (time.monotonic()).
    received: float = 0.0


def pinned_prefetch(limit: int, queues: Sequence[str]) -> dict[str, int]:
    """The prefetch of each queue's consumer, for ``limit`` unacked jobs in all; the
    slots not given out here roam.

    One queue takes every slot, as a consumer of prefetch ``limit``: the one
    case the broker caps alone, and the fastest. Several queues get a consumer
    each, of prefetch 1, when there are slots for all of them: a job that
    arrives in an idle queue starts at once, pushed. Those consumers are
    doorbells, not shares: when a busy queue needs the slot an idle queue's
    consumer keeps, that consumer is cancelled (:meth:`Slots.to_release`) and
    comes back once the busy queue is drained, so that ``limit`` jobs of one
    queue run at once whatever the number of queues. With fewer slots than
    queues, no consumer: every slot roams.
    """
    if len(queues) == 1:
        return {queues[0]: limit}
    if len(queues) <= limit:
        return dict.fromkeys(queues, 1)
    return {}


def hold_prefetch(limit: int, queues: Sequence[str]) -> dict[str, int]:
    """The prefetch of each hold queue's consumer: ``limit`` shared out, at least one each."""
    if not queues or limit < 1:
        return {}
    share, extra = divmod(limit, len(queues))
    return {q: max(1, share + (1 if n < extra else 0)) for n, q in enumerate(queues)}


class Slots:
    """Who may take how many unacked jobs: the worker's cap, with no broker in it.

    The consumers of ``pinned`` queues are capped by RabbitMQ, and the room a
    consumer has is a slot kept for its queue; the roaming slots, the rest, are
    filled by the consumer with ``basic.get``, one job per free slot, so that the
    two together never exceed ``limit``. Queues with jobs take turns; with none
    known, the queues whose jobs no consumer would be handed are looked into
    after a wait that doubles while they stay empty (:data:`PROBE_FIRST_S` to
    :data:`PROBE_CAP_S`), and while some are known, the others every
    :data:`PROBE_CAP_S`, so that a busy queue does not starve them.

    When a queue with jobs waiting needs a slot that only an idle queue's
    consumer keeps, that consumer is released (:meth:`to_release`: the caller
    cancels it), and it is consumed again (:meth:`to_restore`) once no queue is
    known to hold jobs and a slot is free for it. Only a consumer holding no job
    is released: what a consumer holds is always its own. Driven from the I/O
    thread only.
    """

    def __init__(self, limit: int, queues: Sequence[str]) -> None:
        self.limit = limit
        self.queues = list(queues)
        #: The prefetch of each queue's consumer, while it has one.
        self.pinned = pinned_prefetch(limit, self.queues)
        #: The slots that roam while every consumer is up.
        self.roaming = limit - sum(self.pinned.values())
        #: The queues whose consumer is up: all of them at first.
        self.consuming: set[str] = set(self.pinned)
        #: Unacked deliveries by tag: the queue whose consumer took it, ``None`` if a slot roamed.
        self._held: dict[int, str | None] = {}
        #: How many of them each queue's consumer holds (``_held`` counted, kept as it
        #: changes: the I/O thread asks several times a delivery).
        self._pushed: Counter[str] = Counter()
        #: Queues thought to hold jobs, in turn: the next roaming slot takes from the first.
        self._candidates: deque[str] = deque()
        self._probe_at = 0.0
        self._probe_wait = PROBE_FIRST_S
        #: When the queues not known to hold jobs are looked into next, while some are.
        self._aside_at = 0.0
        #: When the busy queues are looked into next for a consumer to lend (to_release).
        self._lend_at = 0.0
        self._lend_wait = PROBE_FIRST_S

    def room(self, queue: str) -> int:
        """How many more jobs ``queue``'s consumer may be pushed: 0 without a consumer."""
        if queue not in self.consuming:
            return 0
        return self.pinned[queue] - self._pushed[queue]

    def free(self) -> int:
        """Roaming slots with no job: the cap, less the jobs held and the consumers' room."""
        return self.limit - len(self._held) - sum(self.room(q) for q in self.consuming)

    def unseen(self) -> list[str]:
        """Queues where a job may wait with no consumer to be handed it: no consumer,
        or one with no room left."""
        return [q for q in self.queues if not self.room(q)]

    def took(self, tag: int, queue: str, *, pinned: bool, now: float) -> None:
        """A delivery from ``queue``, pushed to its consumer or taken by a roaming slot."""
        self._held[tag] = queue if pinned else None
        if pinned:
            self._pushed[queue] += 1
        # Where one job was, more may wait: that queue goes to the back of the
        # turn, behind the others with jobs, and they are looked into at once.
        if queue in self._candidates:
            self._candidates.remove(queue)
        if not pinned or queue in self.unseen():
            self._candidates.append(queue)
        self._probe_at, self._probe_wait = now, PROBE_FIRST_S
        self._lend_at, self._lend_wait = now, PROBE_FIRST_S

    def settled(self, tag: int) -> None:
        queue = self._held.pop(tag, None)
        if queue is not None:
            self._pushed[queue] -= 1

    def empty(self, queue: str) -> None:
        """``queue`` had no job to take: it loses its turn until it shows one."""
        if queue in self._candidates:
            self._candidates.remove(queue)

    def next_queue(self, now: float, probe: Callable[[list[str]], list[str]]) -> str | None:
        """The queue a free roaming slot takes from next, or ``None`` for now.

        With no queue known to hold jobs and the wait over, ``probe`` is asked
        which of the unseen queues hold some; with some known, it is asked of
        the other unseen queues every :data:`PROBE_CAP_S`.
        """
        if self._candidates:
            others = [q for q in self.unseen() if q not in self._candidates]
            if others and now >= self._aside_at:
                self._aside_at = now + PROBE_CAP_S
                # They waited while the others were served: they go first.
                self._candidates.extendleft(reversed(probe(others)))
            return self._candidates[0]
        unseen = self.unseen()
        if not unseen or now < self._probe_at:
            return None
        # The wait grows even when the probe finds jobs: only a job taken
        # resets it, so a count the gets cannot match never makes a busy loop.
        self._probe_at = now + self._probe_wait
        self._probe_wait = min(self._probe_wait * 2, PROBE_CAP_S)
        self._aside_at = now + PROBE_CAP_S
        self._candidates.extend(probe(unseen))
        return self._candidates[0] if self._candidates else None

    def to_release(self, now: float, probe: Callable[[list[str]], list[str]]) -> str | None:
        """The idle queue whose consumer to cancel, so that its slot goes to a queue
        whose jobs wait unseen; ``None`` when none should be.

        ``probe`` is asked first whether the queues that may hold jobs do: those
        known to have had one (a consumer was just pushed a job, and may have no
        other), else, once the wait between looks is over (it doubles up to
        :data:`LEND_PROBE_CAP_S` while nothing is found), every unseen queue. A
        queue found empty loses its turn: a lone job costs a look, not a cancel
        and a consume. The idle queue is asked about too, and keeps its consumer
        if it holds a job.
        """
        if len(self.pinned) < 2:
            return None  # one queue's consumer, or none: nothing to lend
        idle = self._idle() if self.free() <= 0 else None
        if idle is None:
            return None
        unseen = self.unseen()
        waiting = [q for q in self._candidates if q in unseen]
        if not waiting:
            if not unseen or now < self._lend_at:
                return None
            waiting = unseen
        self._lend_at = now + self._lend_wait
        self._lend_wait = min(self._lend_wait * 2, LEND_PROBE_CAP_S)
        # The idle queue is looked into too: one with a job on its way to its own
        # consumer keeps it (a job pushed as the consumer is cancelled would go back to
        # its queue, marked redelivered).
        found = probe([*waiting, idle])
        for queue in waiting:
            if queue in self._candidates and queue not in found:
                self._candidates.remove(queue)
            elif queue in found and queue not in self._candidates:
                self._candidates.append(queue)
        if idle in found:
            return None
        return idle if any(q in found for q in waiting) else None

    def _idle(self) -> str | None:
        """A queue whose consumer has room and no known job waiting: the last such."""
        for queue in reversed(self.queues):
            if queue in self.consuming and queue not in self._candidates and self.room(queue):
                return queue
        return None

    def released(self, queue: str) -> None:
        """``queue``'s consumer was cancelled."""
        self.consuming.discard(queue)

    def to_restore(self) -> str | None:
        """A queue whose consumer to start again, now that no queue is known to hold
        jobs and a slot is free for it; ``None`` when none should be."""
        if self._candidates:
            return None
        for queue in self.queues:
            if queue in self.pinned and queue not in self.consuming:
                return queue if self.free() >= self.pinned[queue] else None
        return None

    def restored(self, queue: str) -> None:
        """``queue`` has a consumer again."""
        self.consuming.add(queue)

    def wait(self, seconds: float, now: float) -> float:
        """How long the I/O thread may wait for the broker before roaming slots look again."""
        if not self.unseen() or (self.free() <= 0 and self._idle() is None):
            return seconds
        if self.free() <= 0:
            return max(0.0, min(seconds, self._lend_at - now))
        if self._candidates:
            return max(0.0, min(seconds, self._aside_at - now))
        return max(0.0, min(seconds, self._probe_at - now))


class Consumer:
    """The worker's single consuming connection, driven from one I/O thread."""

    def __init__(
        self,
        urls: Urls,
        queues: list[str],
        prefetch: int,
        *,
        hold_queues: Sequence[str] = (),
        hold_prefetch: int = 0,
        legacy_queues: Mapping[str, str] | None = None,
        forward: Callable[[str, bytes, str | None, dict[str, Any]], None] | None = None,
        heartbeat: int | None = None,
    ) -> None:
        self.urls = as_urls(urls)
        #: The connection's heartbeat in seconds (``None``: the broker's, 60 s by default).
        self.heartbeat = heartbeat
        #: Why the connections of the last few generations went: :data:`LOST_CONNECTION`
        #: or :data:`LOST_CONSUMER_TIMEOUT` (see :meth:`why_lost`).
        self._lost: dict[int, str] = {}
        #: How many times the I/O thread came back from the broker, and when it last did:
        #: a job's thread checks them before it trusts the connection (see holds()).
        self._turns = 0
        self._turned_at = time.monotonic()
        self._turned = threading.Condition()
        self._io_thread: int | None = None
        self.queues = queues
        #: Legacy queue -> the queue its messages are forwarded to (see above).
        self.legacy_queues = dict(legacy_queues or {})
        #: Publishes one message to a queue, confirmed (``BrokerError`` if it cannot).
        self._forward = forward
        #: The legacy queues forwarded on the current connection.
        self.forwarding: list[str] = []
        self._forward_channel: BlockingChannel | None = None
        #: The most unacked deliveries held at once, all queues together.
        self.prefetch = prefetch
        self.hold_queues = list(hold_queues)
        #: The most unacked held jobs, split between the hold queues' consumers.
        self.hold_prefetch = hold_prefetch
        self.generation = 0
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        #: The node consumed from; ``None`` while not connected.
        self.node: Node | None = None
        self._tags: list[str] = []
        #: The consumer tag of each ready queue's consumer, while it has one (see Slots).
        self._doorbells: dict[str, str] = {}
        self._cancelled_by_broker: str | None = None
        #: The cap of the current connection; ``None`` while not connected.
        self._slots: Slots | None = None
        #: Whether roaming slots take jobs: from the start until :meth:`cancel`.
        self._taking = False
        self._on_delivery: Callable[[Delivery], None] | None = None
        #: Settlements asked for by other threads, and whether the I/O thread was woken.
        self._to_settle: deque[tuple[Delivery, bool, bool]] = deque()
        self._settle_lock = threading.Lock()
        self._settle_woken = False

    def start(self, on_delivery: Callable[[Delivery], None]) -> None:
        """Connect and start consuming; ``BrokerUnavailable`` or ``TopologyNotDeclared``."""
        self.close()
        connection, node = open_connection(self.urls, heartbeat=self.heartbeat)
        with setting_up(connection, node, "start consuming"):
            channel = connection.channel()
            # Why the broker closed it, should it: its consumer timeout says so.
            channel._impl.add_on_close_callback(self._on_channel_closed)
            for queue in (*self.queues, *self.hold_queues):
                declared_queue(channel, queue, node)
            self.generation += 1
            with self._settle_lock:
                # Settlements of the connection that went are void, and its wake with it.
                self._to_settle.clear()
                self._settle_woken = False
            self._cancelled_by_broker = None
            self._on_delivery = on_delivery
            slots = Slots(self.prefetch, self.queues)
            channel.add_on_cancel_callback(self._on_broker_cancel)
            self._doorbells = {}
            for queue in slots.pinned:
                self._consume(channel, slots, queue)
            for queue, prefetch in hold_prefetch(self.hold_prefetch, self.hold_queues).items():
                channel.basic_qos(prefetch_count=prefetch)
                self._tags.append(channel.basic_consume(queue, partial(self._to_hold, queue)))
            self._start_forwarding(connection)
        self._connection, self._channel, self.node = connection, channel, node
        self._slots, self._taking = slots, True
        for old in [g for g in self._lost if g < self.generation - LOST_KEPT]:
            del self._lost[old]
        self._turn()

    def _on_channel_closed(self, _channel: Any, reason: Exception) -> None:
        # "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out..."
        text = str(getattr(reason, "reply_text", "")).lower()
        if isinstance(reason, px.ChannelClosedByBroker) and "acknowledgement" in text:
            self._lost[self.generation] = LOST_CONSUMER_TIMEOUT

    def why_lost(self, generation: int) -> str | None:
        """Why the connection of ``generation`` went: :data:`LOST_CONNECTION`,
        :data:`LOST_CONSUMER_TIMEOUT`, or ``None`` (up, closed by the worker, or long ago)."""
        return self._lost.get(generation)

    def _turn(self) -> None:
        """The I/O thread is back from the broker: threads waiting in holds() look again."""
        with self._turned:
            self._io_thread = threading.get_ident()
            self._turns += 1
            self._turned_at = time.monotonic()
            self._turned.notify_all()

    def _start_forwarding(self, connection: pika.BlockingConnection) -> None:
        """Consume the legacy queues that exist, on a channel of their own."""
        found = _existing(connection, list(self.legacy_queues)) if self._forward else []
        self.forwarding, self._forward_channel = found, None
        if not found:
            return
        channel = connection.channel()
        channel.basic_qos(prefetch_count=FORWARD_PREFETCH)
        channel.add_on_cancel_callback(self._forward_cancelled)
        for queue in found:
            channel.basic_consume(queue, partial(self._forwarded, queue))
        self._forward_channel = channel
        logger.info(
            "Forwarding the queues %s (older topologies still deliver there) to the "
            "queues that replaced them when PRIORITIES changed.",
            ", ".join(found),
        )

    def _forwarded(
        self, queue: str, channel: BlockingChannel, method: Any, props: Any, body: bytes
    ) -> None:
        """On the I/O thread: a legacy queue's message goes on to its new queue, then is acked."""
        assert self._forward is not None
        target = self.legacy_queues[queue]
        try:
            self._forward(target, body, props.message_id, dict(props.headers or {}))
        except Exception as exc:  # noqa: BLE001 - left in its queue, forwarded later
            logger.warning("Could not forward a message from %s to %s: %s", queue, target, exc)
            with contextlib.suppress(*CONNECTION_ERRORS, px.AMQPChannelError):
                channel.basic_nack(method.delivery_tag, requeue=True)
            return
        try:
            channel.basic_ack(method.delivery_tag)
        except (*CONNECTION_ERRORS, px.AMQPChannelError):
            # Its queue went meanwhile: the message is in its new queue already.
            logger.info("Forwarded a message of %s after that queue was deleted.", queue)

    def _forward_cancelled(self, method: Any) -> None:
        # A legacy queue deleted (--remove-empty): nothing more to forward from it.
        tag = str(getattr(method.method, "consumer_tag", "?"))
        logger.info("RabbitMQ cancelled the forwarding of a replaced queue (%s): it is gone.", tag)

    def _pushed(
        self, queue: str, channel: BlockingChannel, method: Any, props: Any, body: bytes
    ) -> None:
        self._deliver(queue, method, props, body, pinned=True)

    def _to_hold(
        self, queue: str, channel: BlockingChannel, method: Any, props: Any, body: bytes
    ) -> None:
        # Capped by its own consumer's prefetch: not one of the slots.
        assert self._on_delivery is not None
        self._on_delivery(self._delivery(queue, method, props, body, hold=True))

    def _deliver(self, queue: str, method: Any, props: Any, body: bytes, *, pinned: bool) -> None:
        assert self._slots is not None and self._on_delivery is not None
        self._slots.took(method.delivery_tag, queue, pinned=pinned, now=time.monotonic())
        self._on_delivery(self._delivery(queue, method, props, body))

    def _delivery(
        self, queue: str, method: Any, props: Any, body: bytes, *, hold: bool = False
    ) -> Delivery:
        return Delivery(
            body=body,
            tag=method.delivery_tag,
            queue=queue,
            redelivered=bool(method.redelivered),
            generation=self.generation,
            headers=dict(props.headers or {}),
            message_id=props.message_id,
            hold=hold,
            priority=props.priority,
            received=time.monotonic(),
        )

    def _roam(self) -> None:
        """Fill the free roaming slots, one ``basic.get`` each, from queues with jobs."""
        channel, slots = self._channel, self._slots
        if channel is None or slots is None or not self._taking:
            return

        def probe(queues: list[str]) -> list[str]:
            return [
                q for q in queues if channel.queue_declare(q, passive=True).method.message_count
            ]

        while True:
            if not slots.free():
                idle = slots.to_release(time.monotonic(), probe)
                if idle is None:
                    break
                # Its slot goes to a queue with jobs waiting. A job pushed to it
                # meanwhile goes back to its queue (pika rejects it), marked redelivered.
                channel.basic_cancel(self._doorbells.pop(idle))
                slots.released(idle)
                continue
            queue = slots.next_queue(time.monotonic(), probe)
            if queue is None:
                break
            method, props, body = channel.basic_get(queue)
            if method is None:
                slots.empty(queue)  # another worker took it first
            else:
                self._deliver(queue, method, props, body, pinned=False)
        while (queue := slots.to_restore()) is not None:
            self._consume(channel, slots, queue)

    def _consume(self, channel: BlockingChannel, slots: Slots, queue: str) -> None:
        """Start ``queue``'s consumer, of the prefetch its slots give it."""
        # A consumer's prefetch is the channel's at its basic.consume.
        channel.basic_qos(prefetch_count=slots.pinned[queue])
        self._doorbells[queue] = channel.basic_consume(queue, partial(self._pushed, queue))
        slots.restored(queue)

    def _on_broker_cancel(self, method: Any) -> None:
        # The broker cancels a consumer when its queue is deleted (or its node
        # goes away); pika just stops delivering. Treat it as a lost connection
        # so the worker reconnects and finds out whether the queue is back.
        self._cancelled_by_broker = str(getattr(method.method, "consumer_tag", "?"))

    def poll(self, seconds: float) -> None:
        """Take jobs for the free slots, deliver messages and run queued callbacks for up
        to ``seconds``."""
        connection, slots = self._connection, self._slots
        if connection is None or self._channel is None or slots is None:
            raise BrokerUnavailable("Not connected.")
        try:
            self._poll(connection, slots, seconds)
        finally:
            # Once what the turn found is known (the connection or channel dropped):
            # threads waiting in holds() look again.
            self._turn()

    def _poll(self, connection: pika.BlockingConnection, slots: Slots, seconds: float) -> None:
        try:
            self._roam()
            wait = slots.wait(seconds, time.monotonic()) if self._taking else seconds
            connection.process_data_events(time_limit=wait)
        except (*CONNECTION_ERRORS, px.AMQPChannelError) as exc:
            self._lost.setdefault(self.generation, LOST_CONNECTION)
            where = self._drop(lost=True)
            raise BrokerUnavailable(f"Lost the connection to RabbitMQ{where}: {exc!r}") from exc
        if self._channel is None or self._channel.is_closed:
            self._lost.setdefault(self.generation, LOST_CONNECTION)
            # e.g. RabbitMQ's consumer_timeout closes the channel, not the connection.
            self._drop(lost=False)
            raise BrokerUnavailable("RabbitMQ closed the consuming channel.")
        if self._cancelled_by_broker:
            # A quorum queue's leader moving away cancels consumers too: try
            # another node first.
            self._lost.setdefault(self.generation, LOST_CONNECTION)
            self._drop(lost=True)
            raise BrokerUnavailable(
                f"RabbitMQ cancelled consumer {self._cancelled_by_broker} (was a ready queue "
                "deleted?)."
            )

    def cancel(self) -> None:
        """Stop taking new messages; unacked ones stay with us until acked."""
        self._taking = False
        forwarding, self._forward_channel = self._forward_channel, None
        if forwarding is not None and forwarding.is_open:
            with contextlib.suppress(*CONNECTION_ERRORS, px.AMQPChannelError):
                forwarding.close()  # what it had not acked goes back to its queue
        channel, self._tags, self._doorbells = self._channel, [], {}
        if channel is None or not channel.is_open:
            return
        try:
            for tag in channel.consumer_tags:
                channel.basic_cancel(tag)
        except (*CONNECTION_ERRORS, px.AMQPChannelError) as exc:
            where = self._drop(lost=True)
            raise BrokerUnavailable(f"Lost the connection to RabbitMQ{where}: {exc!r}") from exc

    def holds(self, delivery: Delivery) -> bool:
        """Whether ``delivery``'s connection is still up, so that it is still ours.

        Once it is gone RabbitMQ has put the message back for another
        consumer: whoever still holds it should not run it too.
        """
        if not self._still_up(delivery):
            return False
        if threading.get_ident() == self._io_thread:
            return True
        with self._turned:
            if time.monotonic() - self._turned_at < STALE_AFTER_S:
                return True
            # The I/O thread has not been back from the broker for a while: this
            # process was paused (SIGSTOP, a frozen VM), and RabbitMQ may have
            # given the delivery to another worker meanwhile, which pika learns
            # only at its next turn. Wait for that turn.
            turns = self._turns
            self._turned.wait_for(lambda: self._turns != turns, timeout=STALE_WAIT_S)
        return self._still_up(delivery)

    def _still_up(self, delivery: Delivery) -> bool:
        connection, channel = self._connection, self._channel
        return (
            connection is not None
            and connection.is_open
            and channel is not None
            and channel.is_open
            and delivery.generation == self.generation
        )

    def settle_threadsafe(self, delivery: Delivery, *, ack: bool, requeue: bool = True) -> bool:
        """Ack (or reject) ``delivery`` from any thread; ``False`` if its connection is gone.

        When the connection that delivered a message is gone, the broker has
        already put the message back for redelivery: acking it on a new
        connection would ack a different message, so it is dropped here.

        The settlements queue up, and the I/O thread is woken once for all
        those that wait (each wake is a write to a pipe and a turn of its loop).
        """
        connection = self._connection
        if connection is None or delivery.generation != self.generation:
            return False
        with self._settle_lock:
            self._to_settle.append((delivery, ack, requeue))
            if self._settle_woken:
                return True
            self._settle_woken = True
        try:
            connection.add_callback_threadsafe(self.settle_pending)
        except (*CONNECTION_ERRORS, px.AMQPChannelError):
            with self._settle_lock:
                self._settle_woken = False
            return False
        return True

    def settle_pending(self) -> None:
        """On the I/O thread: send every settlement asked for so far.

        The worker calls it itself before it closes: pika leaves the callbacks
        of ``add_callback_threadsafe`` undispatched by the first
        ``process_data_events`` after a ``basic.cancel``, and an ack lost at
        the close is a job run twice.
        """
        with self._settle_lock:
            pending = list(self._to_settle)
            self._to_settle.clear()
            self._settle_woken = False
        for delivery, ack, requeue in pending:
            self._settle(delivery, ack, requeue)

    def _settle(self, delivery: Delivery, ack: bool, requeue: bool) -> None:
        channel = self._channel
        if channel is None or not channel.is_open or delivery.generation != self.generation:
            logger.warning(
                "Could not settle delivery %s: its connection is gone; RabbitMQ redelivers it.",
                delivery.tag,
            )
            return
        if self._slots is not None:
            self._slots.settled(delivery.tag)
        if ack:
            channel.basic_ack(delivery.tag)
        else:
            channel.basic_nack(delivery.tag, requeue=requeue)

    def _drop(self, *, lost: bool = False) -> str:
        """Forget the connection; ``lost``: the next connection tries another node first.

        Returns `` at NODE`` for messages (empty when not connected).
        """
        connection, node = self._connection, self.node
        self._connection = self._channel = self._forward_channel = self.node = None
        self._tags, self._slots, self._taking = [], None, False
        self._doorbells = {}
        if connection is not None:
            close_quietly(connection)
        if node is None:
            return ""
        if lost:
            node.lost()
        return f" at {node.address}"

    def close(self) -> None:
        self._drop()


#: How long a close may wait for the broker's answer before the socket is dropped.
def peek(
    urls: Urls, queue: str, *, timeout: float | None = None
) -> list[tuple[bytes, dict[str, Any]]]:
    """Every message of ``queue`` (body, headers), handed back at once: a read that changes
    nothing.

    ``TopologyNotDeclared`` if the queue does not exist.
    """
    with admin_channel(urls, timeout=timeout) as admin:
        if not admin.queue_exists(queue):
            raise TopologyNotDeclared(f"Queue {queue!r} does not exist. {NOT_DECLARED_HINT}")
        with admin.take_all(queue) as (_channel, taken):
            return [(message.body, message.headers) for message in taken]


def _existing(connection: pika.BlockingConnection, queues: Sequence[str]) -> list[str]:
    """Those of ``queues`` that exist (a passive declare each, on a channel of their own)."""
    found: list[str] = []
    if not queues:
        return found
    channel = connection.channel()
    with quiet_probes():
        for queue in queues:
            try:
                channel.queue_declare(queue, passive=True)
                found.append(queue)
            except px.ChannelClosedByBroker:  # 404: gone, nothing to drain
                channel = connection.channel()
    channel.close()
    return found
