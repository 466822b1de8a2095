"""Consuming: the worker's connection lives on one I/O thread, and other threads
hand acks back to it with ``add_callback_threadsafe``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel

from deferred.broker.admin import admin_channel, declared_queue
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


class Consumer:
    """The worker's single consuming connection, driven from one I/O thread."""

    def __init__(
        self, urls: Urls, queues: list[str], prefetch: int, *, shared_prefetch: bool
    ) -> None:
        self.urls = as_urls(urls)
        self.queues = queues
        self.prefetch = prefetch
        #: Cap the unacked messages of all consumers together (classic queues
        #: only: quorum queues refuse a channel-wide prefetch).
        self.shared_prefetch = shared_prefetch
        self.generation = 0
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        #: The node consumed from; ``None`` while not connected.
        self.node: Node | None = None
        self._tags: list[str] = []
        self._cancelled_by_broker: str | None = None

    def start(self, on_delivery: Callable[[Delivery], None]) -> None:
        """Connect and start consuming; ``BrokerUnavailable`` or ``TopologyNotDeclared``."""
        self.close()
        connection, node = open_connection(self.urls)
        with setting_up(connection, node, "start consuming"):
            channel = connection.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            if self.shared_prefetch:
                channel.basic_qos(prefetch_count=self.prefetch, global_qos=True)
            for queue in self.queues:
                declared_queue(channel, queue, node)
            self.generation += 1
            generation = self.generation
            self._cancelled_by_broker = None
            channel.add_on_cancel_callback(self._on_broker_cancel)
            for queue in self.queues:

                def callback(
                    ch: BlockingChannel, method: Any, props: Any, body: bytes, queue: str = queue
                ) -> None:
                    on_delivery(
                        Delivery(
                            body=body,
                            tag=method.delivery_tag,
                            queue=queue,
                            redelivered=bool(method.redelivered),
                            generation=generation,
                            headers=dict(props.headers or {}),
                            message_id=props.message_id,
                        )
                    )

                self._tags.append(channel.basic_consume(queue, callback))
        self._connection, self._channel, self.node = connection, channel, node

    def _on_broker_cancel(self, method: Any) -> None:
        # The broker cancels a consumer when its queue is deleted (or its node
        # goes away); pika just stops delivering. Treat it as a lost connection
        # so the worker reconnects and finds out whether the queue is back.
        self._cancelled_by_broker = str(getattr(method.method, "consumer_tag", "?"))

    def poll(self, seconds: float) -> None:
        """Deliver messages and run queued callbacks for up to ``seconds``."""
        if self._connection is None or self._channel is None:
            raise BrokerUnavailable("Not connected.")
        try:
            self._connection.process_data_events(time_limit=seconds)
        except (*CONNECTION_ERRORS, px.AMQPChannelError) as exc:
            where = self._drop(lost=True)
            raise BrokerUnavailable(f"Lost the connection to RabbitMQ{where}: {exc!r}") from exc
        if self._channel is None or self._channel.is_closed:
            # e.g. RabbitMQ's consumer_timeout closes the channel, not the connection.
            self._drop(lost=False)
            raise BrokerUnavailable("RabbitMQ closed the consuming channel.")
        if self._cancelled_by_broker:
            # A quorum queue's leader moving away cancels consumers too: try
            # another node first.
            self._drop(lost=True)
            raise BrokerUnavailable(
                f"RabbitMQ cancelled consumer {self._cancelled_by_broker} (was a ready queue "
                "deleted?)."
            )

    def cancel(self) -> None:
        """Stop receiving new messages; unacked ones stay with us until acked."""
        channel, self._tags = self._channel, []
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
        connection = self._connection
        return (
            connection is not None and connection.is_open and delivery.generation == self.generation
        )

    def settle_threadsafe(self, delivery: Delivery, *, ack: bool, requeue: bool = True) -> bool:
        """Ack (or reject) ``delivery`` from any thread; ``False`` if its connection is gone.

        When the connection that delivered a message is gone, the broker has
        already put the message back for redelivery: acking it on a new
        connection would ack a different message, so it is dropped here.
        """
        connection = self._connection
        if connection is None or delivery.generation != self.generation:
            return False
        try:
            connection.add_callback_threadsafe(partial(self._settle, delivery, ack, requeue))
        except (*CONNECTION_ERRORS, px.AMQPChannelError):
            return False
        return True

    def _settle(self, delivery: Delivery, ack: bool, requeue: bool) -> None:
        channel = self._channel
        if channel is None or not channel.is_open or delivery.generation != self.generation:
            logger.warning(
                "Could not settle delivery %s: its connection is gone; RabbitMQ redelivers it.",
                delivery.tag,
            )
            return
        if ack:
            channel.basic_ack(delivery.tag)
        else:
            channel.basic_nack(delivery.tag, requeue=requeue)

    def _drop(self, *, lost: bool = False) -> str:
        """Forget the connection; ``lost``: the next connection tries another node first.

        Returns `` at NODE`` for messages (empty when not connected).
        """
        connection, node = self._connection, self.node
        self._connection = self._channel = self.node = None
        self._tags = []
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
