"""Administration and inspection: declaring, checking and reading queues, taking
messages, and telling a missing topology from a broker that is down."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import pika
import pika.exceptions as px
from pika.adapters.blocking_connection import BlockingChannel

from deferred.broker.connection import (
    NOT_FOUND,
    PERSISTENT,
    PRECONDITION_FAILED,
    DeadlineExceeded,
    Node,
    Urls,
    close_quietly,
    hide_pika_lines,
    open_connection,
    within_deadline,
)
from deferred.broker.errors import (
    NOT_DECLARED_HINT,
    BrokerError,
    BrokerUnavailable,
    TopologyConflict,
    TopologyNotDeclared,
)
from deferred.core.topology import Binding, Plan, Queue

logger = logging.getLogger("deferred.broker")

#: How long a queue may take to answer a declare. RabbitMQ 3.x answers at once
#: (404 "home node ... down") for a classic queue whose node is down; 4.3 does
#: not answer at all, and the caller would wait for ever.
QUEUE_ANSWER_TIMEOUT_S = 10.0


@contextmanager
def _queue_answers(connection: pika.BlockingConnection, name: str, node: Node) -> Iterator[None]:
    """Bound a declare of queue ``name``: past the timeout, the connection is
    torn down and the queue's node taken for down (``BrokerUnavailable``)."""
    try:
        with within_deadline(connection, QUEUE_ANSWER_TIMEOUT_S):
            yield
    except DeadlineExceeded as exc:
        raise BrokerUnavailable(
            f"Queue {name!r} did not answer within {QUEUE_ANSWER_TIMEOUT_S:g} s (RabbitMQ at "
            f"{node.address}): the node holding it is down or unreachable. Classic queues are "
            "not replicated: QUEUE_TYPE 'quorum' keeps every queue available while a node is "
            "down."
        ) from exc


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
#: Limits that earlier releases declared without (or with another value): a
#: policy key changes them on a queue that exists, a new declare cannot.
POLICY_ARGUMENTS = {"x-delivery-limit": "delivery-limit", "x-consumer-timeout": "consumer-timeout"}
_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<name>[^']+)'.*but current is "
    r"(?:none|the value '(?P<value>[^']*)' of type '(?P<type>[^']+)')"
)


def _placement_conflict(exc: px.ChannelClosedByBroker) -> tuple[str, Any] | None:
    """``(argument, the queue's current value or None)`` when a 406 is about placement only."""
    if exc.reply_code != PRECONDITION_FAILED:
        return None
    match = _INEQUIVALENT.search(str(exc.reply_text))
    if match is None or match["name"] not in (
        *PLACEMENT_ARGUMENTS,
        *RETENTION_ARGUMENTS,
        *POLICY_ARGUMENTS,
    ):
        return None
    value: Any = match["value"]
    if value is not None and match["type"] in ("signedint", "long", "short", "byte"):
        value = int(value)
    return match["name"], value


def quiet_probes() -> AbstractContextManager[None]:
    """Hide pika's warnings of the 404s that answer "does this queue exist?": pika
    warns about every channel the broker closes; those are expected, not news."""
    return hide_pika_lines("pika.channel", "NOT_FOUND")


@contextmanager
def admin_channel(urls: Urls, *, timeout: float | None = None) -> Iterator[Admin]:
    """A short-lived connection (to the first node that answers) for declaring,
    inspecting and removing topologies.

    ``timeout`` bounds the connect and everything done in the block (a web
    request that checks the topology must not hang on a silent node).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    connection, node = open_connection(urls, timeout=timeout)
    with quiet_probes():
        try:
            if deadline is None:
                yield Admin(connection, node)
            else:
                with within_deadline(connection, deadline - time.monotonic()):
                    yield Admin(connection, node)
        except px.AMQPConnectionError as exc:
            node.lost()
            raise BrokerUnavailable(
                f"Lost the connection to RabbitMQ at {node.address}: {exc!r}"
            ) from exc
        except px.AMQPError as exc:
            raise BrokerError(f"RabbitMQ refused an operation: {exc!r}") from exc
        finally:
            close_quietly(connection)


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
            with _queue_answers(self.connection, name, self.node):
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
        tries = len(PLACEMENT_ARGUMENTS) + len(RETENTION_ARGUMENTS) + len(POLICY_ARGUMENTS) + 1
        for _ in range(tries):
            try:
                with _queue_answers(self.connection, queue.name, self.node):
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
                results = queue.name.endswith(".results")
                source = "RESULT_TTL" if results else "MAX_DELAY + CANCEL_MARGIN"
                risk = (
                    "results are kept as long as the stream's own retention says"
                    if results
                    else "cancels may be forgotten before their jobs are due"
                )
                return (
                    f"stream {queue.name} exists with other retention ({', '.join(kept)}); "
                    f"it is used as it is. The settings ask for {queue.arguments.get('x-max-age')} "
                    f"({source}): apply it with a policy (`rabbitmqctl set_policy --apply-to "
                    f"queues deferred-{'results' if results else 'cancels'} "
                    f"'^{re.escape(queue.name)}$' "
                    f'\'{{"max-age":"{queue.arguments.get("x-max-age")}"}}\'`), or {risk}'
                )
            limits = {
                POLICY_ARGUMENTS[k.split("=")[0]]: queue.arguments[k.split("=")[0]]
                for k in kept
                if k.split("=")[0] in POLICY_ARGUMENTS and k.split("=")[0] in queue.arguments
            }
            if queue.ttl_ms is not None and all(k.split("=")[0] in POLICY_ARGUMENTS for k in kept):
                # A delay queue of an earlier release: nothing consumes it,
                # and RabbitMQ 4's default limit (20) is far above the one
                # read a move to another broker makes. Not worth a warning.
                return None
            if limits:
                return (
                    f"queue {queue.name} exists with other limits ({', '.join(kept)}); it is "
                    "used as it is. Apply the settings' limits with a policy (`rabbitmqctl "
                    f"set_policy --apply-to queues deferred-limits '^{re.escape(queue.name)}$' "
                    f"'{json.dumps(limits)}'`), or recreate the queue"
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
        self.bind(plan, [b for b in plan.bindings if b.destination == plan.cancels_queue.name])

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
        report.bindings = self.bind(plan, plan.all_bindings)
        self.record(plan)
        return report

    def bind(self, plan: Plan, bindings: Sequence[Binding]) -> int:
        """Make ``bindings`` (idempotent), pipelined; how many were made.

        A plan has hundreds of bindings (838 with the defaults), and one round
        trip each was most of what declaring took. They are sent with
        ``nowait`` instead (pika's blocking channel only offers the waiting
        form, so through the channel beneath it), and one synchronous call
        after them proves that the broker took them all: it handles a channel's
        methods in order, and a binding it refuses closes the channel, which
        that call then raises.
        """
        channel = self.channel._impl
        for binding in bindings:
            if binding.destination_type == "exchange":
                channel.exchange_bind(binding.destination, binding.source, binding.routing_key)
            else:
                channel.queue_bind(binding.destination, binding.source, binding.routing_key)
        try:
            # Any synchronous method does; basic.qos needs no permission and
            # cannot fail (0 is the channel's default: no prefetch limit).
            self.channel.basic_qos(prefetch_count=0)
        except px.ChannelClosedByBroker as exc:
            self._reopen()
            raise BrokerError(
                f"RabbitMQ refused a binding of topology {plan.topology_id}: {exc.reply_text}"
            ) from exc
        return len(bindings)

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

    def stream_span(self, stream: str, wait_s: float = 0.5) -> int | None:
        """About how many messages stream ``stream`` keeps; ``None`` if it does not exist.

        A passive declare says 0 for any stream, so this reads the offset of
        the first message and of the last chunk (one delivery each, at once
        when there is one; an empty stream answers nothing, and costs
        ``wait_s``). The last chunk counts as one message: a lower bound.
        """
        if self.queue_stats(stream) is None:
            return None
        offsets = []
        for where in ("first", "last"):
            channel = self.connection.channel()
            got: list[int] = []

            def seen(_ch: Any, _m: Any, props: Any, _b: bytes, got: list[int] = got) -> None:
                got.append(int((props.headers or {}).get("x-stream-offset", -1)))

            try:
                channel.basic_qos(prefetch_count=1)
                channel.basic_consume(stream, seen, arguments={"x-stream-offset": where})
                deadline = time.monotonic() + wait_s
                while not got and time.monotonic() < deadline:
                    self.connection.process_data_events(time_limit=0.02)
            finally:
                if channel.is_open:
                    channel.close()
            if not got or got[0] < 0:
                return 0
            offsets.append(got[0])
        return max(0, offsets[1] - offsets[0] + 1)

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
            if not self._delete_empty(queue.name, queue.arguments.get("x-queue-type")):
                raise BrokerError(
                    f"Queue {queue.name!r} received messages meanwhile and was kept. Run the "
                    "removal again once it is empty."
                )
        for exchange in plan.exchanges:
            self.channel.exchange_delete(exchange.name)
        self.forget_topology(plan, plan.topology_id)

    def delete_if_empty(self, name: str) -> bool:
        """Delete queue ``name`` if no message is ready in it (the broker checks
        atomically; it does not count messages delivered and not yet acked: the caller
        knows where those go); whether it is gone now (missing counts as gone)."""
        self._delete_empty(name, "classic")  # the legacy queues: classic only
        return self.queue_stats(name) is None

    def _delete_empty(self, name: str, queue_type: Any) -> bool:
        """Delete queue ``name`` if it has no ready message; whether it was deleted (or
        was not there).

        A classic queue is deleted ``if-empty``, which the broker checks
        atomically. A quorum queue refuses ``if-empty`` (RabbitMQ 4.x closes the
        connection: ``NOT_IMPLEMENTED``), so it is counted, then deleted: the
        callers stop what feeds it first (the ingest exchange, the levels above).
        """
        if queue_type == "quorum":
            count = self.message_count(name)
            if count:
                return False
            if count is not None:
                self.channel.queue_delete(name)
            return True
        try:
            self.channel.queue_delete(name, if_empty=True)
        except px.ChannelClosedByBroker:
            self._reopen()
            return False
        return True

    def delete(self, queues: Sequence[str], exchanges: Sequence[str]) -> None:
        """Delete ``queues`` (messages included) then ``exchanges``; what does not exist is
        no error. For ``declare_delay_topology --delete``, which asked first."""
        for queue in queues:
            self.channel.queue_delete(queue)
        for exchange in exchanges:
            self.channel.exchange_delete(exchange)

    def delete_everything(self, plan: Plan) -> None:
        """Delete the topology and its shared queues, messages included (tests only).

        Pipelined like :meth:`bind`: deleting what does not exist is no error.
        """
        channel = self.channel._impl
        for queue in plan.all_queues:
            channel.queue_delete(queue.name)
        for exchange in plan.all_exchanges:
            channel.exchange_delete(exchange.name)
        self.channel.basic_qos(prefetch_count=0)


def _home_node_down(exc: px.ChannelClosedByBroker) -> bool:
    """Whether a 404 means "the queue exists but its node is down", not "no such queue".

    A classic queue lives on one node: while that node is down RabbitMQ
    answers a declare with 404 "home node ... is down or inaccessible".
    """
    return exc.reply_code == NOT_FOUND and "down or inaccessible" in str(exc.reply_text)


def declared_queue(channel: BlockingChannel, queue: str, node: Node) -> Any:
    """Passive declare of ``queue`` (its frame): ``TopologyNotDeclared`` if it does not
    exist, ``BrokerUnavailable`` if it does but its node is down."""
    try:
        with _queue_answers(channel.connection, queue, node):
            return channel.queue_declare(queue, passive=True)
    except px.ChannelClosedByBroker as exc:
        if exc.reply_code != NOT_FOUND:
            raise
        if _home_node_down(exc):
            raise _unreachable_queue(queue, exc, node) from exc
        raise TopologyNotDeclared(
            f"Queue {queue!r} does not exist ({exc.reply_text}). {NOT_DECLARED_HINT}"
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
