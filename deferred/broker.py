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

import base64
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel

from deferred.topology import Plan, Queue

logger = logging.getLogger("deferred.broker")

PERSISTENT = pika.DeliveryMode.Persistent
NOT_FOUND = 404
PRECONDITION_FAILED = 406


class BrokerError(Exception):
    """Something went wrong talking to RabbitMQ."""


class BrokerUnavailable(BrokerError):
    """RabbitMQ could not be reached, or the connection was lost."""


class TopologyNotDeclared(BrokerError):
    """A message had nowhere to go: the exchanges or queues do not exist."""


class TopologyConflict(BrokerError):
    """A queue or exchange exists with other arguments than the plan's."""


class PublishRefused(BrokerError):
    """The broker refused a message (negative confirm), e.g. a full queue."""


_CONNECTION_ERRORS = (px.AMQPConnectionError, px.ChannelWrongStateError, ConnectionError, OSError)

_NOT_DECLARED_HINT = (
    "Run `python manage.py declare_delay_topology` (once per deploy) to create it; with "
    "DEFERRED['DECLARE'] = False, create it with the definitions or Terraform that "
    "`declare_delay_topology --format definitions|terraform` prints."
)


#: How long a publish may wait while RabbitMQ blocks publishers (memory or disk
#: alarm) before failing, unless the URL sets ``blocked_connection_timeout``.
BLOCKED_TIMEOUT_S = 30.0


def connect(url: str) -> pika.BlockingConnection:
    """Open a connection, turning failures into ``BrokerUnavailable``."""
    params = pika.URLParameters(url)
    if "blocked_connection_timeout" not in url:
        # pika's default is to wait forever: a web request would hang.
        params.blocked_connection_timeout = BLOCKED_TIMEOUT_S
    try:
        return pika.BlockingConnection(params)
    except _CONNECTION_ERRORS as exc:
        raise BrokerUnavailable(f"Cannot connect to RabbitMQ at {_safe_url(url)}: {exc!r}") from exc


def _safe_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    params = pika.URLParameters(url)
    return f"{params.host}:{params.port}{params.virtual_host and '/' + params.virtual_host}"


def vhost_of(url: str) -> str:
    """The virtual host ``url`` connects to, read exactly as pika reads it (no I/O)."""
    return str(pika.URLParameters(url).virtual_host)


# --------------------------------------------------------------------------- publishing


class Publisher:
    """Publishes with confirms and ``mandatory``; one connection per thread.

    A web process may sit idle long enough for the broker to drop its
    connection, so a publish that finds it gone reconnects once and tries
    again. That retry can duplicate a message whose confirm was lost with the
    connection, which is within the at-least-once guarantee.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._local = threading.local()

    def _channel(self) -> BlockingChannel:
        local = self._local
        channel: BlockingChannel | None = getattr(local, "channel", None)
        if channel is not None and local.pid == os.getpid() and channel.is_open:
            return channel
        self._forget()
        connection = connect(self.url)
        channel = connection.channel()
        channel.confirm_delivery()
        local.connection, local.channel, local.pid = connection, channel, os.getpid()
        return channel

    def _forget(self) -> None:
        local = self._local
        connection = getattr(local, "connection", None)
        # A connection inherited through fork shares its socket with the parent:
        # drop it without closing, or the parent's connection would be closed.
        if connection is not None and local.pid == os.getpid():
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - already broken, nothing to save
                pass
        local.connection = local.channel = local.tx_channel = None
        local.pid = None

    def close(self) -> None:
        """Close this thread's connection, if any."""
        self._forget()

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
            channel = self._channel()
            try:
                channel.basic_publish(exchange, routing_key, body, properties, mandatory=True)
            except px.UnroutableError:
                raise TopologyNotDeclared(
                    f"The broker could not route the message to any queue (exchange "
                    f"{exchange or '(default)'!r}, routing key {routing_key!r}): the delay "
                    f"topology or the target queue is missing. {_NOT_DECLARED_HINT}"
                ) from None
            except px.NackError:
                raise PublishRefused(
                    f"RabbitMQ refused the message for exchange {exchange!r} (negative confirm)."
                ) from None

        self._reconnecting_once(send, exchange)

    def publish_many(self, messages: list[Outgoing]) -> None:
        """Publish persistent messages in one AMQP transaction: one round trip for all.

        Waiting for a confirm per message caps one thread at about a thousand
        messages a second; a transaction commits the whole batch at once and
        is just as durable. ``mandatory`` still applies: RabbitMQ returns an
        unroutable message before it answers the commit.
        """

        def send() -> None:
            self._channel()  # (re)connects if needed
            local = self._local
            tx: BlockingChannel | None = getattr(local, "tx_channel", None)
            if tx is None or not tx.is_open:
                tx = local.connection.channel()
                tx.tx_select()
                # Registered once per channel, so it collects into a list kept
                # beside the channel, not into this call's.
                returns: list[str] = []
                tx.add_on_return_callback(
                    lambda _ch, _method, props, _body: returns.append(props.message_id or "?")
                )
                local.tx_channel, local.tx_returned = tx, returns
            returned: list[str] = local.tx_returned
            returned.clear()
            # The channel's own basic_publish flushes the socket after every
            # message; inside a transaction nothing is answered before the
            # commit, so hand the frames to pika's underlying channel and let
            # the commit flush them all at once.
            raw = tx._impl
            for message in messages:
                raw.basic_publish(
                    message.exchange,
                    message.routing_key,
                    message.body,
                    _properties(message.message_id, None),
                    mandatory=True,
                )
            tx.tx_commit()
            local.connection.process_data_events(0)  # deliver the returns
            if returned:
                raise TopologyNotDeclared(
                    f"{len(returned)} of {len(messages)} message(s) could not be routed "
                    f"(job ids {', '.join(returned[:5])}...): the delay topology or a target "
                    f"queue is missing. {_NOT_DECLARED_HINT}"
                )

        self._reconnecting_once(send, ", ".join(sorted({m.exchange for m in messages})))

    def _reconnecting_once(self, send: Callable[[], None], exchange: str) -> None:
        """Run ``send``; on a lost connection reconnect once and run it again."""
        for attempt in (1, 2):
            try:
                send()
                return
            except px.ChannelClosedByBroker as exc:
                self._forget()
                if exc.reply_code == NOT_FOUND:
                    raise TopologyNotDeclared(
                        f"Exchange {exchange or '(default)'!r} does not exist (RabbitMQ: "
                        f"{exc.reply_text}). {_NOT_DECLARED_HINT}"
                    ) from exc
                raise BrokerError(f"RabbitMQ closed the channel: {exc.reply_text}") from exc
            except BrokerUnavailable:
                self._forget()
                raise
            except _CONNECTION_ERRORS as exc:
                self._forget()
                if attempt == 2:
                    raise BrokerUnavailable(
                        f"Lost the connection to RabbitMQ at {_safe_url(self.url)} while "
                        f"publishing, twice: {exc!r}"
                    ) from exc
                logger.warning("Connection to RabbitMQ lost (%r); reconnecting once.", exc)


@dataclass(frozen=True)
class Outgoing:
    """One message of :meth:`Publisher.publish_many`."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str


def _properties(message_id: str, headers: dict[str, Any] | None) -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type="application/json",
        delivery_mode=PERSISTENT,
        message_id=message_id,
        headers=headers or None,
    )


@lru_cache(maxsize=4)
def publisher(url: str) -> Publisher:
    """The process-wide publisher for ``url``."""
    return Publisher(url)


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

    @property
    def changed(self) -> bool:
        return bool(self.created)


class _HideProbeMisses(logging.Filter):
    """pika warns about every channel the broker closes, including the 404 that
    answers "does this queue exist?"; those are expected here, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NOT_FOUND" not in record.getMessage()


@contextmanager
def admin_channel(url: str) -> Iterator[Admin]:
    """A short-lived connection for declaring, inspecting and removing topologies."""
    connection = connect(url)
    quiet = _HideProbeMisses()
    pika_channel_logger = logging.getLogger("pika.channel")
    pika_channel_logger.addFilter(quiet)
    try:
        yield Admin(connection)
    except px.AMQPConnectionError as exc:
        raise BrokerUnavailable(f"Lost the connection to RabbitMQ: {exc!r}") from exc
    except px.AMQPError as exc:
        raise BrokerError(f"RabbitMQ refused an operation: {exc!r}") from exc
    finally:
        pika_channel_logger.removeFilter(quiet)
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - the work is done or already failed
            pass


class Admin:
    """Declaring, inspecting and deleting exchanges and queues.

    A passive declare of something missing makes RabbitMQ close the channel,
    so each probe that may fail gets a fresh channel.
    """

    def __init__(self, connection: pika.BlockingConnection) -> None:
        self.connection = connection
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

    def declare_queue(self, queue: Queue) -> None:
        try:
            self.channel.queue_declare(queue.name, durable=True, arguments=queue.arguments)
        except px.ChannelClosedByBroker as exc:
            self._reopen()
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

    def declare(self, plan: Plan) -> DeclareReport:
        """Create whatever of ``plan`` is missing; idempotent."""
        report = DeclareReport()
        # Shared queues first: a conflict there is the likeliest, and should
        # stop us before anything of the new topology exists.
        for queue in plan.all_queues:
            exists = self.queue_exists(queue.name)
            self.declare_queue(queue)
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


def not_declared(plan: Plan, missing: list[str], url: str) -> TopologyNotDeclared:
    """The error for a topology that ``DEFERRED['DECLARE'] = False`` forbids us to create."""
    shown = ", ".join(missing[:10]) + (
        f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    )
    return TopologyNotDeclared(
        f"DEFERRED['DECLARE'] is False, so deferred declares nothing itself, and RabbitMQ at "
        f"{_safe_url(url)} lacks {len(missing)} part(s) of topology {plan.topology_id}: "
        f"{shown}. The infrastructure must create them: apply what `python manage.py "
        "declare_delay_topology --format definitions` (for `rabbitmqctl import_definitions`) "
        "or `--format terraform` prints, then run `declare_delay_topology --check`."
    )


def verify_topology(url: str, plan: Plan) -> None:
    """Check passively that every exchange and queue of ``plan`` exists.

    ``TopologyNotDeclared`` names what is missing; ``BrokerUnavailable`` if
    the broker cannot be asked. Bindings cannot be inspected over AMQP: a
    missing one shows up as an unroutable publish (``mandatory``) or a job in
    the failed queue (alternate exchange), never as a lost job.
    """
    with admin_channel(url) as admin:
        missing = admin.missing(plan)
    if missing:
        raise not_declared(plan, missing, url)


# --------------------------------------------------------------------------- management API

#: The management API is optional: a status never waits long for it.
MANAGEMENT_TIMEOUT_S = 1.0


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect would carry the broker credentials elsewhere: treat it as a failure."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def unacked_counts(
    broker_url: str,
    queues: Sequence[str],
    *,
    api_url: str | None,
    timeout: float = MANAGEMENT_TIMEOUT_S,
) -> dict[str, int] | None:
    """Unacked messages per queue, from the management plugin's HTTP API.

    AMQP cannot tell how many messages are delivered and not yet acked; the
    management API can. It is optional, so any failure (plugin not enabled,
    port closed, refused credentials) gives ``None`` after at most one
    ``timeout`` per queue, and the caller reports the figure as unknown. The
    credentials are the URL's own, else the broker URL's.
    """
    if api_url is None:
        return None
    params = pika.URLParameters(broker_url)
    api = urllib.parse.urlsplit(api_url)
    if api.username is not None:
        user = urllib.parse.unquote(api.username)
        password = urllib.parse.unquote(api.password or "")
    else:
        user, password = params.credentials.username, params.credentials.password
    host = api.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if api.port:
        netloc += f":{api.port}"
    base = urllib.parse.urlunsplit((api.scheme, netloc, api.path.rstrip("/"), "", ""))
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    vhost = urllib.parse.quote(params.virtual_host, safe="")
    counts: dict[str, int] = {}
    for queue in queues:
        request = urllib.request.Request(
            f"{base}/api/queues/{vhost}/{urllib.parse.quote(queue, safe='')}",
            headers={"Authorization": f"Basic {token}", "Accept": "application/json"},
        )
        try:
            with _NO_REDIRECTS.open(request, timeout=timeout) as response:
                data = json.loads(response.read())
            counts[queue] = int(data.get("messages_unacknowledged", 0))
        except urllib.error.HTTPError as exc:
            if exc.code == NOT_FOUND:
                continue  # the queue does not exist: nothing unacked in it
            logger.debug("Management API at %s refused: %r", base, exc)
            return None
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            logger.debug("Management API at %s does not answer: %r", base, exc)
            return None
    return counts


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


class Consumer:
    """The worker's single consuming connection, driven from one I/O thread."""

    def __init__(
        self, url: str, queues: list[str], prefetch: int, *, shared_prefetch: bool
    ) -> None:
        self.url = url
        self.queues = queues
        self.prefetch = prefetch
        #: Cap the unacked messages of all consumers together (classic queues
        #: only: quorum queues refuse a channel-wide prefetch).
        self.shared_prefetch = shared_prefetch
        self.generation = 0
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._tags: list[str] = []
        self._cancelled_by_broker: str | None = None

    def start(self, on_delivery: Callable[[Delivery], None]) -> None:
        """Connect and start consuming; ``BrokerUnavailable`` or ``TopologyNotDeclared``."""
        self.close()
        connection = connect(self.url)
        try:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            if self.shared_prefetch:
                channel.basic_qos(prefetch_count=self.prefetch, global_qos=True)
            for queue in self.queues:
                try:
                    channel.queue_declare(queue, passive=True)
                except px.ChannelClosedByBroker as exc:
                    if exc.reply_code != NOT_FOUND:
                        raise
                    raise TopologyNotDeclared(
                        f"Queue {queue!r} does not exist ({exc.reply_text}). {_NOT_DECLARED_HINT}"
                    ) from exc
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
                        )
                    )

                self._tags.append(channel.basic_consume(queue, callback))
        except TopologyNotDeclared:
            _close_quietly(connection)
            raise
        except (*_CONNECTION_ERRORS, px.AMQPError) as exc:
            _close_quietly(connection)
            raise BrokerUnavailable(f"Could not start consuming: {exc!r}") from exc
        except BaseException:
            _close_quietly(connection)
            raise
        self._connection, self._channel = connection, channel

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
            self._drop()
            raise BrokerUnavailable(f"Lost the connection to RabbitMQ: {exc!r}") from exc
        if self._channel is None or self._channel.is_closed:
            # e.g. RabbitMQ's consumer_timeout closes the channel, not the connection.
            self._drop()
            raise BrokerUnavailable("RabbitMQ closed the consuming channel.")
        if self._cancelled_by_broker:
            self._drop()
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
            self._drop()
            raise BrokerUnavailable(f"Lost the connection to RabbitMQ: {exc!r}") from exc

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

    def _drop(self) -> None:
        connection = self._connection
        self._connection = self._channel = None
        self._tags = []
        if connection is not None:
            _close_quietly(connection)

    def close(self) -> None:
        self._drop()


def _close_quietly(connection: pika.BlockingConnection) -> None:
    try:
        if connection.is_open:
            connection.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass
