"""The broker I/O of the ledger's checkpoints (``deferred.core.ledger_index``).

Three reads, on one connection per :class:`StreamSession` (a look-up of one
job makes five, and a connection costs about 9 ms to open and close):

- :meth:`StreamSession.read_to_now`: a stream from an offset (a number,
  ``"first"``) up to a marker published right after the consumer attached,
  so the read ends where the stream ended when it began, at once, with no
  wait for a quiet moment;
- :meth:`StreamSession.read_at`: ``count`` messages from a known offset;
- :meth:`StreamSession.read_last`: the last chunk;
- :func:`write_checkpoint`: pages, each confirmed, then the head that says
  where they landed. A stream's offsets are not told to the publisher, so the
  writer follows the pages stream from ``"next"`` while it writes and reads its
  own pages back.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pika
import pika.exceptions as px

from deferred.broker.admin import declared_queue
from deferred.broker.connection import (
    CONNECTION_ERRORS,
    NOT_FOUND,
    PERSISTENT,
    Node,
    Urls,
    as_urls,
    close_quietly,
    open_connection,
    setting_up,
    within_deadline,
)
from deferred.broker.errors import NOT_DECLARED_HINT, BrokerUnavailable, TopologyNotDeclared
from deferred.broker.results import close_later

#: The headers a page carries: its checkpoint's token and its number.
TOKEN_HEADER = "x-deferred-checkpoint"
PAGE_HEADER = "x-deferred-page"
#: Extra time to end a call that blocks, past a read's own deadline.
BACKSTOP_S = 2.0


class StreamSession:
    """Reads of several streams on one connection, a channel each.

    A read's channel stays open until the session closes: closing a stream
    consumer makes pika reject what is still on its way, which a stream refuses.
    The connection is closed on the results reader's closer thread
    (``deferred.broker.results``), so nobody waits for the broker to tear the
    consumers down."""

    def __init__(self, urls: Urls, *, timeout: float) -> None:
        self.urls = as_urls(urls)
        self.timeout = timeout
        self._connection: pika.BlockingConnection | None = None
        self._node: Node | None = None

    def __enter__(self) -> StreamSession:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            close_later(connection)

    def _channel(self, queue: str) -> tuple[pika.BlockingConnection, Any]:
        # No passive declare first (a round trip each read): a consume of a stream
        # that does not exist fails with 404, which _reading says as much of.
        if self._connection is None or not self._connection.is_open:
            self._connection, self._node = _connection_for(self.urls, self.timeout)
        assert self._node is not None
        with setting_up(self._connection, self._node, f"read stream {queue}"):
            channel = self._connection.channel()
        return self._connection, channel

    @contextmanager
    def _reading(self, queue: str) -> Iterator[None]:
        try:
            yield
        except px.ChannelClosedByBroker as exc:
            if exc.reply_code != NOT_FOUND:
                raise BrokerUnavailable(f"Reading stream {queue} failed: {exc!r}") from exc
            raise TopologyNotDeclared(
                f"Queue {queue!r} does not exist ({exc.reply_text}). {NOT_DECLARED_HINT}"
            ) from exc
        except (*CONNECTION_ERRORS, px.AMQPError) as exc:
            if self._node is not None:
                self._node.lost()
            connection, self._connection = self._connection, None
            if connection is not None:
                close_quietly(connection)
            raise BrokerUnavailable(f"Lost the connection reading stream {queue}: {exc!r}") from exc

    def read_last(self, queue: str, *, wait_s: float) -> list[bytes]:
        """The messages of the last chunk of stream ``queue`` (one publish each, for a
        stream written one message at a time); none if nothing came within ``wait_s``
        (an empty stream sends nothing, and says so no other way)."""
        got: list[bytes] = []
        with self._reading(queue):
            connection, channel = self._channel(queue)
            done = False

            def deliver(_ch: Any, method: Any, _props: Any, body: bytes) -> None:
                if not done:
                    got.append(body)
                channel.basic_ack(method.delivery_tag)

            channel.basic_qos(prefetch_count=100)
            channel.basic_consume(queue, deliver, arguments={"x-stream-offset": "last"})
            deadline = time.monotonic() + wait_s
            with within_deadline(connection, self.timeout + BACKSTOP_S):
                while not got and time.monotonic() < deadline:
                    connection.process_data_events(time_limit=max(0.0, deadline - time.monotonic()))
                # The rest of the chunk comes with its first message.
                connection.process_data_events(time_limit=0)
            done = True
        return got

    def read_at(
        self, queue: str, offset: int, count: int, *, first_within: float = 1.0
    ) -> list[tuple[int, bytes, dict[str, Any]]]:
        """``count`` messages of stream ``queue`` from ``offset`` on (fewer if the stream
        ends first: what came within the session's timeout; none if nothing came within
        ``first_within``, as from past the stream's end, where a read waits)."""
        got: list[tuple[int, bytes, dict[str, Any]]] = []
        with self._reading(queue):
            connection, channel = self._channel(queue)

            def deliver(_ch: Any, method: Any, props: Any, body: bytes) -> None:
                if len(got) < count:
                    headers = dict(props.headers or {})
                    got.append((int(headers.get("x-stream-offset", -1)), body, headers))
                channel.basic_ack(method.delivery_tag)

            channel.basic_qos(prefetch_count=max(1, min(count, 100)))
            channel.basic_consume(queue, deliver, arguments={"x-stream-offset": offset})
            started = time.monotonic()
            deadline = started + self.timeout
            with within_deadline(connection, self.timeout + BACKSTOP_S):
                while len(got) < count and time.monotonic() < deadline:
                    if not got and time.monotonic() - started > first_within:
                        break  # past the stream's end: it waits there, and sends nothing
                    connection.process_data_events(
                        time_limit=min(0.2, max(0.0, deadline - time.monotonic()))
                    )
        return got

    def read_to_now(
        self,
        queue: str,
        offset: int | str,
        on_message: Callable[[int, bytes, dict[str, Any]], bool],
        *,
        marker: tuple[str, str, bytes],
        is_marker: Callable[[bytes], str | None],
        credit: int = 2000,
        first_within: float | None = None,
    ) -> bool:
        """Hand ``on_message(offset, body, headers)`` the messages of stream ``queue`` from
        ``offset`` to where the stream ended when the read began, until it returns True.

        ``marker`` is the ``(exchange, routing key, body)`` of this read's end marker,
        which must route into the stream; ``is_marker(body)`` gives a marker's token
        (the body's own format: the stream's other readers know it, and skip it).
        ``BrokerUnavailable`` past the session's timeout, ``TopologyNotDeclared`` if
        there is no stream.

        ``first_within``: for a read from an offset that should hold a message,
        how long to wait for it. A stream read from past its end waits there (as
        for a stream deleted and declared again, shorter than before): False if
        nothing came by then; True otherwise."""
        token = is_marker(marker[2])
        end = {"done": False, "tag": 0, "seen": False}
        deadline = time.monotonic() + self.timeout
        with self._reading(queue):
            connection, channel = self._channel(queue)

            def deliver(_ch: Any, method: Any, props: Any, body: bytes) -> None:
                end["tag"] = method.delivery_tag
                end["seen"] = True
                if end["done"]:
                    return
                headers = dict(props.headers or {})
                if token is not None and is_marker(body) == token:
                    end["done"] = True
                elif on_message(int(headers.get("x-stream-offset", -1)), body, headers):
                    end["done"] = True

            channel.basic_qos(prefetch_count=credit)
            channel.basic_consume(queue, deliver, arguments={"x-stream-offset": offset})
            with within_deadline(connection, self.timeout + BACKSTOP_S):
                # The consumer is attached: what is published now lands after
                # everything the read is for. On the same channel, unconfirmed:
                # the marker's own delivery is the proof the read waits for.
                channel.basic_publish(marker[0], marker[1], marker[2], pika.BasicProperties())
                started = time.monotonic()
                while not end["done"]:
                    if (
                        first_within is not None
                        and not end["seen"]
                        and time.monotonic() - started > first_within
                    ):
                        return False
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BrokerUnavailable(
                            f"Reading stream {queue} took more than {self.timeout:g} s."
                        )
                    connection.process_data_events(
                        time_limit=min(left, 0.5 if first_within is None else 0.05)
                    )
                    if end["tag"]:
                        channel.basic_ack(end["tag"], multiple=True)
                        end["tag"] = 0
        return True


#: Connections opened ahead for the next reads, per broker URLs: a look-up opens three
#: (its reads overlap), 3-4 ms each, which the spares take off its way. A spare
#: older than SPARE_MAX_AGE_S is closed instead (its heartbeats went unanswered).
SPARES = 3
SPARE_MAX_AGE_S = 20.0
_spares: dict[tuple[str, ...], list[tuple[pika.BlockingConnection, Node, float]]] = {}
_spares_lock = threading.Lock()
_filling: set[tuple[str, ...]] = set()


def _connection_for(urls: tuple[str, ...], timeout: float) -> tuple[pika.BlockingConnection, Node]:
    """A connection for one session's reads: a spare opened ahead if there is a fresh
    one, else a new one; and spares opened again behind it, on a thread."""
    taken = None
    with _spares_lock:
        spares = _spares.setdefault(urls, [])
        while spares and taken is None:
            connection, node, made = spares.pop()
            if time.monotonic() - made < SPARE_MAX_AGE_S and connection.is_open:
                taken = (connection, node)
            else:
                close_later(connection)
        fill = urls not in _filling
        if fill:
            _filling.add(urls)
    if fill:
        if not _spares_closing:
            _spares_closing.append(True)
            atexit.register(_close_spares)
        threading.Thread(
            target=_fill, args=(urls, timeout), name="deferred-ledger-spares", daemon=True
        ).start()
    return taken if taken is not None else open_connection(urls, timeout=timeout)


_spares_closing: list[bool] = []


def _close_spares() -> None:
    """At exit: the spares no read took, closed rather than left to the broker."""
    with _spares_lock:
        spares = [c for found in _spares.values() for c, _node, _made in found]
        _spares.clear()
    for connection in spares:
        close_quietly(connection)


def _fill(urls: tuple[str, ...], timeout: float) -> None:
    try:
        while True:
            with _spares_lock:
                if len(_spares.get(urls, [])) >= SPARES:
                    return
            try:
                connection, node = open_connection(urls, timeout=timeout)
            except BrokerUnavailable:
                return
            with _spares_lock:
                _spares.setdefault(urls, []).append((connection, node, time.monotonic()))
    finally:
        with _spares_lock:
            _filling.discard(urls)


def write_checkpoint(
    urls: Urls,
    pages_queue: str,
    heads_queue: str,
    token: str,
    pages: list[bytes],
    head_for: Callable[[list[int]], bytes],
    *,
    timeout: float,
) -> list[int]:
    """Publish ``pages`` into ``pages_queue``, learn their offsets, then publish
    ``head_for(offsets)`` into ``heads_queue``; return the offsets.

    ``BrokerUnavailable`` if the broker goes or it all takes more than ``timeout``:
    the checkpoint is then not written (its head is what makes it one).
    """
    deadline = time.monotonic() + timeout
    offsets: dict[int, int] = {}
    connection, node = open_connection(as_urls(urls), timeout=timeout)
    try:
        with setting_up(connection, node, f"write stream {pages_queue}"):
            reader = connection.channel()
            declared_queue(reader, pages_queue, node)
            declared_queue(reader, heads_queue, node)
        with within_deadline(connection, timeout + BACKSTOP_S):

            def deliver(_ch: Any, method: Any, props: Any, _body: bytes) -> None:
                headers = props.headers or {}
                if headers.get(TOKEN_HEADER) == token:
                    offsets[int(headers[PAGE_HEADER])] = int(headers.get("x-stream-offset", -1))
                reader.basic_ack(method.delivery_tag)

            reader.basic_qos(prefetch_count=50)
            reader.basic_consume(pages_queue, deliver, arguments={"x-stream-offset": "next"})
            writer = connection.channel()
            writer.confirm_delivery()
            for number, body in enumerate(pages):
                writer.basic_publish(
                    "",
                    pages_queue,
                    body,
                    pika.BasicProperties(
                        delivery_mode=PERSISTENT,
                        headers={TOKEN_HEADER: token, PAGE_HEADER: number},
                    ),
                    mandatory=True,
                )
                connection.process_data_events(time_limit=0)
            while len(offsets) < len(pages):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailable(
                        f"Reading back the checkpoint's pages took more than {timeout:g} s."
                    )
                connection.process_data_events(time_limit=min(left, 0.2))
            found = [offsets[n] for n in range(len(pages))]
            writer.basic_publish(
                "",
                heads_queue,
                head_for(found),
                pika.BasicProperties(delivery_mode=PERSISTENT),
                mandatory=True,
            )
            return found
    except (*CONNECTION_ERRORS, px.AMQPError) as exc:
        node.lost()
        raise BrokerUnavailable(f"Lost the connection writing a checkpoint: {exc!r}") from exc
    finally:
        close_quietly(connection)
