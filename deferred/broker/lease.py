"""Leadership among the workers: a token in a single-active-consumer queue."""

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
    PERSISTENT,
    Node,
    Urls,
    as_urls,
    close_quietly,
    open_connection,
    setting_up,
)
from deferred.broker.errors import BrokerUnavailable

logger = logging.getLogger("deferred.broker")


class Lease:
    """Leadership among the workers: a token in a single-active-consumer queue.

    Every worker consumes the queue; RabbitMQ delivers to one consumer only,
    the active one, and that one keeps the token unacked for as long as its
    connection lives. When that connection goes (a worker killed, stopped, or
    cut off and its heartbeat missed), the broker hands the token to the next
    consumer: leadership moves without any clock or table. Extra tokens are
    harmless (only the active consumer ever gets one), so each worker puts one
    in when it finds none ready.

    The same connection carries the leader's reads and writes of the record
    queue, so a leader that lost its lease can no longer write.
    """

    def __init__(
        self,
        urls: Urls,
        queue: str,
        record_queue: str,
        *,
        heartbeat_s: int,
        role: str = "scheduler",
    ) -> None:
        self.urls = as_urls(urls)
        #: Who holds the lease, for messages (``scheduler``, ``keeper``).
        self.role = role
        self.queue = queue
        self.record_queue = record_queue
        self.heartbeat_s = heartbeat_s
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._confirm: BlockingChannel | None = None
        self._held = False
        self.node: Node | None = None

    @property
    def held(self) -> bool:
        return self._held

    def connect(self) -> None:
        """Join the queue's consumers; ``BrokerUnavailable`` / ``TopologyNotDeclared``."""
        self.close()
        connection, node = open_connection(self.urls, heartbeat=self.heartbeat_s)
        with setting_up(connection, node, f"join the {self.role}s"):
            channel = connection.channel()
            if declared_queue(channel, self.queue, node).method.message_count == 0:
                channel.basic_publish(
                    "", self.queue, b"lease", pika.BasicProperties(delivery_mode=PERSISTENT)
                )
            channel.basic_qos(prefetch_count=1)
            channel.basic_consume(self.queue, self._on_token)
            confirm = connection.channel()
            confirm.confirm_delivery()
        self._connection, self._channel, self._confirm = connection, channel, confirm
        self.node = node

    def _on_token(self, _ch: BlockingChannel, _method: Any, _props: Any, _body: bytes) -> None:
        self._held = True

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """A lost connection ends the lease: ``BrokerUnavailable``, and nothing held."""
        try:
            yield
        except (*CONNECTION_ERRORS, px.AMQPError) as exc:
            self._lost()
            raise BrokerUnavailable(f"Lost the {self.role}'s connection: {exc!r}") from exc

    def poll(self, seconds: float) -> bool:
        """Serve the connection for ``seconds``; whether this worker leads now."""
        if self._connection is None:
            raise BrokerUnavailable(f"The {self.role}'s connection is not open.")
        with self._guard():
            self._connection.process_data_events(time_limit=seconds)
        return self._held

    def read_records(
        self,
    ) -> tuple[list[tuple[bytes, dict[str, Any]]], Callable[[bool], None]]:
        """Every message of the record queue (body, headers), held unacked, and
        ``done(ack)``, which acks them (``True``) or hands them back, and ends the read.

        A crash before ``done`` hands them back too, so nothing is lost
        between reading the records and writing their successor.
        """
        assert self._connection is not None
        with self._guard():
            channel = self._connection.channel()
            bodies, last = [], 0
            while True:
                method, props, body = channel.basic_get(self.record_queue)
                if method is None:
                    break
                bodies.append((body, dict(props.headers or {})))
                last = method.delivery_tag

        def done(ack: bool) -> None:
            with self._guard():
                if ack and last:
                    channel.basic_ack(last, multiple=True)
                channel.close()

        return bodies, done

    def write_record(
        self,
        body: bytes,
        headers: dict[str, Any] | None = None,
        *,
        priority: int | None = None,
        message_id: str | None = None,
    ) -> None:
        """Publish a record to the record queue and wait for its confirm."""
        assert self._confirm is not None
        with self._guard():
            self._confirm.basic_publish(
                "",
                self.record_queue,
                body,
                pika.BasicProperties(
                    delivery_mode=PERSISTENT,
                    content_type="application/json",
                    headers=headers or None,
                    priority=priority,
                    message_id=message_id,
                ),
                mandatory=True,
            )

    def _lost(self) -> None:
        self._held = False
        if self.node is not None:
            self.node.lost()
        self.close()

    def close(self) -> None:
        """Leave: the token (if held) goes to the next worker at once."""
        self._held = False
        connection, self._connection = self._connection, None
        self._channel = self._confirm = None
        if connection is not None:
            close_quietly(connection)
