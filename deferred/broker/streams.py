"""Reading a stream (the cancels) from an offset, then following its tail."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel

from deferred.broker.admin import declared_queue
from deferred.broker.connection import (
    CONNECTION_ERRORS,
    Node,
    Urls,
    as_urls,
    close_quietly,
    open_connection,
    setting_up,
    within_deadline,
)
from deferred.broker.errors import BrokerUnavailable, StreamGone

logger = logging.getLogger("deferred.broker")


class StreamFollower:
    """Reads a stream from an offset (the start by default), then follows its tail.

    One connection, driven from one thread. Every message is handed to
    ``on_message(offset, body, headers)`` in stream order, and acked (a stream keeps
    it anyway: the ack only gives the consumer credit for more).

    :meth:`sync` catches up with what the consuming channel has been told:
    when a stream commits, its node tells each following channel before the
    publisher's confirm leaves; the channel hands the new messages over
    (within its credit) as it handles the news, and answers our
    ``basic.qos`` only after that. So once the follower is under way, a
    message whose publisher was confirmed before :meth:`sync` is read when it
    returns, on a single node. Two gaps: a consumer that has just subscribed
    is told of the stream's contents a moment later (read back a message you
    write to prove a start), and on a cluster a follower reading from a
    replica learns a commit a moment after the leader confirmed it. A round
    that used up the credit may have left messages behind and is followed by
    another one.
    """

    def __init__(
        self,
        urls: Urls,
        queue: str,
        on_message: Callable[[int, bytes, dict[str, Any]], None],
        *,
        prefetch: int = 1000,
        keys: bool = False,
    ) -> None:
        self.urls = as_urls(urls)
        #: Whether each message's routing key, exchange and priority are handed over
        #: among its headers (``x-routing-key``, ``x-exchange``, ``x-priority``).
        self.keys = keys
        self.queue = queue
        self.on_message = on_message
        self.prefetch = prefetch
        self.node: Node | None = None
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._unacked = 0
        self._last_tag = 0
        self._received = 0
        self._cancelled_by_broker = False

    def connect(self, offset: int | None = None, *, timeout: float | None = None) -> None:
        """Start reading at ``offset`` (``None``: the first message kept).

        ``TopologyNotDeclared`` if the stream does not exist, ``BrokerUnavailable``
        if no node answers (within ``timeout``, if given).
        """
        self.close()
        connection, node = open_connection(self.urls, timeout=timeout)
        with setting_up(connection, node, f"read stream {self.queue}"):
            channel = connection.channel()
            declared_queue(channel, self.queue, node)
            channel.basic_qos(prefetch_count=self.prefetch)
            self._cancelled_by_broker = False
            channel.add_on_cancel_callback(self._on_broker_cancel)
            channel.basic_consume(
                self.queue,
                self._on_delivery,
                arguments={"x-stream-offset": "first" if offset is None else offset},
            )
        self._connection, self._channel, self.node = connection, channel, node
        self._unacked = self._last_tag = 0

    def _on_broker_cancel(self, _method: Any) -> None:
        # The stream was deleted (or its node went away): nothing more will
        # come on this consumer, and a catch-up would prove nothing.
        self._cancelled_by_broker = True

    @property
    def received(self) -> int:
        """How many messages were handed over since this follower was made."""
        return self._received

    def _on_delivery(self, _ch: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        self._received += 1
        self._unacked += 1
        self._last_tag = method.delivery_tag
        headers = dict(props.headers or {})
        if self.keys:
            headers["x-routing-key"] = method.routing_key
            headers["x-exchange"] = method.exchange
            headers["x-priority"] = props.priority
        self.on_message(int(headers.get("x-stream-offset", -1)), body, headers)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        if self._connection is None or self._channel is None:
            raise BrokerUnavailable(f"Not reading stream {self.queue}.")
        try:
            yield
        except (*CONNECTION_ERRORS, px.AMQPError) as exc:
            node = self.node
            self.close()
            if node is not None:
                node.lost()
            raise BrokerUnavailable(
                f"Lost the connection reading stream {self.queue}: {exc!r}"
            ) from exc
        if self._cancelled_by_broker:
            self.close()
            raise StreamGone(f"RabbitMQ cancelled the consumer of stream {self.queue}.")

    def _ack(self) -> None:
        assert self._channel is not None
        if self._unacked:
            self._channel.basic_ack(self._last_tag, multiple=True)
            self._unacked = 0

    def poll(self, seconds: float) -> None:
        """Hand over new messages and run queued callbacks for up to ``seconds``."""
        with self._guard():
            assert self._connection is not None
            self._connection.process_data_events(time_limit=seconds)
            self._ack()

    def sync(self, timeout: float | None = None) -> None:
        """Return once every message committed before the call has been handed over.

        ``timeout`` bounds the whole read (``BrokerUnavailable`` past it).
        """
        with self._guard():
            assert self._connection is not None and self._channel is not None
            if timeout is None:
                self._catch_up()
            else:
                with within_deadline(self._connection, timeout):
                    self._catch_up()

    def _catch_up(self) -> None:
        assert self._connection is not None and self._channel is not None
        while True:
            self._ack()
            before = self._received
            self._channel.basic_qos(prefetch_count=self.prefetch)
            self._connection.process_data_events(time_limit=0)
            if self._received - before < self.prefetch:
                self._ack()
                return

    def wake(self) -> None:
        """From any thread: make a :meth:`poll` in progress return now."""
        connection = self._connection
        if connection is None:
            return
        try:
            connection.add_callback_threadsafe(lambda: None)
        except (*CONNECTION_ERRORS, px.AMQPError):
            pass

    def close(self) -> None:
        """Close the connection, acking first what was delivered: closing a consumer
        makes pika reject the deliveries it still holds, and a stream refuses a reject."""
        connection, channel = self._connection, self._channel
        if connection is not None and channel is not None and connection.is_open:
            try:
                connection.process_data_events(time_limit=0)
                self._ack()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        self._connection = self._channel = None
        if connection is not None:
            close_quietly(connection)
