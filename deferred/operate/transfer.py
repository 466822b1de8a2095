"""Moving to a new broker (``deferred_transfer``): every pending job, failed job and
cancel, each exactly once, each job with its own id and due time.

Why not "publish to the new broker, wait for its confirm, ack on the old
one": a transfer that dies between the confirm and the ack leaves the job on
both brokers, and a rerun cannot tell, since a delay queue cannot be searched
and its messages move between queues as their TTLs run out. So each message
goes through a staging queue on the new broker (``PREFIX.transfer``), a plain
durable queue that a rerun *can* read as a whole, a batch at a time:

1. stage: publish the batch there, with confirms, each message named by its
   transfer key (a hash of its kind and body: the same message, the same key);
2. ack the batch on the old broker, and wait for the proof that the queue
   has had the acks (a passive declare of it on the same channel: its answer
   comes from the queue, after the acks). An ack has no answer of its own: a
   connection lost just after it could still hand the messages back;
3. move: reject the staged copies (``requeue=False``). The staging queue
   dead-letters them into ``PREFIX.transfer.out``, which routes them by their
   routing key into the topology's ingest exchange (or the failed exchange):
   the last move happens inside the broker, with no client-side window, and
   is as safe as any hop of the topology (confirmed between quorum queues).

A run starts by consuming the staging queue exclusively and reading all of
it: what an interrupted run left there. An old message whose key is found
there is acked (and proven) without being staged again, and only then is its
staged copy moved; a staged copy whose old message never shows up was acked
before the interruption, and moves once the old broker is drained (two sweeps
a second apart, in the order messages flow, find it empty) and nothing else
consumes it. So whenever a run is interrupted, each old message is, for the
next run, either not staged, staged and still on the old broker, staged and
acked, or moved and acked: never moved and still on the old broker, since
step 3 waits for step 2's proof. The exclusive consumer makes "read as a
whole" true: while another connection (a running transfer, or a dead one the
broker has not dropped yet) holds staged messages, a run is refused instead of
missing them. A leftover copy is staged again with a routing key computed when
it moves, the old copy acked, and the new one moved; interrupted in between,
the key is there twice and the next run moves one copy.

Due times. A job's routing key is its remaining delay, from its ``due`` (or
the time its id carries when the body is not a job), rounded up, computed when
it is staged; it enters the topology when it is moved, a moment later. So it
is never early, and late by the fraction of a second a batch takes. Jobs that
come due during the transfer wait in the old broker's ready queues, which are
looked at between batches. A job for a queue these settings lack goes to the
failed queue, as it would have on the old broker.

Failed jobs move the same way, so they are not doubled either. Cancels are
copied first, before a moved job can come due, and again at the end; records
the new stream has already, or no cancel of which is in force any more, are
left out (a cancel is idempotent anyway). Recurring jobs: their occurrences
already planned (at most ``LOOKAHEAD`` ahead) are pending jobs and move; the
old scheduler's record is copied when the new broker has none, so that the
first scheduler there goes on where the old one stopped (nothing planned
twice, missed occurrences by their misfire policy, pauses kept).

Limits: two byte-identical messages (a job duplicated on the old broker) may
become one; a crash of the old broker that loses acks it had taken would bring
their jobs back there.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

from deferred import broker
from deferred.broker.transfer import (
    HEARTBEAT_S,
    KEY_HEADER,
    Held,
    Side,
    Staged,
    Staging,
    same_broker,
)
from deferred.conf import DeferredSettings
from deferred.core.jobs import body_level, new_job_id, utcnow
from deferred.core.topology import plan_topology
from deferred.operate.transfer_plan import (
    FAILED,
    FAILED_ROUTE,
    JOB,
    Progress,
    SourceQueue,
    Summary,
    carried,
    flow_order,
    in_force,
    route,
    source_queues,
    staging_plan,
    transfer_key,
)
from deferred.records import cancels
from deferred.records.failures import REASON_HEADER, parse_failed
from deferred.records.schedules import PEEK_ATTEMPTS, PEEK_RETRY_S, signed_bodies
from deferred.records.schedules import Records as ScheduleRecords
from deferred.records.schedules import read as read_schedules

logger = logging.getLogger("deferred.transfer")

#: Messages per batch, by default: staged, acked and moved together.
BATCH = 500
#: A queue that delivers nothing for this long is taken as drained (for this pass).
IDLE_S = 0.1
#: How often the ready queues are looked at while delay queues are drained.
READY_CHECK_S = 0.5
#: The old broker counts as drained when two sweeps this far apart find it empty.
SETTLE_S = 1.0
#: How long reading a stream up to our own marker may take.
STREAM_TIMEOUT_S = 120.0


class TransferError(Exception):
    """The transfer cannot start or go on: the message says why and what to do."""


class Transfer:
    """Moves everything of ``settings``' prefix from ``source`` to ``target``.

    :meth:`stop` (from a signal handler) ends it after the batch in hand: what
    is staged is moved, the rest stays on the old broker for the next run.
    """

    def __init__(
        self,
        settings: DeferredSettings,
        *,
        source: broker.Urls,
        target: broker.Urls,
        batch: int = BATCH,
        on_progress: Callable[[Progress], None] | None = None,
        progress_every_s: float = 1.0,
    ) -> None:
        self.settings = settings
        self.source_urls = broker.as_urls(source)
        self.target_urls = broker.as_urls(target)
        self.batch = batch
        self.on_progress = on_progress
        self.progress_every_s = progress_every_s
        self.progress = Progress()
        self._stopping = threading.Event()
        self._started = self._reported = self._checked = self._moving = 0.0
        #: Keys an interrupted run staged, not moved until their old message is settled.
        self._unproven: set[str] = set()

    def stop(self) -> None:
        """End after the batch in hand (safe from a signal handler)."""
        self._stopping.set()

    def run(self) -> Summary:
        """Move everything; ``TransferError`` or ``BrokerError`` say why not."""
        self._started = self._reported = time.monotonic()
        self._plan = plan_topology(self.settings)
        self._source = Side(self.source_urls, "old broker")
        try:
            self._target = Side(self.target_urls, "new broker")
        except BaseException:
            self._source.close()
            raise
        try:
            return self._run()
        finally:
            # Whatever was taken and not settled goes back where it was.
            self._target.close()
            self._source.close()

    def _run(self) -> Summary:
        plan, source, target = self._plan, self._source, self._target
        if same_broker(source, target):
            raise TransferError(
                f"The old and the new broker are the same ({source.address} and "
                f"{target.address} reach one vhost of one broker): nothing to move."
            )
        with source.guard("inspect the topology"):
            missing = source.admin.missing(plan)
            records = source.admin.topology_records(plan)
        if missing:
            raise TransferError(
                f"The old broker at {source.address} lacks {len(missing)} part(s) of topology "
                f"{plan.topology_id} under PREFIX {plan.prefix!r} ({', '.join(missing[:3])}...): "
                "was it ever declared there? Run this with the settings (PREFIX, RADIX, "
                "RESOLUTION, MAX_DELAY, QUEUE_TYPE, QUEUES) the old broker's workers used."
            )
        queues = source_queues(plan, records)
        self._ready = [q for q in queues if q.ready]
        self._sweep(queues)
        self._staging = self._prepare_target()
        self._unproven = set(self._staging.open())
        logger.info(
            "Moving from %s to %s: %d message(s) on the old broker, %d staged by an earlier run.",
            source.address,
            target.address,
            self.progress.remaining,
            len(self._unproven),
        )
        summary = Summary(self.progress)
        copied, summary.cancels_present, summary.cancels_expired = self._copy_cancels()
        self._copy_schedules(summary)
        self._drain_all(queues)
        if self._stopping.is_set():
            summary.interrupted = True
            return self._finish(summary)
        # Drained, and nothing holds a message of it: every key left was acked before.
        self._refresh_and_move(sorted(self._unproven))
        self._unproven.clear()
        summary.cancels_copied = copied + self._copy_cancels()[0]
        if plan.queue_type == "quorum" or not self._staging.remove():
            summary.staging_kept = self._staging.queue.name
        return self._finish(summary)

    def _finish(self, summary: Summary) -> Summary:
        self._tick(force=True)
        return summary

    # ------------------------------------------------------------------ checks

    def _sweep(self, queues: list[SourceQueue]) -> dict[str, int]:
        """The messages of each queue of the old broker that has any, counted in the order
        they flow (a message moving on during the sweep is counted, never missed); and
        a refusal to go on while anything else consumes them.

        A worker that still runs could take a job whose staged copy an
        interrupted run left behind, and both would run. Every worker consumes
        its ready queues or competes for the scheduler's queue (one that only
        polls with ``basic.get`` and schedules nothing shows in neither: stop
        the workers, this only catches the ones it can see).
        """
        source = self._source
        scheduler = self._plan.scheduler_queue.name
        stats = source.stats([*(q.name for q in flow_order(queues)), scheduler])
        busy = [f"{name} ({s.consumers})" for name, s in stats.items() if s and s.consumers]
        if busy:
            raise TransferError(
                f"Queues of the old broker at {source.address} have consumers: "
                f"{', '.join(busy[:5])}. Stop the old broker's workers first: the jobs they "
                "would run are moved. On a delay or failed queue it is another transfer, or "
                "the connection of an interrupted one until the broker notices it is gone "
                f"(within {2 * HEARTBEAT_S} s): run this again then."
            )
        counts = {n: s.messages for n, s in stats.items() if s and s.messages and n != scheduler}
        self.progress.remaining = sum(counts.values())
        return counts

    def _prepare_target(self) -> Staging:
        """Declare (or check) the topology and the staging queue on the new broker."""
        plan, target = self._plan, self._target
        with target.guard("read its topology registry"):
            recorded = {r["topology"] for r in target.admin.topology_records(plan)}
        others = recorded - {plan.topology_id}
        if others:
            raise TransferError(
                f"The new broker at {target.address} has topology {', '.join(sorted(others))} "
                f"under PREFIX {plan.prefix!r}, and these settings make {plan.topology_id}: "
                "run this with the settings of the new broker's workers."
            )
        missing = None
        if plan.topology_id in recorded or not self.settings.declare:
            # Declared before (by declare_delay_topology, or an earlier run): checking
            # is much quicker than declaring again, which redoes every binding.
            with target.guard("inspect the topology"):
                missing = target.admin.missing(plan)
        if missing and not self.settings.declare:
            raise TransferError(str(broker.not_declared(plan, missing, target.address)))
        if missing is None or missing:
            try:
                with target.guard("declare the topology"):
                    target.admin.declare(plan)
            except broker.TopologyConflict as exc:
                raise TransferError(
                    f"The new broker at {target.address} has objects under PREFIX "
                    f"{plan.prefix!r} that differ from these settings': {exc}"
                ) from exc
        shape = staging_plan(plan)
        staging = target.staging(shape.queue, shape.exchange, shape.out)
        try:
            staging.declare(plan, shape.bindings)
        except broker.TopologyConflict as exc:
            raise TransferError(
                f"The staging queue {shape.queue.name} exists with other arguments: an earlier "
                f"transfer ran with another QUEUE_TYPE. Finish it with those settings. ({exc})"
            ) from exc
        return staging

    def _copy_schedules(self, summary: Summary) -> None:
        """Give the new broker the old scheduler's record, unless it has one of its own.

        Its first scheduling worker then goes on where the old one stopped:
        nothing planned already (and moved) is planned again, occurrences
        missed meanwhile follow their misfire policy, pauses hold. A record
        there already (its scheduler ran) stands: each schedule went on from
        there. Commands not applied yet are not copied (the summary counts them).
        """
        queue = self._plan.schedules_queue.name
        if self._newest_record(self.target_urls, queue) is not None:
            summary.schedules_kept = True
            return
        found = self._newest_record(self.source_urls, queue)
        if found is None:
            return
        body, headers, records, summary.schedule_commands = found
        summary.schedules = {name: e.paused for name, e in sorted(records.entries.items())}
        self._send([broker.Outgoing("", queue, body, uuid.uuid4().hex, carried(headers))])

    def _newest_record(
        self, urls: tuple[str, ...], queue: str
    ) -> tuple[bytes, dict[str, Any], ScheduleRecords, int] | None:
        """The newest signed state record of a schedules queue, as read by the scheduler:
        (body, headers, what it says, commands waiting); read again while the leader
        may be holding it."""
        for _ in range(PEEK_ATTEMPTS):
            messages = broker.peek(urls, queue, timeout=self.settings.publish_timeout_s)
            signed = signed_bodies(messages, self.settings)
            records, commands = read_schedules(signed)
            if records.seq:
                body, headers = next(
                    (b, h)
                    for b, h in messages
                    if b in signed and read_schedules([b])[0].seq == records.seq
                )
                return body, headers, records, len(commands)
            time.sleep(PEEK_RETRY_S)
        return None

    # ------------------------------------------------------------------ cancels

    def _copy_cancels(self) -> tuple[int, int, int]:
        """Copy the cancel records still in force that the new broker lacks:
        (copied, present already, no longer in force)."""
        stream = self._plan.cancels_queue.name
        present = {_digest(body) for body, _ in read_stream(self.target_urls, stream)}
        now, margin_s = time.time(), self.settings.cancel_margin_ms / 1000
        todo, found, expired = [], 0, 0
        for body, headers in read_stream(self.source_urls, stream):
            if _digest(body) in present:
                found += 1
            elif not in_force(body, margin_s, now):
                expired += 1
            else:
                present.add(_digest(body))
                todo.append(broker.Outgoing("", stream, body, new_job_id(), carried(headers)))
        self._send(todo)
        return len(todo), found, expired

    def _send(self, messages: list[broker.Outgoing]) -> None:
        """Publish ``messages`` to the new broker with confirms, a batch at a time."""
        sender = broker.Publisher(self.target_urls, self.settings.publish_timeout_s)
        try:
            for n in range(0, len(messages), self.batch):
                sender.publish_many(messages[n : n + self.batch])
        finally:
            sender.close()

    # ------------------------------------------------------------------ jobs

    def _drain_all(self, queues: list[SourceQueue]) -> None:
        """Passes over every queue until two sweeps find them all empty (or :meth:`stop`).

        Two, :data:`SETTLE_S` apart: a quorum queue's dead-letters in flight
        (at-least-once) are in no queue's count for a moment.
        """
        empty = 0
        while not self._stopping.is_set():
            counts = self._sweep(queues)
            if not counts:
                empty += 1
                if empty == 2:
                    return
                self._stopping.wait(SETTLE_S)
                continue
            empty = 0
            for queue in queues:
                if queue.name in counts and not self._stopping.is_set():
                    self._drain(queue, counts[queue.name])

    def _drain(self, queue: SourceQueue, expected: int) -> None:
        """Move up to ``expected`` messages of ``queue``, a batch at a time."""
        drain = self._source.drain(queue.name, prefetch=2 * self.batch)
        try:
            taken = 0
            while taken < expected and not self._stopping.is_set():
                held = drain.take(min(self.batch, expected - taken), IDLE_S)
                if not held:
                    return
                self._move_batch(queue.kind, held, drain.settle)
                taken += len(held)
                self.progress.remaining = max(0, self.progress.remaining - len(held))
                self._tick()
                if not queue.ready:
                    self._ready_check()
        finally:
            drain.close()

    def _ready_check(self) -> None:
        """Between two batches of a delay queue: the jobs that came due meanwhile first."""
        if time.monotonic() - self._checked < READY_CHECK_S:
            return
        self._checked = time.monotonic()
        due = self._source.stats([q.name for q in self._ready])
        for queue in self._ready:
            waiting = due[queue.name]
            if waiting and waiting.messages and not self._stopping.is_set():
                self._drain(queue, waiting.messages)

    def _move_batch(self, kind: str, held: list[Held], settle: Callable[[list[Held]], int]) -> None:
        """Steps 1-3 of the module's argument, for one batch of the old broker."""
        self._moving = self._moving or time.monotonic()
        now = utcnow()
        fresh: dict[str, broker.Outgoing] = {}
        resumed: list[str] = []
        for message in held:
            key = transfer_key(kind, message.body)
            if key in fresh or key in resumed:
                continue  # a byte-identical copy in the same batch: the same message
            if key in self._unproven:
                self._unproven.discard(key)
                resumed.append(key)
            else:
                fresh[key] = self._outgoing(kind, key, message, now)
        self._staging.stage(list(fresh.values()))
        self._staging.wait_for(fresh)
        settle(held)  # with the proof: only now may the staged copies move
        moving = [copy for key in fresh for copy in self._staging.take(key)]
        self._staging.move(moving)
        self._count(moving)
        self._refresh_and_move(resumed)

    def _refresh_and_move(self, keys: list[str]) -> None:
        """Move what an interrupted run staged, whose old message is settled.

        Each is staged anew with a routing key computed now (its old one was
        computed when it was first staged), the old copies are acked, then the
        new one is moved. Interrupted in between, the key is simply staged
        twice, and the next run moves one copy.
        """
        staging = self._staging
        old = {key: copies for key in keys if (copies := staging.take(key))}
        if not old:
            return
        now = utcnow()
        staging.stage(
            [
                self._outgoing(_kind_of(copies[0]), key, copies[0], now)
                for key, copies in old.items()
            ]
        )
        staging.drop([copy for copies in old.values() for copy in copies])
        staging.wait_for(old)
        moving = [copy for key in old for copy in staging.take(key)]
        staging.move(moving)
        staging.sync()
        self._count(moving)
        self.progress.resumed += len(moving)

    def _outgoing(
        self,
        kind: str,
        key: str,
        message: Held | Staged,
        now: datetime,
    ) -> broker.Outgoing:
        headers = {**carried(message.headers), KEY_HEADER: key}
        if kind == FAILED and REASON_HEADER not in headers:
            # A bare job (put there by the broker) tells its reason by its x-death
            # header, which the move rewrites: keep it where a record keeps it.
            reason = parse_failed(message.body, message.headers, message.message_id).reason
            headers[REASON_HEADER] = reason
        return broker.Outgoing(
            self._staging.exchange,
            route(kind, message.body, message.message_id, message.routing_key, self._plan, now),
            message.body,
            message.message_id or key,
            headers,
            body_level(message.body),
        )

    def _count(self, moved: list[Staged]) -> None:
        now = time.monotonic()
        self._moving = self._moving or now
        self.progress.moving_s = now - self._moving
        for copy in moved:
            if copy.routing_key != FAILED_ROUTE:
                self.progress.jobs += 1
            elif REASON_HEADER in copy.headers:
                self.progress.failed += 1
            else:
                self.progress.unroutable += 1

    def _tick(self, *, force: bool = False) -> None:
        now = time.monotonic()
        self.progress.elapsed_s = now - self._started
        if self.on_progress and (force or now - self._reported >= self.progress_every_s):
            self._reported = now
            self.on_progress(replace(self.progress))


def _kind_of(staged: Staged) -> str:
    return FAILED if REASON_HEADER in staged.headers else JOB


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def read_stream(urls: broker.Urls, stream: str) -> list[tuple[bytes, dict[str, Any]]]:
    """Every message of ``stream`` but markers: read up to a marker written now, so
    that every message confirmed before the call is in it."""
    token = uuid.uuid4().hex
    found: list[tuple[bytes, dict[str, Any]]] = []
    seen = threading.Event()

    def on_message(_offset: int, body: bytes, headers: dict[str, Any]) -> None:
        marker = cancels.marker_of(body)
        if marker is None:
            found.append((body, headers))
        elif marker == token:
            seen.set()

    follower = broker.StreamFollower(urls, stream, on_message)
    follower.connect(timeout=STREAM_TIMEOUT_S)
    try:
        sender = broker.Publisher(urls)
        try:
            sender.publish("", stream, cancels.encode_marker(token), message_id=token)
        finally:
            sender.close()
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while not seen.is_set():
            if time.monotonic() > deadline:
                raise broker.BrokerUnavailable(
                    f"Did not read stream {stream} up to its end within {STREAM_TIMEOUT_S:.0f} s."
                )
            follower.poll(0.05)
    finally:
        follower.close()
    return found
