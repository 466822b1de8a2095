"""Moving messages between two brokers (``deferred_transfer``): the I/O only.

One connection to each broker, driven from one thread. On the old broker a
queue is drained on a channel of its own, a batch at a time, and a batch is
acked with a proof that the broker has taken the acks. On the new broker the
staging queue is consumed by this transfer alone, read as a whole when it
starts, filled with publisher confirms, and emptied into the topology by
rejecting its messages into a dead-letter exchange. Why this order of calls
moves each job exactly once is :mod:`deferred.operate.transfer`'s to say.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel

from deferred.broker.admin import Admin, QueueStats, quiet_probes
from deferred.broker.connection import (
    CONNECTION_ERRORS,
    NOT_FOUND,
    REFUSED_PAUSE_CAP_S,
    REFUSED_PAUSE_S,
    Node,
    Urls,
    as_urls,
    close_quietly,
    open_connection,
    setting_up,
    within_deadline,
)
from deferred.broker.errors import BrokerError, BrokerUnavailable, PublishRefused
from deferred.broker.publisher import Outgoing, _ConfirmedBatches
from deferred.core.topology import Binding, Plan, Queue

logger = logging.getLogger("deferred.broker")

#: The heartbeat of a transfer's connections: a transfer that dies without a word
#: (a lost host) is noticed by the brokers within two of them, and releases what
#: it held, the staging queue's exclusive consumer included.
HEARTBEAT_S = 15
#: The header that names a staged message (see ``deferred.operate.transfer.transfer_key``).
KEY_HEADER = "x-deferred-transfer"
#: How long one batch may take to be confirmed by the new broker.
CONFIRM_TIMEOUT_S = 60.0
#: How long staged messages may take to come back to the staging consumer.
DELIVERY_TIMEOUT_S = 60.0
ACCESS_REFUSED = 403
RESOURCE_LOCKED = 405


class StagingBusy(BrokerError):
    """Another transfer (or the connection of an interrupted one) consumes the staging queue."""


@dataclass(frozen=True)
class Held:
    """A message taken from a queue of the old broker, not yet acked."""

    tag: int
    body: bytes
    headers: dict[str, Any]
    message_id: str | None
    #: The routing key it was published (and dead-lettered) with.
    routing_key: str


@dataclass(frozen=True)
class Staged:
    """A message of the staging queue, delivered to this transfer and not yet settled."""

    tag: int
    key: str
    body: bytes
    headers: dict[str, Any]
    message_id: str | None
    routing_key: str


class Side:
    """One broker of a transfer: its connection, and what is read and declared on it.

    ``role`` (``"old broker"``, ``"new broker"``) names it in every error.
    """

    def __init__(self, urls: Urls, role: str) -> None:
        self.urls = as_urls(urls)
        self.role = role
        self._quiet = quiet_probes()
        connection, node = open_connection(self.urls, heartbeat=HEARTBEAT_S)
        with setting_up(connection, node, f"open a channel on the {role}"):
            self.admin = Admin(connection, node)
        self.connection: pika.BlockingConnection = connection
        self.node: Node = node
        self._quiet.__enter__()

    @property
    def address(self) -> str:
        return self.node.address

    def close(self) -> None:
        self._quiet.__exit__(None, None, None)
        close_quietly(self.connection)

    @contextmanager
    def guard(self, doing: str) -> Iterator[None]:
        """pika's errors as the library's, naming this broker and what was being done."""
        try:
            yield
        except BrokerError:
            raise
        except px.ChannelClosedByBroker as exc:
            raise BrokerError(
                f"The {self.role} at {self.address} refused to {doing}: {exc.reply_text}"
            ) from exc
        except (*CONNECTION_ERRORS, px.AMQPError) as exc:
            self.node.lost()
            raise BrokerUnavailable(
                f"Lost the connection to the {self.role} at {self.address} while trying to "
                f"{doing}: {exc!r}"
            ) from exc

    def stats(self, queues: Sequence[str]) -> dict[str, QueueStats | None]:
        """Ready messages and consumers of each queue (``None``: it does not exist)."""
        with self.guard("count the messages of its queues"):
            return {name: self.admin.queue_stats(name) for name in queues}

    def drain(self, queue: str, prefetch: int) -> Drain:
        with self.guard(f"consume queue {queue}"):
            return Drain(self, queue, prefetch)

    def staging(self, queue: Queue, exchange: str, out: str) -> Staging:
        return Staging(self, queue, exchange, out)


def same_broker(one: Side, other: Side) -> bool:
    """Whether two connections reach the same virtual host of the same broker.

    Whatever their URLs say (``localhost`` and ``127.0.0.1``, a DNS alias, a
    load balancer): a queue exclusive to the first connection is locked for
    the second if, and only if, they share it.
    """
    with one.guard("declare a probe queue"):
        mine = one.connection.channel()
        name = mine.queue_declare("", exclusive=True, auto_delete=True).method.queue
    try:
        with other.guard("look for the probe queue"):
            probe = other.connection.channel()
            try:
                probe.queue_declare(name, passive=True)
            except px.ChannelClosedByBroker as exc:
                if exc.reply_code == NOT_FOUND:
                    return False
                if exc.reply_code == RESOURCE_LOCKED:
                    return True
                raise
            probe.close()
            return True
    finally:
        with one.guard("delete the probe queue"):
            mine.queue_delete(name)
            mine.close()


class Drain:
    """One queue of the old broker, consumed ``prefetch`` messages ahead.

    Closing the channel hands back to the queue whatever was taken and not
    acked: an interrupted batch is still on the old broker.
    """

    def __init__(self, side: Side, queue: str, prefetch: int) -> None:
        self.side = side
        self.queue = queue
        self._buffer: deque[Held] = deque()
        self.channel = side.connection.channel()
        self.channel.basic_qos(prefetch_count=prefetch)
        self.channel.basic_consume(queue, self._on_message)

    def _on_message(self, _ch: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        self._buffer.append(
            Held(
                method.delivery_tag,
                body,
                dict(props.headers or {}),
                props.message_id,
                str(method.routing_key),
            )
        )

    def take(self, most: int, idle_s: float) -> list[Held]:
        """Up to ``most`` messages: as many as came before nothing more came for ``idle_s``."""
        with self.side.guard(f"consume queue {self.queue}"):
            quiet_since = time.monotonic()
            while len(self._buffer) < most:
                before = len(self._buffer)
                self.side.connection.process_data_events(time_limit=min(idle_s, 0.02))
                if len(self._buffer) > before:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since >= idle_s:
                    break
        return [self._buffer.popleft() for _ in range(min(most, len(self._buffer)))]

    def settle(self, taken: Sequence[Held]) -> int:
        """Ack ``taken`` and return once the queue itself has had the acks.

        An ack has no answer in AMQP. A passive declare of the same queue on
        the same channel does, and it reaches the queue by the path the acks
        took, after them; so once it returns, a connection lost now can no
        longer hand these messages back. Returns the queue's ready count.
        """
        if not taken:
            return 0
        with self.side.guard(f"ack messages of queue {self.queue}"):
            # Every earlier delivery of this channel was acked already.
            self.channel.basic_ack(taken[-1].tag, multiple=True)
            frame = self.channel.queue_declare(self.queue, passive=True)
        return int(frame.method.message_count)

    def close(self) -> None:
        """Stop consuming; what was taken and not acked goes back to the queue."""
        try:
            if self.channel.is_open:
                self.channel.close()
        except (*CONNECTION_ERRORS, px.AMQPError):
            pass  # the connection went: the broker requeued them itself


class Staging:
    """The new broker's staging queue, which one transfer at a time consumes.

    Messages come in through a fanout exchange that keeps their routing key,
    and leave by being rejected: the queue dead-letters them into ``out``,
    which routes them on by that key. Every message this transfer has not
    settled stays delivered to it, in :attr:`received`, by key.
    """

    def __init__(self, side: Side, queue: Queue, exchange: str, out: str) -> None:
        self.side = side
        self.queue = queue
        self.exchange = exchange
        self.out = out
        #: Staged messages delivered to this transfer and not settled, by key.
        self.received: dict[str, list[Staged]] = defaultdict(list)
        #: Messages of the queue that no transfer staged (no key): left alone.
        self.foreign = 0
        self._channel: BlockingChannel | None = None
        self._batches: _ConfirmedBatches | None = None

    def declare(self, plan: Plan, bindings: Sequence[Binding]) -> None:
        """Declare the staging queue, its exchanges and their bindings (idempotent)."""
        admin = self.side.admin
        with self.side.guard("declare the staging queue"):
            admin.declare_queue(self.queue)
            admin.channel.exchange_declare(self.exchange, "fanout", durable=True)
            admin.channel.exchange_declare(self.out, "topic", durable=True)
            admin.channel.queue_bind(self.queue.name, self.exchange, "")
            admin.bind(plan, bindings)

    def exists(self) -> QueueStats | None:
        with self.side.guard(f"inspect queue {self.queue.name}"):
            return self.side.admin.queue_stats(self.queue.name)

    def open(self) -> list[str]:
        """Consume the staging queue, alone, and read all it holds; the keys found.

        Exclusive: while another transfer's connection consumes it (one
        running, or one that died and that the broker has not noticed yet),
        this raises ``StagingBusy``, since what that one holds would be
        invisible here.
        """
        name = self.queue.name
        with self.side.guard(f"consume the staging queue {name}"):
            waiting = int(self.side.admin.queue_stats(name).messages)  # type: ignore[union-attr]
            channel = self.side.connection.channel()
            channel.basic_qos(prefetch_count=0)
            try:
                channel.basic_consume(name, self._on_message, exclusive=True)
            except px.ChannelClosedByBroker as exc:
                if exc.reply_code in (ACCESS_REFUSED, RESOURCE_LOCKED):
                    raise StagingBusy(
                        f"Another transfer consumes the staging queue {name} on the "
                        f"{self.side.role} at {self.side.address} ({exc.reply_text}): wait for "
                        "it to finish. If it was interrupted, the broker lets go of it once it "
                        f"notices its connection is gone (within {2 * HEARTBEAT_S} s); then "
                        "run this again."
                    ) from exc
                raise
            self._channel = channel
            deadline = time.monotonic() + DELIVERY_TIMEOUT_S + waiting / 1000
            while self._count() < waiting and time.monotonic() < deadline:
                self.side.connection.process_data_events(time_limit=0.05)
        if self._count() < waiting:
            raise BrokerUnavailable(
                f"The staging queue {name} holds {waiting} message(s) and only "
                f"{self._count()} were delivered within {DELIVERY_TIMEOUT_S:.0f} s."
            )
        return list(self.received)

    def _count(self) -> int:
        return sum(len(copies) for copies in self.received.values()) + self.foreign

    def _on_message(self, _ch: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        headers = dict(props.headers or {})
        key = headers.get(KEY_HEADER)
        if isinstance(key, bytes):
            key = key.decode("ascii", "replace")
        if not isinstance(key, str):
            # Not staged by a transfer: it stays unacked, and goes back when we close.
            self.foreign += 1
            logger.warning(
                "Leaving alone a message of the staging queue %s that no transfer staged.",
                self.queue.name,
            )
            return
        self.received[key].append(
            Staged(
                method.delivery_tag,
                key,
                body,
                headers,
                props.message_id,
                str(method.routing_key),
            )
        )

    def stage(self, messages: list[Outgoing]) -> None:
        """Publish ``messages`` to the staging exchange; return once all are confirmed.

        A message the broker refuses (a negative confirm: a quorum queue
        without a leader) is sent again after a pause, until the deadline.
        """
        if not messages:
            return
        todo = list(messages)
        pause = REFUSED_PAUSE_S
        deadline = time.monotonic() + CONFIRM_TIMEOUT_S
        with self.side.guard(f"publish to the staging queue {self.queue.name}"):
            while todo:
                if self._batches is None or not self._batches.channel.is_open:
                    self._batches = _ConfirmedBatches(self.side.connection.channel())
                with within_deadline(self.side.connection, deadline - time.monotonic()):
                    refused, returned = self._batches.publish(todo)
                if returned:
                    raise BrokerError(
                        f"The staging exchange {self.exchange} routed {len(returned)} "
                        f"message(s) nowhere: is queue {self.queue.name} still bound to it?"
                    )
                todo = refused
                if todo:
                    if time.monotonic() + pause > deadline:
                        raise PublishRefused(
                            f"The {self.side.role} kept refusing {len(todo)} message(s) for "
                            f"the staging queue {self.queue.name} (negative confirms)."
                        )
                    time.sleep(pause)
                    pause = min(pause * 2, REFUSED_PAUSE_CAP_S)

    def wait_for(self, keys: Collection[str]) -> None:
        """Return once a staged copy of every key of ``keys`` has been delivered to us."""
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        with self.side.guard(f"consume the staging queue {self.queue.name}"):
            missing = [k for k in keys if not self.received.get(k)]
            while missing:
                if time.monotonic() > deadline:
                    raise BrokerUnavailable(
                        f"{len(missing)} message(s) confirmed into the staging queue "
                        f"{self.queue.name} were not delivered within {DELIVERY_TIMEOUT_S:.0f} s."
                    )
                self.side.connection.process_data_events(time_limit=0.01)
                missing = [k for k in missing if not self.received.get(k)]

    def take(self, key: str) -> list[Staged]:
        """Every delivered, unsettled copy of ``key`` (none left in :attr:`received`)."""
        return self.received.pop(key, [])

    def move(self, staged: Sequence[Staged]) -> None:
        """Reject ``staged`` into the dead-letter exchange: into the topology, in the broker."""
        self._settle(staged, "reject", lambda raw, tag: raw.basic_reject(tag, requeue=False))

    def drop(self, staged: Sequence[Staged]) -> None:
        """Ack ``staged``: they leave the staging queue and go nowhere."""
        self._settle(staged, "ack", lambda raw, tag: raw.basic_ack(tag))

    def _settle(
        self, staged: Sequence[Staged], verb: str, settle: Callable[[Any, int], None]
    ) -> None:
        # Through the channel beneath pika's blocking one, which would flush
        # the socket after every message: written together, sent at once.
        channel = self._consuming()
        with self.side.guard(f"{verb} messages of the staging queue {self.queue.name}"):
            for message in staged:
                settle(channel._impl, message.tag)
            channel._flush_output()

    def sync(self) -> None:
        """Return once the broker has handled every reject and ack sent so far."""
        channel = self._consuming()
        with self.side.guard(f"settle messages of the staging queue {self.queue.name}"):
            channel.basic_qos(prefetch_count=0)

    def _consuming(self) -> BlockingChannel:
        if self._channel is None:
            raise BrokerUnavailable(f"Not consuming the staging queue {self.queue.name}.")
        return self._channel

    def remove(self) -> bool:
        """Delete the staging queue and its exchanges if it is empty; whether it was.

        Only for a classic queue: it dead-letters a rejected message before it
        handles the next command, and the delete goes after the rejects on
        their channel, so nothing is in flight when it goes. Never while this
        transfer holds a message of it (a delete does not count those).
        """
        name = self.queue.name
        if self.foreign or any(self.received.values()):
            return False
        channel = self._consuming()
        with self.side.guard(f"delete the staging queue {name}"):
            try:
                channel.queue_delete(name, if_empty=True)
            except px.ChannelClosedByBroker:
                return False
            finally:
                self._channel = None
            admin = self.side.admin
            admin.channel.exchange_delete(self.exchange)
            admin.channel.exchange_delete(self.out)
        return True
