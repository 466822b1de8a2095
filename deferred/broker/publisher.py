"""Publishing with confirms and ``mandatory``: one connection per thread (and per
process: a connection inherited through ``fork`` is never reused)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Protocol

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel

from deferred.broker.connection import (
    CONNECTION_ERRORS,
    NOT_FOUND,
    PERSISTENT,
    PRECONDITION_FAILED,
    PUBLISH_TIMEOUT_S,
    REFUSED_PAUSE_CAP_S,
    REFUSED_PAUSE_S,
    DeadlineExceeded,
    Node,
    Urls,
    as_urls,
    close_quietly,
    open_connection,
    within_deadline,
)
from deferred.broker.errors import (
    NOT_DECLARED_HINT,
    BrokerError,
    BrokerUnavailable,
    MessageTooLarge,
    PublishRefused,
    TopologyNotDeclared,
)

logger = logging.getLogger("deferred.broker")

#: On a message sent again after its connection was lost before the broker's
#: confirm: the first copy may have been taken, so the worker treats this one as
#: a possible duplicate (it waits briefly, then runs it only if no run of the
#: job is recorded: deferred.worker.pipeline).
COPY_HEADER = "x-deferred-copy"
#: Its value on a copy the keeper publishes after a broker restart (deferred.worker.keeper);
#: a retried publish's copy carries 1.
RESTART_COPY = "restart"
#: A connection left unused this long is checked before a publish (a quick read,
#: no round trip): one the broker or the network dropped meanwhile is replaced
#: before anything is sent on it, rather than found dead with a message in flight.
IDLE_CHECK_S = 1.0


class Publisher:
    """Publishes with confirms and ``mandatory``; one connection per thread.

    Each call has one deadline, ``timeout`` seconds, that covers everything:
    connecting (every node of the list if need be), waiting while RabbitMQ
    blocks publishers, and the confirm. Past it the call raises
    ``BrokerUnavailable``, whose message says that the outcome is unknown: the
    broker may have taken the message and the confirm be what was lost.

    A web process may sit idle long enough for the broker to drop its
    connection: a connection unused for :data:`IDLE_CHECK_S` is checked first,
    and replaced if it is gone. A node may also die under a publish: a publish
    that loses its connection reconnects once (to the next node first) and
    tries again, inside the same deadline. A message that was on its way when
    the connection went may have been taken, its confirm lost: its second copy
    carries :data:`COPY_HEADER`, so that a worker runs it only if the first
    did not run (the same job id).
    """

    def __init__(self, urls: Urls, timeout: float = PUBLISH_TIMEOUT_S) -> None:
        self.urls = as_urls(urls)
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self, timeout: float) -> pika.BlockingConnection:
        local = self._local
        connection: pika.BlockingConnection | None = getattr(local, "connection", None)
        if connection is not None and local.pid == os.getpid() and connection.is_open:
            if time.monotonic() - local.used < IDLE_CHECK_S or _alive(connection):
                local.used = time.monotonic()
                return connection
        self._forget()
        connection, local.node = open_connection(self.urls, timeout=timeout)
        local.connection, local.pid, local.used = connection, os.getpid(), time.monotonic()
        return connection

    def _confirm_channel(self) -> BlockingChannel:
        local = self._local
        channel: BlockingChannel | None = getattr(local, "channel", None)
        if channel is None or not channel.is_open:
            channel = local.connection.channel()
            channel.confirm_delivery()
            local.channel = channel
        return channel

    def _forget(self, *, lost: bool = False) -> None:
        local = self._local
        connection = getattr(local, "connection", None)
        node: Node | None = getattr(local, "node", None)
        if lost and node is not None:
            node.lost()
        # A connection inherited through fork shares its socket with the parent:
        # drop it without closing, or the parent's connection would be closed.
        if connection is not None and local.pid == os.getpid():
            close_quietly(connection)
        local.connection = local.channel = local.batch_channel = local.node = None
        local.pid = None

    def close(self) -> None:
        """Close this thread's connection, if any."""
        self._forget()

    @property
    def node(self) -> Node | None:
        """The node this thread's connection goes to, if it has one."""
        return getattr(self._local, "node", None)

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        message_id: str,
        headers: dict[str, Any] | None = None,
        priority: int | None = None,
    ) -> None:
        """Publish one persistent message and wait for the broker's confirm.

        ``priority``: the AMQP priority (0-9, :func:`deferred.core.priorities.level`).
        """
        properties = _properties(message_id, headers, priority)
        #: Whether a try sent the message on a connection that went before its confirm.
        sent = False

        def send() -> None:
            nonlocal properties, sent
            channel = self._confirm_channel()
            if sent:
                properties = _properties(message_id, {**(headers or {}), COPY_HEADER: 1}, priority)
            sent = True
            try:
                channel.basic_publish(exchange, routing_key, body, properties, mandatory=True)
            except px.UnroutableError:
                raise TopologyNotDeclared(
                    f"The broker could not route the message to any queue (exchange "
                    f"{exchange or '(default)'!r}, routing key {routing_key!r}): the delay "
                    f"topology or the target queue is missing. {NOT_DECLARED_HINT}"
                ) from None
            except px.NackError:
                sent = False  # refused: not taken
                raise _Refused() from None

        self._send(send, exchange)

    def publish_many(self, messages: list[Outgoing]) -> None:
        """Publish persistent messages with confirms, all sent before any is awaited.

        Waiting for each confirm in turn caps one thread at about a thousand
        messages a second; here every message is written at once and the
        confirms are collected as they come, one round trip for the batch.

        Not an AMQP transaction: on a quorum queue without a leader a
        transaction's commit fails as a whole ("partial tx completion") and
        says nothing of which messages were taken, and RabbitMQ 3.10 was seen
        to answer commit-ok for messages that never reached their queue while
        a node rejoined its cluster. Confirms are per message: a nacked one,
        or one unconfirmed when the connection is lost, is sent again (to the
        next node if the connection went), the confirmed ones are not.
        ``mandatory`` still applies: RabbitMQ returns an unroutable message
        before it confirms it.
        """
        todo = list(messages)

        def send() -> None:
            local = self._local
            channel: BlockingChannel | None = getattr(local, "batch_channel", None)
            if channel is None or not channel.is_open:
                channel = local.connection.channel()
                local.batch_channel = _ConfirmedBatches(channel)
            batches: _ConfirmedBatches = local.batch_channel
            refused, returned = batches.publish(todo)
            if returned:
                raise TopologyNotDeclared(
                    f"{len(returned)} of {len(messages)} message(s) could not be routed "
                    f"(job ids {', '.join(returned[:5])}...): the delay topology or a target "
                    f"queue is missing. {NOT_DECLARED_HINT}"
                )
            todo[:] = refused
            if refused:
                raise _Refused()

        self._send(send, ", ".join(sorted({m.exchange for m in messages})))

    def _send(self, send: Callable[[], None], exchange: str) -> None:
        """Run ``send`` within the deadline.

        On a lost connection it runs once more, on the next node first. A
        negative confirm means the broker did not take the message: a quorum
        queue refuses while it elects a new leader after a node loss, for a
        few seconds. That is retried with a short, growing pause until the
        deadline, on the same connection.
        """
        deadline = time.monotonic() + self.timeout
        losses = 0
        pause = REFUSED_PAUSE_S
        while True:
            remaining = deadline - time.monotonic()
            # A node that dies without a word (no RST) never confirms: with
            # another node to go to, the first try waits for at most half the
            # deadline, then counts as a lost connection and the rest goes to
            # the next node.
            patience = remaining if losses or len(self.urls) == 1 else self.timeout / 2
            try:
                if remaining <= 0:
                    raise DeadlineExceeded("no time left to retry")
                connection = self._connection(remaining)
                with within_deadline(connection, min(patience, deadline - time.monotonic())):
                    send()
                return
            except _Refused as exc:
                if time.monotonic() + pause >= deadline:
                    raise PublishRefused(
                        f"RabbitMQ refused the message(s) for exchange {exchange!r} (negative "
                        f"confirm) until PUBLISH_TIMEOUT ({self.timeout:g} s) ran out: a queue "
                        "it routes to has no leader (a node is down?) or is full. A refused "
                        "message was not taken; of a batch, the others may have been."
                    ) from exc
                time.sleep(pause)
                pause = min(pause * 2, REFUSED_PAUSE_CAP_S)
            except px.ChannelClosedByBroker as exc:
                self._forget()
                if exc.reply_code == PRECONDITION_FAILED and "message size" in str(exc.reply_text):
                    raise MessageTooLarge(
                        f"RabbitMQ refused a message larger than its max_message_size "
                        f"({exc.reply_text}); nothing was taken. RabbitMQ 4.x allows 16 MiB "
                        "unless configured otherwise (3.x: 128 MiB): keep DEFERRED"
                        "['MAX_MESSAGE_BYTES'] at or under the broker's max_message_size, and "
                        "pass ids rather than data."
                    ) from exc
                if exc.reply_code == NOT_FOUND:
                    raise TopologyNotDeclared(
                        f"Exchange {exchange or '(default)'!r} does not exist (RabbitMQ: "
                        f"{exc.reply_text}). {NOT_DECLARED_HINT}"
                    ) from exc
                raise BrokerError(f"RabbitMQ closed the channel: {exc.reply_text}") from exc
            except BrokerUnavailable as exc:
                self._forget()
                if losses:
                    raise BrokerUnavailable(
                        f"The connection was lost while publishing (the broker may or may not "
                        f"have taken the message), and then: {exc}"
                    ) from exc
                raise
            except DeadlineExceeded as exc:
                node = self.node
                self._forget(lost=True)
                if losses == 0 and deadline - time.monotonic() > 0.1 and len(self.urls) > 1:
                    losses += 1
                    logger.warning(
                        "RabbitMQ%s did not answer within %.1f s while publishing; trying "
                        "again on the next node.",
                        f" at {node.address}" if node else "",
                        patience,
                    )
                    continue
                raise BrokerUnavailable(
                    f"RabbitMQ did not confirm the publish within PUBLISH_TIMEOUT "
                    f"({self.timeout:g} s): the broker may or may not have taken it (a blocked "
                    "connection, a lost node or a slow confirm)."
                ) from exc
            except CONNECTION_ERRORS as exc:
                node = self.node
                self._forget(lost=True)
                losses += 1
                where = f" at {node.address}" if node else ""
                if losses == 2:
                    raise BrokerUnavailable(
                        f"Lost the connection to RabbitMQ{where} while publishing, twice (the "
                        f"broker may or may not have taken the message): {exc!r}"
                    ) from exc
                logger.warning(
                    "Connection to RabbitMQ%s lost while publishing (%r); trying again%s.",
                    where,
                    exc,
                    " on the next node" if len(self.urls) > 1 else "",
                )


class _Refused(Exception):
    """A negative confirm: the broker did not take the message(s) (retried until the deadline)."""


class _ConfirmedBatches:
    """A channel in confirm mode whose confirms are collected per message.

    pika's ``BlockingChannel`` waits for each confirm before the next
    publish; this drives the channel underneath it, numbering the messages
    as the broker does (from 1, per channel) to match acks and nacks.
    """

    def __init__(self, channel: BlockingChannel) -> None:
        self.channel = channel
        self.is_open = True
        self._seq = 0
        self._pending: dict[int, Outgoing] = {}
        self._refused: list[Outgoing] = []
        self._returned: list[str] = []
        selected: list[object] = []
        raw = channel._impl
        raw.confirm_delivery(ack_nack_callback=self._on_confirm, callback=selected.append)
        channel._flush_output(lambda: bool(selected))
        raw.add_on_return_callback(
            lambda _ch, _method, props, _body: self._returned.append(props.message_id or "?")
        )

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tags = (
            [t for t in self._pending if t <= method.delivery_tag]
            if method.multiple
            else [method.delivery_tag]
        )
        nacked = isinstance(method, pika.spec.Basic.Nack)
        for tag in tags:
            message = self._pending.pop(tag, None)
            if nacked and message is not None:
                self._refused.append(message)

    def publish(self, messages: list[Outgoing]) -> tuple[list[Outgoing], list[str]]:
        """Send ``messages`` and wait for every confirm: (the refused ones, ids returned)."""
        self._refused, self._returned = [], []
        raw = self.channel._impl
        sent = 0
        try:
            for message in messages:
                sent += 1
                self._seq += 1
                self._pending[self._seq] = message
                raw.basic_publish(
                    message.exchange,
                    message.routing_key,
                    message.body,
                    _properties(message.message_id, message.headers, message.priority),
                    mandatory=True,
                )
            self.channel._flush_output(lambda: not self._pending)
        except BaseException:
            # What was not confirmed is sent again on another channel; what was on
            # its way may have been taken, so its second copy says so.
            self.is_open = False
            maybe_taken = [_as_copy(m) for m in self._pending.values()]
            messages[:] = [*self._refused, *maybe_taken, *messages[sent:]]
            self._pending.clear()
            raise
        return self._refused, self._returned


@dataclass(frozen=True)
class Outgoing:
    """One message of :meth:`Publisher.publish_many`."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str
    headers: dict[str, Any] | None = None
    #: The AMQP priority (0-9); ``None``: none (a record, not a job).
    priority: int | None = None


def _as_copy(message: Outgoing) -> Outgoing:
    """``message`` marked as a possible second copy (:data:`COPY_HEADER`)."""
    return replace(message, headers={**(message.headers or {}), COPY_HEADER: 1})


def _alive(connection: pika.BlockingConnection) -> bool:
    """Whether an idle connection is still up: what the broker sent meanwhile (a close,
    the end of the stream) is read without waiting."""
    try:
        connection.process_data_events(time_limit=0)
    except (*CONNECTION_ERRORS, px.AMQPError):
        return False
    return bool(connection.is_open)


def _properties(
    message_id: str, headers: dict[str, Any] | None, priority: int | None = None
) -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=PERSISTENT,
        message_id=message_id,
        headers=headers or None,
        priority=priority,
    )


def publisher(urls: Urls, timeout: float = PUBLISH_TIMEOUT_S) -> Publisher:
    """The process-wide publisher for ``urls`` (one connection per thread)."""
    return _publisher(as_urls(urls), timeout)


class PublishSettings(Protocol):
    """What :func:`publisher_for` reads of the settings (``deferred.conf``'s
    ``DeferredSettings``; the broker package does not import it)."""

    @property
    def broker_urls(self) -> tuple[str, ...]: ...

    @property
    def publish_timeout_s(self) -> float: ...


def publisher_for(settings: PublishSettings) -> Publisher:
    """The process-wide publisher of ``settings``: their nodes (``BROKER_URL``) and
    ``PUBLISH_TIMEOUT``. The one place the library's own publishes get theirs from."""
    return _publisher(as_urls(settings.broker_urls), settings.publish_timeout_s)


@lru_cache(maxsize=8)
def _publisher(urls: tuple[str, ...], timeout: float) -> Publisher:
    return Publisher(urls, timeout)


def send_record(
    urls: Urls,
    queue: str,
    body: bytes,
    timeout: float = PUBLISH_TIMEOUT_S,
    headers: dict[str, Any] | None = None,
) -> None:
    """Publish one record (a schedule command) to ``queue`` with a confirm."""
    publisher(urls, timeout).publish("", queue, body, message_id=uuid.uuid4().hex, headers=headers)
