"""The keeper's broker I/O: its lease, the "up" marker, reading and writing the ledger."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pika

from deferred.broker.admin import declared_queue
from deferred.broker.connection import Urls
from deferred.broker.errors import BrokerUnavailable, TopologyNotDeclared
from deferred.broker.lease import Lease
from deferred.broker.streams import StreamFollower

#: What a stream delivery's routing key and exchange are handed over as, among its
#: headers, by :func:`read_stream` (a stream message keeps both).
ROUTING_KEY = "x-routing-key"
EXCHANGE = "x-exchange"
PRIORITY = "x-priority"
#: Transient: gone when the broker restarts, which is what it is for.
TRANSIENT = 1


class KeeperLink(Lease):
    """The keeper's connection: its lease in ``queue``, and writes to the ledger."""

    def __init__(
        self, urls: Urls, queue: str, ledger: str, up_queue: str, *, heartbeat_s: int
    ) -> None:
        super().__init__(urls, queue, ledger, heartbeat_s=heartbeat_s, role="keeper")
        self.up_queue = up_queue

    def up_missing(self) -> bool:
        """Whether the "up" message is missing: the broker restarted since it was put
        there (or never had one). The message is transient in a classic queue:
        RabbitMQ drops it on a restart, and keeps it otherwise."""
        assert self._connection is not None and self.node is not None
        with self._guard():
            channel = self._connection.channel()
            try:
                frame = declared_queue(channel, self.up_queue, self.node)
                return bool(frame.method.message_count == 0)
            finally:
                if channel.is_open:
                    channel.close()

    def backlog(self, queues: list[str]) -> int:
        """How many messages wait, ready and not yet taken, in ``queues`` (a queue that
        does not exist counts none)."""
        assert self._connection is not None and self.node is not None
        total = 0
        with self._guard():
            for name in queues:
                channel = self._connection.channel()
                try:
                    total += declared_queue(channel, name, self.node).method.message_count
                except TopologyNotDeclared:
                    pass
                finally:
                    if channel.is_open:
                        channel.close()
        return total

    def mark_up(self) -> None:
        """Put the "up" message (one is enough; a second one is harmless)."""
        assert self._confirm is not None
        with self._guard():
            self._confirm.basic_publish(
                "",
                self.up_queue,
                b"up",
                pika.BasicProperties(delivery_mode=TRANSIENT),
                mandatory=True,
            )


def read_stream(
    urls: Urls,
    queue: str,
    on_message: Callable[[int, bytes, dict[str, Any]], bool],
    *,
    timeout: float,
) -> None:
    """Hand the messages ``queue`` (a stream) keeps to ``on_message(offset, body, headers)``,
    oldest first, with each one's routing key, exchange and priority among its headers
    (:data:`ROUTING_KEY`, :data:`EXCHANGE`, :data:`PRIORITY`), until it returns True.

    A consumer that has just subscribed learns of the stream's contents a
    moment later, so the end is known by a message the caller wrote first and
    recognises. ``BrokerUnavailable`` if the read takes more than ``timeout``
    seconds or the connection goes; ``TopologyNotDeclared`` if there is no stream.
    """
    done = False

    def take(offset: int, body: bytes, headers: dict[str, Any]) -> None:
        nonlocal done
        if not done and on_message(offset, body, headers):
            done = True

    reader = StreamFollower(urls, queue, take, prefetch=2000, keys=True)
    deadline = time.monotonic() + timeout
    try:
        reader.connect(timeout=timeout)
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrokerUnavailable(
                    f"Reading stream {queue} took more than {timeout:g} s; "
                    f"{reader.received} messages read."
                )
            reader.poll(min(0.2, left))
    finally:
        reader.close()
