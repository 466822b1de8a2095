"""All broker I/O. The only module that imports pika.

pika's ``BlockingConnection`` is not thread-safe, so:

* publishers keep one connection per thread (and per process: a connection
  inherited through ``fork`` is never reused);
* the worker's consuming connection lives on one I/O thread, and other threads
  hand acks back to it with ``add_callback_threadsafe``.

pika's exceptions are translated into the library's own, with messages that
say what to do, so nothing outside this module needs to know pika.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, NoReturn

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel
from pika.adapters.utils import connection_workflow

from deferred.topology import Plan, Queue

logger = logging.getLogger("deferred.broker")

PERSISTENT = pika.DeliveryMode.Persistent
NOT_FOUND = 404
PRECONDITION_FAILED = 406


class BrokerError(Exception):
    """Something went wrong talking to RabbitMQ.

    Raised by ``defer()`` and ``defer_many()``, it carries the job ids of the
    call (``job_id``, ``job_ids``). After a timeout or a lost connection the
    outcome is unknown, since the broker may have taken a job whose confirm was
    lost: the id is how to find it (it runs at most once more than expected,
    never silently lost).
    """

    #: The id of the job ``defer()`` was publishing (the first one for ``defer_many()``).
    job_id: str | None = None
    #: Every job id of the call, in order.
    job_ids: tuple[str, ...] = ()


class BrokerUnavailable(BrokerError):
    """RabbitMQ could not be reached, or the connection was lost."""


class TopologyNotDeclared(BrokerError):
    """A message had nowhere to go: the exchanges or queues do not exist."""


class TopologyConflict(BrokerError):
    """A queue or exchange exists with other arguments than the plan's."""


class StreamGone(BrokerUnavailable):
    """The broker cancelled a stream's consumer: the stream was deleted (or moved)."""


class PublishRefused(BrokerUnavailable):
    """The broker kept refusing a message (negative confirms) until the deadline.

    A quorum queue refuses while it has no leader, e.g. for the seconds after
    a node is lost; nothing of a refused publish was taken.
    """


# pika hands a failed handshake's own error up as it is (a stack timeout: a
# node that accepts the TCP connection and then never answers), not as an
# AMQPConnectionError.
_CONNECTION_ERRORS = (
    px.AMQPConnectionError,
    px.ChannelWrongStateError,
    ConnectionError,
    OSError,
    connection_workflow.AMQPConnectorException,
    connection_workflow.AMQPConnectionWorkflowFailed,
)

_NOT_DECLARED_HINT = (
    "Run `python manage.py declare_delay_topology` (once per deploy) to create it; with "
    "DEFERRED['DECLARE'] = False, create it with the definitions or Terraform that "
    "`declare_delay_topology --format definitions|terraform` prints."
)


#: How long a long-lived connection (worker, commands) may stay blocked by
#: RabbitMQ (memory or disk alarm) before it fails, unless the URL sets
#: ``blocked_connection_timeout``. A publish has its own, shorter deadline.
BLOCKED_TIMEOUT_S = 30.0

#: A refused publish (negative confirm) is tried again after this pause, doubling up to the cap.
REFUSED_PAUSE_S = 0.05
REFUSED_PAUSE_CAP_S = 0.5

#: The default deadline of one publish (``DEFERRED['PUBLISH_TIMEOUT']``).
PUBLISH_TIMEOUT_S = 10.0

#: One URL, or the URLs of a cluster's nodes in the order they are tried.
Urls = str | Sequence[str]


def as_urls(urls: Urls) -> tuple[str, ...]:
    """``urls`` as a tuple (a single URL is a cluster of one)."""
    return (urls,) if isinstance(urls, str) else tuple(urls)


class _Failover:
    """Which node of a URL list each new connection tries first.

    In order, starting from the first URL; the node last connected to stays
    first while it works, and when a connection to it is lost the next
    connection starts from the node after it. So every client of a process
    moves off a dead node together, and nobody waits on the dead node first
    while another one answers.
    """

    def __init__(self) -> None:
        self._first: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def order(self, urls: tuple[str, ...]) -> list[int]:
        with self._lock:
            first = self._first.get(urls, 0)
        return [(first + i) % len(urls) for i in range(len(urls))]

    def connected(self, urls: tuple[str, ...], index: int) -> None:
        with self._lock:
            self._first[urls] = index

    def lost(self, urls: tuple[str, ...], index: int) -> None:
        with self._lock:
            if self._first.get(urls, 0) == index:
                self._first[urls] = (index + 1) % len(urls)


failover = _Failover()


@dataclass(frozen=True)
class Node:
    """The node a connection went to: its place in the URL list, and the URL."""

    urls: tuple[str, ...]
    index: int

    @property
    def url(self) -> str:
        return self.urls[self.index]

    @property
    def address(self) -> str:
        """``host:port/vhost``, without credentials: for messages, logs and status."""
        return safe_url(self.url)

    def lost(self) -> None:
        """Note that the connection to this node was lost: try the next node first."""
        failover.lost(self.urls, self.index)


def parameters(url: str) -> pika.URLParameters:
    """pika's parameters for ``url``, with its TLS options read as pika reads them.

    An ``amqps://`` URL verifies the broker's certificate against the system's
    CAs and checks its host name (pika's default). Its ``ssl_options`` query
    argument is pika's (a dict literal: ``cafile``, ``certfile``, ``keyfile``,
    ``password``, ``ciphers``, ``server_hostname``), read here rather than by
    pika so that naming a CA file or a client certificate keeps verification
    and host-name checks on, and leaves the system's CAs out only when a CA
    file is given. The ``TLS_*`` settings arrive this way (see conf.py).
    """
    rest, ssl_value = _split_ssl_options(url)
    params = pika.URLParameters(rest)
    if ssl_value is not None:
        # As pika does: ssl_options turns TLS on, whatever the scheme says.
        params.ssl_options = _ssl_options(ssl_value)
    return params


def tls_context(url: str) -> ssl.SSLContext | None:
    """The SSL context of an ``amqps://`` URL with ``ssl_options`` (``None`` otherwise).

    The management API is asked with it too: the same CA, the same client certificate.
    """
    ssl_value = _split_ssl_options(url)[1]
    if ssl_value is None:
        return None
    context: ssl.SSLContext = _ssl_options(ssl_value).context
    return context


def _split_ssl_options(url: str) -> tuple[str, str | None]:
    """``url`` without its ``ssl_options`` query argument, and that argument."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    ssl_value = next((v for k, v in query if k == "ssl_options"), None)
    if ssl_value is None:
        return url, None
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "ssl_options"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), ssl_value


@lru_cache(maxsize=16)
def _ssl_options(value: str) -> pika.SSLOptions:
    """An ``ssl_options`` dict literal as ``pika.SSLOptions`` (cached: CA files are read once)."""
    try:
        opts = ast.literal_eval(value)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"ssl_options in the broker URL is not a dict literal: {exc}") from None
    if not isinstance(opts, dict):
        raise ValueError("ssl_options in the broker URL must be a dict literal")
    context = ssl.create_default_context(
        cafile=opts.get("cafile") or opts.get("ca_certs"),
        capath=opts.get("capath") or opts.get("ca_path"),
        cadata=opts.get("cadata") or opts.get("ca_data"),
    )
    if opts.get("certfile"):
        context.load_cert_chain(opts["certfile"], opts.get("keyfile"), opts.get("password"))
    if opts.get("ciphers"):
        context.set_ciphers(opts["ciphers"])
    return pika.SSLOptions(context, server_hostname=opts.get("server_hostname"))


def open_connection(
    urls: Urls, *, timeout: float | None = None, heartbeat: int | None = None
) -> tuple[pika.BlockingConnection, Node]:
    """Connect to the first node that answers, in failover order.

    ``timeout`` bounds the whole call (every node tried); without it each
    node gets pika's own connect timeouts. ``BrokerUnavailable`` names every
    node tried and why it failed.
    """
    all_urls = as_urls(urls)
    deadline = None if timeout is None else time.monotonic() + timeout
    failures = []
    order = failover.order(all_urls)
    for position, index in enumerate(order):
        url = all_urls[index]
        try:
            params = parameters(url)
        except (OSError, ValueError) as exc:  # a CA or certificate file that cannot be read
            failures.append(f"{safe_url(url)}: bad TLS options: {exc}")
            continue
        if "blocked_connection_timeout" not in url:
            # pika's default is to wait forever: a web request would hang.
            params.blocked_connection_timeout = BLOCKED_TIMEOUT_S
        if heartbeat is not None and "heartbeat" not in url:
            params.heartbeat = heartbeat
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failures.append(f"{safe_url(url)}: not tried, out of time")
                continue
            # A node that died without a word (no RST: a lost host, a dropped
            # route) holds a connect until its timeout: each node gets an equal
            # share of what is left, so one such node cannot eat the deadline
            # of the nodes after it. URL options that retry (connection_attempts,
            # retry_delay) would wait past the share: one attempt each here.
            share = remaining / (len(order) - position)
            params.socket_timeout = min(params.socket_timeout or share, share)
            params.stack_timeout = min(params.stack_timeout or share, share)
            params.connection_attempts = 1
            params.retry_delay = 0
        try:
            connection = pika.BlockingConnection(params)
        except (*_CONNECTION_ERRORS, px.AMQPError) as exc:
            failures.append(f"{safe_url(url)}: {exc!r}{_tls_hint(repr(exc))}")
            continue
        failover.connected(all_urls, index)
        return connection, Node(all_urls, index)
    where = "at " if len(all_urls) == 1 else f"at any of its {len(all_urls)} nodes: "
    raise BrokerUnavailable(f"Cannot connect to RabbitMQ {where}{'; '.join(failures)}")


def _tls_hint(error: str) -> str:
    """What to change when a TLS handshake failed, from pika's description of it."""
    if "CERTIFICATE_VERIFY_FAILED" in error:
        return (
            " (the broker's certificate does not verify: DEFERRED['TLS_CA_FILE'] names the CA "
            "that signed it, DEFERRED['TLS_SERVER_NAME'] the name it carries)"
        )
    if "CERTIFICATE_REQUIRED" in error or "PEER_DID_NOT_RETURN_A_CERTIFICATE" in error:
        return (
            " (the broker requires a client certificate: set DEFERRED['TLS_CERT_FILE'] and "
            "DEFERRED['TLS_KEY_FILE'])"
        )
    return ""


def answers(url: str, timeout: float = 1.0) -> bool:
    """Whether the node at ``url`` accepts a connection now (the failover order is untouched)."""
    try:
        params = parameters(url)
    except (OSError, ValueError):
        return False
    params.socket_timeout = params.stack_timeout = timeout
    params.connection_attempts = 1
    try:
        connection = pika.BlockingConnection(params)
    except (*_CONNECTION_ERRORS, px.AMQPError):
        return False
    _close_quietly(connection)
    return True


def connect(urls: Urls, *, timeout: float | None = None) -> pika.BlockingConnection:
    """Open a connection to the first node that answers (see :func:`open_connection`)."""
    return open_connection(urls, timeout=timeout)[0]


def safe_url(url: str) -> str:
    """The URL without its password (nor any query), for messages and logs."""
    params = pika.URLParameters(_split_ssl_options(url)[0])
    vhost = "" if params.virtual_host == "/" else params.virtual_host
    return f"{params.host}:{params.port}/{vhost}"


def vhost_of(urls: Urls) -> str:
    """The virtual host the URL(s) connect to, read exactly as pika reads it (no I/O)."""
    return str(pika.URLParameters(_split_ssl_options(as_urls(urls)[0])[0]).virtual_host)


class _DeadlineExceeded(px.AMQPConnectionError):  # type: ignore[misc]
    """The call's deadline passed: the connection was torn down under it."""


@contextmanager
def _deadline(connection: pika.BlockingConnection, seconds: float) -> Iterator[None]:
    """Tear ``connection`` down if the block is still running after ``seconds``.

    A blocking publish waits for its confirm with no limit, and a closing
    handshake waits for an answer that a blocked broker never sends. This
    timer lives in pika's own I/O loop, which runs while pika waits, and
    aborts the socket: the wait ends with ``_DeadlineExceeded``.
    """
    impl = connection._impl

    def expire() -> None:
        if not connection.is_closed:
            impl._terminate_stream(_DeadlineExceeded(f"no answer within {seconds:.1f} s"))

    timer = impl._adapter_call_later(max(seconds, 0.0), expire)
    try:
        yield
    finally:
        impl._adapter_remove_timeout(timer)


# --------------------------------------------------------------------------- publishing


class Publisher:
    """Publishes with confirms and ``mandatory``; one connection per thread.

    Each call has one deadline, ``timeout`` seconds, that covers everything:
    connecting (every node of the list if need be), waiting while RabbitMQ
    blocks publishers, and the confirm. Past it the call raises
    ``BrokerUnavailable``, whose message says that the outcome is unknown: the
    broker may have taken the message and the confirm be what was lost.

    A web process may sit idle long enough for the broker to drop its
    connection, and a node may die under a publish: a publish that loses its
    connection reconnects once (to the next node first) and tries again,
    inside the same deadline. That retry can duplicate a message whose
    confirm was lost with the connection, which is within the at-least-once
    guarantee: the copy carries the same job id.
    """

    def __init__(self, urls: Urls, timeout: float = PUBLISH_TIMEOUT_S) -> None:
        self.urls = as_urls(urls)
        self.timeout = timeout
        self._local = threading.local()

    def _connection(self, timeout: float) -> pika.BlockingConnection:
        local = self._local
        connection: pika.BlockingConnection | None = getattr(local, "connection", None)
        if connection is not None and local.pid == os.getpid() and connection.is_open:
            return connection
        self._forget()
        connection, local.node = open_connection(self.urls, timeout=timeout)
        local.connection, local.pid = connection, os.getpid()
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
            _close_quietly(connection)
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
    ) -> None:
        """Publish one persistent message and wait for the broker's confirm."""
        properties = _properties(message_id, headers)

        def send() -> None:
            channel = self._confirm_channel()
            try:
                channel.basic_publish(exchange, routing_key, body, properties, mandatory=True)
            except px.UnroutableError:
                raise TopologyNotDeclared(
                    f"The broker could not route the message to any queue (exchange "
                    f"{exchange or '(default)'!r}, routing key {routing_key!r}): the delay "
                    f"topology or the target queue is missing. {_NOT_DECLARED_HINT}"
                ) from None
            except px.NackError:
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
                    f"queue is missing. {_NOT_DECLARED_HINT}"
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
                    raise _DeadlineExceeded("no time left to retry")
                connection = self._connection(remaining)
                with _deadline(connection, min(patience, deadline - time.monotonic())):
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
                if exc.reply_code == NOT_FOUND:
                    raise TopologyNotDeclared(
                        f"Exchange {exchange or '(default)'!r} does not exist (RabbitMQ: "
                        f"{exc.reply_text}). {_NOT_DECLARED_HINT}"
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
            except _DeadlineExceeded as exc:
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
            except _CONNECTION_ERRORS as exc:
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
                    _properties(message.message_id, message.headers),
                    mandatory=True,
                )
            self.channel._flush_output(lambda: not self._pending)
        except BaseException:
            # What was not confirmed is sent again on another channel.
            self.is_open = False
            messages[:] = [*self._refused, *self._pending.values(), *messages[sent:]]
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


def _properties(message_id: str, headers: dict[str, Any] | None) -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=PERSISTENT,
        message_id=message_id,
        headers=headers or None,
    )


def publisher(urls: Urls, timeout: float = PUBLISH_TIMEOUT_S) -> Publisher:
    """The process-wide publisher for ``urls`` (one connection per thread)."""
    return _publisher(as_urls(urls), timeout)


@lru_cache(maxsize=8)
def _publisher(urls: tuple[str, ...], timeout: float) -> Publisher:
    return Publisher(urls, timeout)


# --------------------------------------------------------------------------- administration


@dataclass(frozen=True)
class Taken:
    """A message taken from a queue, not yet acked."""

    tag: int
    body: bytes
    headers: dict[str, Any]
    message_id: str | None


@dataclass(frozen=True)
class QueueStats:
    """A queue's figures as a passive ``queue_declare`` returns them."""

    #: Messages ready for delivery (not those delivered and still unacked).
    messages: int
    consumers: int


@dataclass
class DeclareReport:
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    bindings: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.created)


#: Queue arguments that only place replicas and the leader at creation.
PLACEMENT_ARGUMENTS = (
    "x-quorum-initial-group-size",
    "x-queue-leader-locator",
    "x-initial-cluster-size",
)
#: The cancels stream's retention: changed later with a policy, not a new declare.
RETENTION_ARGUMENTS = ("x-max-age", "x-stream-max-segment-size-bytes")
_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<name>[^']+)'.*but current is "
    r"(?:none|the value '(?P<value>[^']*)' of type '(?P<type>[^']+)')"
)


def _placement_conflict(exc: px.ChannelClosedByBroker) -> tuple[str, Any] | None:
    """``(argument, the queue's current value or None)`` when a 406 is about placement only."""
    if exc.reply_code != PRECONDITION_FAILED:
        return None
    match = _INEQUIVALENT.search(str(exc.reply_text))
    if match is None or match["name"] not in (*PLACEMENT_ARGUMENTS, *RETENTION_ARGUMENTS):
        return None
    value: Any = match["value"]
    if value is not None and match["type"] in ("signedint", "long", "short", "byte"):
        value = int(value)
    return match["name"], value


class _HideProbeMisses(logging.Filter):
    """pika warns about every channel the broker closes, including the 404 that
    answers "does this queue exist?"; those are expected here, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NOT_FOUND" not in record.getMessage()


@contextmanager
def admin_channel(urls: Urls, *, timeout: float | None = None) -> Iterator[Admin]:
    """A short-lived connection (to the first node that answers) for declaring,
    inspecting and removing topologies.

    ``timeout`` bounds the connect and everything done in the block (a web
    request that checks the topology must not hang on a silent node).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    connection, node = open_connection(urls, timeout=timeout)
    quiet = _HideProbeMisses()
    pika_channel_logger = logging.getLogger("pika.channel")
    pika_channel_logger.addFilter(quiet)
    try:
        if deadline is None:
            yield Admin(connection, node)
        else:
            with _deadline(connection, deadline - time.monotonic()):
                yield Admin(connection, node)
    except px.AMQPConnectionError as exc:
        node.lost()
        raise BrokerUnavailable(
            f"Lost the connection to RabbitMQ at {node.address}: {exc!r}"
        ) from exc
    except px.AMQPError as exc:
        raise BrokerError(f"RabbitMQ refused an operation: {exc!r}") from exc
    finally:
        pika_channel_logger.removeFilter(quiet)
        _close_quietly(connection)


class Admin:
    """Declaring, inspecting and deleting exchanges and queues.

    A passive declare of something missing makes RabbitMQ close the channel,
    so each probe that may fail gets a fresh channel.
    """

    def __init__(self, connection: pika.BlockingConnection, node: Node) -> None:
        self.connection = connection
        #: The node this connection went to: where every figure read here comes from.
        self.node = node
        self.channel = connection.channel()

    def _reopen(self) -> None:
        if not self.channel.is_open:
            self.channel = self.connection.channel()

    def queue_exists(self, name: str) -> bool:
        return self.message_count(name) is not None

    def message_count(self, name: str) -> int | None:
        """Messages ready in queue ``name``, or ``None`` if it does not exist."""
        stats = self.queue_stats(name)
        return None if stats is None else stats.messages

    def queue_stats(self, name: str) -> QueueStats | None:
        """What a passive declare tells about queue ``name``; ``None`` if it does not exist.

        This is all AMQP reports: messages being handled by a consumer
        (delivered, not yet acked) are in neither figure.
        """
        try:
            frame = self.channel.queue_declare(name, passive=True)
        except px.ChannelClosedByBroker as exc:
            self._reopen()
            if _home_node_down(exc):
                raise _unreachable_queue(name, exc, self.node) from exc
            if exc.reply_code == NOT_FOUND:
                return None
            raise BrokerError(f"Cannot inspect queue {name!r}: {exc.reply_text}") from exc
        return QueueStats(int(frame.method.message_count), int(frame.method.consumer_count))

    def exchange_exists(self, name: str) -> bool:
        try:
            self.channel.exchange_declare(name, passive=True)
        except px.ChannelClosedByBroker as exc:
            self._reopen()
            if exc.reply_code == NOT_FOUND:
                return False
            raise BrokerError(f"Cannot inspect exchange {name!r}: {exc.reply_text}") from exc
        return True

    def missing(self, plan: Plan) -> list[str]:
        """What of ``plan`` is not on the broker (``"exchange NAME"``, ``"queue NAME"``).

        Passive declares only: nothing is created. Bindings cannot be
        inspected over AMQP and are not checked.
        """
        absent = [
            f"exchange {e.name}" for e in plan.all_exchanges if not self.exchange_exists(e.name)
        ]
        absent += [f"queue {q.name}" for q in plan.all_queues if not self.queue_exists(q.name)]
        return absent

    def declare_queue(self, queue: Queue) -> str | None:
        """Declare ``queue``; a warning if it exists with other replica placement, else ``None``.

        Where a quorum queue's replicas and leader go is decided when it is
        created, and only there: a queue declared before those arguments were
        set, or with another QUORUM_GROUP_SIZE, works just as well. So the
        broker's answer is followed for those two arguments, not raised.
        """
        arguments = dict(queue.arguments)
        kept: list[str] = []
        for _ in range(len(PLACEMENT_ARGUMENTS) + len(RETENTION_ARGUMENTS) + 1):
            try:
                self.channel.queue_declare(queue.name, durable=True, arguments=arguments)
            except px.ChannelClosedByBroker as exc:
                self._reopen()
                current = _placement_conflict(exc)
                if current is None:
                    self._declare_failed(queue, exc)
                name, value = current
                kept.append(f"{name}={value!r}")
                if value is None:
                    arguments.pop(name, None)
                else:
                    arguments[name] = value
                continue
            if kept and any(k.split("=")[0] in RETENTION_ARGUMENTS for k in kept):
                return (
                    f"stream {queue.name} exists with other retention ({', '.join(kept)}); "
                    f"it is used as it is. The settings ask for {queue.arguments.get('x-max-age')} "
                    "(MAX_DELAY + CANCEL_MARGIN): apply it with a policy (`rabbitmqctl "
                    f"set_policy --apply-to queues deferred-cancels '^{re.escape(queue.name)}$' "
                    f'\'{{"max-age":"{queue.arguments.get("x-max-age")}"}}\'`), or cancels '
                    "may be forgotten before their jobs are due"
                )
            if kept:
                return (
                    f"queue {queue.name} exists with other replica placement ({', '.join(kept)}); "
                    "it is used as it is (recreate it to apply the settings' placement)"
                )
            return None
        raise TopologyConflict(f"Queue {queue.name!r} could not be declared: {kept}")

    def _declare_failed(self, queue: Queue, exc: px.ChannelClosedByBroker) -> NoReturn:
        if exc.reply_code == PRECONDITION_FAILED:
            raise TopologyConflict(
                f"Queue {queue.name!r} already exists with other arguments than "
                f"{queue.arguments!r} (RabbitMQ: {exc.reply_text}). Queue arguments cannot "
                "change in place. If it is a delay queue, something else declared it; if "
                "it is a ready or failed queue (e.g. after changing QUEUE_TYPE), stop the "
                "workers, let it drain, delete it (`rabbitmqctl delete_queue "
                f"{queue.name}`) and run declare_delay_topology again."
            ) from exc
        raise BrokerError(f"Cannot declare queue {queue.name!r}: {exc.reply_text}") from exc

    def declare_cancels(self, plan: Plan) -> None:
        """Declare ``plan``'s cancels stream and its binding from the ingest exchange."""
        self.declare_queue(plan.cancels_queue)
        for binding in plan.bindings:
            if binding.destination == plan.cancels_queue.name:
                self.channel.queue_bind(binding.destination, binding.source, binding.routing_key)

    def declare(self, plan: Plan) -> DeclareReport:
        """Create whatever of ``plan`` is missing; idempotent."""
        report = DeclareReport()
        # Shared queues first: a conflict there is the likeliest, and should
        # stop us before anything of the new topology exists.
        for queue in plan.all_queues:
            exists = self.queue_exists(queue.name)
            warning = self.declare_queue(queue)
            if warning:
                report.warnings.append(warning)
            (report.existing if exists else report.created).append(f"queue {queue.name}")
        for exchange in plan.all_exchanges:
            exists = self.exchange_exists(exchange.name)
            try:
                self.channel.exchange_declare(
                    exchange.name, exchange.type, durable=True, arguments=exchange.arguments
                )
            except px.ChannelClosedByBroker as exc:
                self._reopen()
                raise TopologyConflict(
                    f"Exchange {exchange.name!r} already exists with other properties than a "
                    f"durable {exchange.type} exchange with arguments {exchange.arguments!r} "
                    f"(RabbitMQ: {exc.reply_text}). Something "
                    "else declared it: delete it (management UI, or `rabbitmqadmin delete "
                    f"exchange name={exchange.name}`), or choose another PREFIX, and run "
                    "declare_delay_topology again."
                ) from exc
            (report.existing if exists else report.created).append(f"exchange {exchange.name}")
        for binding in plan.all_bindings:
            if binding.destination_type == "exchange":
                self.channel.exchange_bind(binding.destination, binding.source, binding.routing_key)
            else:
                self.channel.queue_bind(binding.destination, binding.source, binding.routing_key)
            report.bindings += 1
        self.record(plan)
        return report

    def record(self, plan: Plan) -> None:
        """Note ``plan`` in the registry queue (once), so it is listed while jobs drain from it.

        Writing a message declares nothing: with ``DECLARE`` off the registry
        queue comes from the infrastructure like the rest.
        """
        if plan.topology_id not in {r["topology"] for r in self.topology_records(plan)}:
            self.channel.basic_publish(
                "",
                plan.registry_queue.name,
                plan.record().encode(),
                pika.BasicProperties(delivery_mode=PERSISTENT, content_type="application/json"),
            )

    @contextmanager
    def take_all(self, queue: str) -> Iterator[tuple[BlockingChannel, list[Taken]]]:
        """Every message of ``queue``, taken unacked on a channel of their own.

        Ack the ones you consume with ``channel.basic_ack(taken.tag)``; closing
        the channel at the end of the block puts all others back. A crash in
        the block therefore loses nothing: unacked messages return to the queue.
        """
        channel = self.connection.channel()
        entries: list[Taken] = []
        try:
            while True:
                method, props, body = channel.basic_get(queue)
                if method is None:
                    break
                entries.append(
                    Taken(method.delivery_tag, body, dict(props.headers or {}), props.message_id)
                )
            yield channel, entries
        finally:
            if channel.is_open:
                channel.close()

    @contextmanager
    def _registry(self, plan: Plan) -> Iterator[tuple[BlockingChannel, list[tuple[int, Any]]]]:
        """Every registry message, taken unacked: ``(delivery tag, record or None)``.

        AMQP cannot list queues, so each declared topology leaves a small
        persistent message in a registry queue.
        """
        with self.take_all(plan.registry_queue.name) as (channel, taken):
            entries: list[tuple[int, Any]] = []
            for message in taken:
                try:
                    record = json.loads(message.body)
                    record["topology"]
                except (ValueError, KeyError, TypeError):
                    logger.warning("Ignoring an unreadable topology record: %r", message.body[:200])
                    record = None
                entries.append((message.tag, record))
            yield channel, entries

    def topology_records(self, plan: Plan) -> list[dict[str, Any]]:
        """The topologies declared under ``plan``'s prefix, as recorded in its registry."""
        if not self.queue_exists(plan.registry_queue.name):
            return []
        records: dict[str, dict[str, Any]] = {}
        with self._registry(plan) as (_channel, entries):
            for _tag, record in entries:
                if record is not None:
                    records.setdefault(record["topology"], record)
        return list(records.values())

    def forget_topology(self, plan: Plan, topology_id: str) -> None:
        """Remove ``topology_id``'s record(s) from the registry."""
        with self._registry(plan) as (channel, entries):
            for tag, record in entries:
                if record is not None and record["topology"] == topology_id:
                    channel.basic_ack(tag)

    def pending(self, plan: Plan) -> int | None:
        """Messages waiting in ``plan``'s delay queues; ``None`` if none of them exists."""
        counts = [self.message_count(q.name) for q in plan.delay_queues]
        present = [c for c in counts if c is not None]
        return sum(present) if present else None

    def remove(self, plan: Plan) -> None:
        """Delete an empty topology; ``BrokerError`` if a message is still waiting in it.

        The ingest exchange goes first, so nothing new can enter; each queue is
        then deleted only if empty (the broker checks atomically), highest
        level first, which is the direction messages flow.
        """
        waiting = self.pending(plan)
        if waiting:
            raise BrokerError(f"{waiting} job(s) still wait in topology {plan.topology_id}.")
        self.channel.exchange_delete(plan.ingest_exchange)
        for queue in plan.delay_queues:
            try:
                self.channel.queue_delete(queue.name, if_empty=True)
            except px.ChannelClosedByBroker as exc:
                self._reopen()
                raise BrokerError(
                    f"Queue {queue.name!r} received messages meanwhile and was kept: "
                    f"{exc.reply_text}. Run the removal again once it is empty."
                ) from exc
        for exchange in plan.exchanges:
            self.channel.exchange_delete(exchange.name)
        self.forget_topology(plan, plan.topology_id)

    def delete_everything(self, plan: Plan) -> None:
        """Delete the topology and its shared queues, messages included (tests only)."""
        for queue in plan.all_queues:
            self.channel.queue_delete(queue.name)
        for exchange in plan.all_exchanges:
            self.channel.exchange_delete(exchange.name)


def _home_node_down(exc: px.ChannelClosedByBroker) -> bool:
    """Whether a 404 means "the queue exists but its node is down", not "no such queue".

    A classic queue lives on one node: while that node is down RabbitMQ
    answers a declare with 404 "home node ... is down or inaccessible".
    """
    return exc.reply_code == NOT_FOUND and "down or inaccessible" in str(exc.reply_text)


def _declared(channel: BlockingChannel, queue: str, node: Node) -> Any:
    """Passive declare of ``queue`` (its frame): ``TopologyNotDeclared`` if it does not
    exist, ``BrokerUnavailable`` if it does but its node is down."""
    try:
        return channel.queue_declare(queue, passive=True)
    except px.ChannelClosedByBroker as exc:
        if exc.reply_code != NOT_FOUND:
            raise
        if _home_node_down(exc):
            raise _unreachable_queue(queue, exc, node) from exc
        raise TopologyNotDeclared(
            f"Queue {queue!r} does not exist ({exc.reply_text}). {_NOT_DECLARED_HINT}"
        ) from exc


def _unreachable_queue(name: str, exc: px.ChannelClosedByBroker, node: Node) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"Queue {name!r} exists but the node holding it is down (RabbitMQ at {node.address}: "
        f"{exc.reply_text}). Classic queues are not replicated: QUEUE_TYPE 'quorum' keeps "
        "every queue available while a node is down."
    )


def not_declared(plan: Plan, missing: list[str], where: str) -> TopologyNotDeclared:
    """The error for a topology that ``DEFERRED['DECLARE'] = False`` forbids us to create."""
    shown = ", ".join(missing[:10]) + (
        f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    )
    return TopologyNotDeclared(
        f"DEFERRED['DECLARE'] is False, so deferred declares nothing itself, and RabbitMQ at "
        f"{where} lacks {len(missing)} part(s) of topology {plan.topology_id}: "
        f"{shown}. The infrastructure must create them: apply what `python manage.py "
        "declare_delay_topology --format definitions` (for `rabbitmqctl import_definitions`) "
        "or `--format terraform` prints, then run `declare_delay_topology --check`."
    )


def verify_topology(urls: Urls, plan: Plan, *, timeout: float | None = None) -> None:
    """Check passively that every exchange and queue of ``plan`` exists.

    ``TopologyNotDeclared`` names what is missing; ``BrokerUnavailable`` if
    the broker cannot be asked. Bindings cannot be inspected over AMQP: a
    missing one shows up as an unroutable publish (``mandatory``) or a job in
    the failed queue (alternate exchange), never as a lost job.
    """
    with admin_channel(urls, timeout=timeout) as admin:
        missing = admin.missing(plan)
    if missing:
        raise not_declared(plan, missing, admin.node.address)


def verify_exchange(urls: Urls, plan: Plan, name: str, *, timeout: float | None = None) -> None:
    """Check passively that the exchange ``name`` of ``plan`` exists (``TopologyNotDeclared``)."""
    with admin_channel(urls, timeout=timeout) as admin:
        if not admin.exchange_exists(name):
            raise not_declared(plan, [f"exchange {name}"], admin.node.address)


# --------------------------------------------------------------------------- consuming


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
        try:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            if self.shared_prefetch:
                channel.basic_qos(prefetch_count=self.prefetch, global_qos=True)
            for queue in self.queues:
                _declared(channel, queue, node)
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
        except (TopologyNotDeclared, BrokerUnavailable):
            _close_quietly(connection)
            raise
        except (*_CONNECTION_ERRORS, px.AMQPError) as exc:
            _close_quietly(connection)
            node.lost()
            raise BrokerUnavailable(
                f"Could not start consuming at {node.address}: {exc!r}"
            ) from exc
        except BaseException:
            _close_quietly(connection)
            raise
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
        except (*_CONNECTION_ERRORS, px.AMQPChannelError) as exc:
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
        except (*_CONNECTION_ERRORS, px.AMQPChannelError) as exc:
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
        except (*_CONNECTION_ERRORS, px.AMQPChannelError):
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
            _close_quietly(connection)
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
            raise TopologyNotDeclared(f"Queue {queue!r} does not exist. {_NOT_DECLARED_HINT}")
        with admin.take_all(queue) as (_channel, taken):
            return [(message.body, message.headers) for message in taken]


# --------------------------------------------------------------------------- streams


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
    ) -> None:
        self.urls = as_urls(urls)
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
        try:
            channel = connection.channel()
            _declared(channel, self.queue, node)
            channel.basic_qos(prefetch_count=self.prefetch)
            self._cancelled_by_broker = False
            channel.add_on_cancel_callback(self._on_broker_cancel)
            channel.basic_consume(
                self.queue,
                self._on_delivery,
                arguments={"x-stream-offset": "first" if offset is None else offset},
            )
        except (TopologyNotDeclared, BrokerUnavailable):
            _close_quietly(connection)
            raise
        except (*_CONNECTION_ERRORS, px.AMQPError) as exc:
            _close_quietly(connection)
            node.lost()
            raise BrokerUnavailable(
                f"Could not read stream {self.queue} at {node.address}: {exc!r}"
            ) from exc
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
        self.on_message(int(headers.get("x-stream-offset", -1)), body, headers)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        if self._connection is None or self._channel is None:
            raise BrokerUnavailable(f"Not reading stream {self.queue}.")
        try:
            yield
        except (*_CONNECTION_ERRORS, px.AMQPError) as exc:
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
                with _deadline(self._connection, timeout):
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
        except (*_CONNECTION_ERRORS, px.AMQPError):
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
            _close_quietly(connection)


# --------------------------------------------------------------------------- leadership


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

    def __init__(self, urls: Urls, queue: str, record_queue: str, *, heartbeat_s: int) -> None:
        self.urls = as_urls(urls)
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
        try:
            channel = connection.channel()
            if _declared(channel, self.queue, node).method.message_count == 0:
                channel.basic_publish(
                    "", self.queue, b"lease", pika.BasicProperties(delivery_mode=PERSISTENT)
                )
            channel.basic_qos(prefetch_count=1)
            channel.basic_consume(self.queue, self._on_token)
            confirm = connection.channel()
            confirm.confirm_delivery()
        except (TopologyNotDeclared, BrokerUnavailable):
            _close_quietly(connection)
            raise
        except (*_CONNECTION_ERRORS, px.AMQPError) as exc:
            _close_quietly(connection)
            node.lost()
            raise BrokerUnavailable(
                f"Could not join the scheduler at {node.address}: {exc!r}"
            ) from exc
        self._connection, self._channel, self._confirm = connection, channel, confirm
        self.node = node

    def _on_token(self, _ch: BlockingChannel, _method: Any, _props: Any, _body: bytes) -> None:
        self._held = True

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """A lost connection ends the lease: ``BrokerUnavailable``, and nothing held."""
        try:
            yield
        except (*_CONNECTION_ERRORS, px.AMQPError) as exc:
            self._lost()
            raise BrokerUnavailable(f"Lost the scheduler's connection: {exc!r}") from exc

    def poll(self, seconds: float) -> bool:
        """Serve the connection for ``seconds``; whether this worker leads now."""
        if self._connection is None:
            raise BrokerUnavailable("The scheduler's connection is not open.")
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

    def write_record(self, body: bytes, headers: dict[str, Any] | None = None) -> None:
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
            _close_quietly(connection)


def send_record(
    urls: Urls,
    queue: str,
    body: bytes,
    timeout: float = PUBLISH_TIMEOUT_S,
    headers: dict[str, Any] | None = None,
) -> None:
    """Publish one record (a schedule command) to ``queue`` with a confirm."""
    publisher(urls, timeout).publish("", queue, body, message_id=uuid.uuid4().hex, headers=headers)


CLOSE_TIMEOUT_S = 2.0


def _close_quietly(connection: pika.BlockingConnection) -> None:
    """Close ``connection``, never waiting long: a blocked or dying broker may not answer."""
    try:
        if connection.is_open:
            with _deadline(connection, CLOSE_TIMEOUT_S):
                connection.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass
