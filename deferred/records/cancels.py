"""Cancelling jobs by id: ``cancel()``, and what every worker knows of the cancels.

A job waiting in a delay queue cannot be taken out of it, so a cancel is a
note instead: its id, appended to a RabbitMQ stream (``PREFIX.cancels``).
The broker keeps the stream on disk and replicated; every worker reads it
from the start when it boots and then follows it, and drops a job it finds
there when the job comes due. No table, no polling, no local disk.

How long a cancel is kept: a job id carries the job's first due time
(:func:`deferred.core.jobs.due_of`), so a cancel is in force until that time (or
the cancel's own time, if later: the job may be running or waiting for a
retry) plus ``CANCEL_MARGIN``. Memory therefore holds the cancels of jobs
still pending, plus those of the last margin. The stream keeps every cancel
for ``MAX_DELAY + CANCEL_MARGIN``, long enough for the latest one to matter.

A cancel issued just before its job is due wins: before running a job, the
worker asks its reader to catch up with the stream (a round trip on the
reading channel, shared by the jobs that wait for it), so any cancel whose
``cancel()`` had returned before the job came due (or 50 ms before it is
taken, for a job that waited in a backlog) is known, the hosts' clocks
agreeing as "never early" assumes. On a cluster the reader may follow a
replica that learns of a commit a few milliseconds after the confirm: a
cancel within that moment of the due time can lose. When the reader (re)connects, it first
writes a marker to the stream and reads up to it: no job runs before the
reader has read every cancel confirmed before it connected.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings, get_settings
from deferred.core import signing
from deferred.core.jobs import BrokenMessage, Job, due_of, new_job_id, utcnow
from deferred.core.keys import KeyView
from deferred.core.moves import MoveView
from deferred.core.topology import CANCEL_ROUTING_KEY, plan_topology

logger = logging.getLogger("deferred.cancels")

FORMAT_VERSION = 1
#: Ids per stream message: a large cancel_many() is a few messages, not one per job.
IDS_PER_MESSAGE = 1000
#: The longest job id accepted (ours are 32 characters; django.tasks ids are ours too).
MAX_ID_LENGTH = 200

#: Pushed by ``deferred.testing`` (capture and eager modes): the newest one
#: receives each cancel instead of the broker.
interceptors: list[Callable[[list[str]], None]] = []


def cancel(job_id: str) -> None:
    """Cancel the job ``job_id`` (the id ``defer()`` returned): it will not run.

    A job waiting for its first run or for a retry does not run; a job
    running now finishes, and is not retried. The cancel is durable when
    this returns (the broker confirmed it), and holds through restarts of
    the workers and the broker, until the job's due time plus
    ``CANCEL_MARGIN``. See the README's "Cancelling jobs" for the limits (a
    cancel within milliseconds of the due time on a cluster, a retry that
    waits longer than the margin).

    An id that is unknown, of a job that already finished, or already
    cancelled is accepted quietly: nothing can tell these apart without a
    table. ``TypeError`` or ``ValueError`` for something that is not an id;
    ``deferred.BrokerError`` if the broker cannot take the cancel.
    """
    cancel_many([job_id])


def cancel_many(job_ids: Iterable[str]) -> None:
    """Cancel every job of ``job_ids``, in a few broker messages; see :func:`cancel`.

    Every id is checked before anything is published. Confirmed as a whole:
    when this returns, every cancel is durable; on ``BrokerError`` some may
    have been taken and others not, and calling again is harmless.
    """
    if isinstance(job_ids, str | bytes):
        raise TypeError("cancel_many() takes a list of job ids, not a single string.")
    ids = [_checked(job_id) for job_id in job_ids]
    if not ids:
        return
    if interceptors:
        interceptors[-1](ids)
        return
    settings = get_settings()
    plan = plan_topology(settings)
    bodies = [
        encode(ids[n : n + IDS_PER_MESSAGE], utcnow()) for n in range(0, len(ids), IDS_PER_MESSAGE)
    ]
    messages = [
        broker.Outgoing(
            plan.ingest_exchange,
            CANCEL_ROUTING_KEY,
            body,
            new_job_id(),
            signing.sign(body, settings.signing_keys),
        )
        for body in bodies
    ]
    sender = broker.publisher_for(settings)
    if len(messages) == 1:
        m = messages[0]
        sender.publish(
            m.exchange, m.routing_key, m.body, message_id=m.message_id, headers=m.headers
        )
    else:
        sender.publish_many(messages)


def cancel_route_missing(settings: DeferredSettings) -> str | None:
    """What is missing for ``cancel()`` to reach the stream, or ``None``.

    The binding from the ingest exchange cannot be inspected over AMQP: a
    marker (which cancels nothing) is sent the way a cancel goes, ``mandatory``.
    A topology declared by a version before cancels went through the ingest
    exchange lacks it until ``declare_delay_topology`` runs again.
    """
    plan = plan_topology(settings)
    token = uuid.uuid4().hex
    try:
        broker.publisher_for(settings).publish(
            plan.ingest_exchange, CANCEL_ROUTING_KEY, encode_marker(token), message_id=token
        )
    except broker.TopologyNotDeclared:
        return (
            f"binding {plan.ingest_exchange} -> {plan.cancels_queue.name} "
            f"(routing key {CANCEL_ROUTING_KEY!r}), which cancel() needs"
        )
    return None


def _checked(job_id: object) -> str:
    if not isinstance(job_id, str):
        raise TypeError(f"A job id is a string (what defer() returned), got {job_id!r}.")
    if not job_id or len(job_id) > MAX_ID_LENGTH or not job_id.isprintable():
        raise ValueError(f"Not a job id: {job_id!r}.")
    return job_id


# --------------------------------------------------------------------------- records


def encode(ids: list[str], at: datetime) -> bytes:
    """One stream message: the cancelled ids and when they were cancelled."""
    return json.dumps(
        {"version": FORMAT_VERSION, "at": at.isoformat(), "ids": ids}, separators=(",", ":")
    ).encode()


def encode_marker(token: str) -> bytes:
    """A message that cancels nothing: a reader that reads it back knows it has read
    every cancel confirmed before it was written."""
    return json.dumps({"version": FORMAT_VERSION, "marker": token}).encode()


def marker_of(body: bytes) -> str | None:
    """The token of a marker message; ``None`` for any other message."""
    if b'"marker"' not in body:
        return None
    try:
        data = _json(body)
    except ValueError:
        return None
    marker = data.get("marker") if isinstance(data, dict) else None
    return marker if isinstance(marker, str) else None


def _json(body: bytes) -> object:
    """The decoded body; ``ValueError`` for anything JSON cannot read (a body nested
    too deeply for the parser included)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def decode_record(body: bytes) -> tuple[list[str], datetime] | Job:
    """A cancel record's ``(ids, at)``, or a keyed job (``deferred.core.keys``) or a
    moved one (``deferred.core.moves``): the things the stream holds besides
    markers. ``ValueError`` for anything else."""
    if b'"task"' in body:
        try:
            job = Job.decode(body)
        except BrokenMessage as exc:
            raise ValueError(f"not a job: {exc}") from None
        if job.key is None and job.gen is None:
            raise ValueError(f"job {job.id} has no key: it has no business in the stream")
        return job
    return decode(body)


def decode(body: bytes) -> tuple[list[str], datetime]:
    """``(ids, at)`` of a cancel record; ``ValueError`` for anything else."""
    data = _json(body)
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise ValueError("not a cancel record of a known version")
    ids, at = data.get("ids"), data.get("at")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError("a cancel record's ids must be a list of strings")
    if not isinstance(at, str) or (moment := datetime.fromisoformat(at)).tzinfo is None:
        raise ValueError("a cancel record's time must be an aware ISO 8601 string")
    return ids, moment


def expires(job_id: str, at: datetime, margin_s: float) -> float:
    """When the cancel of ``job_id`` made at ``at`` may be forgotten (epoch seconds).

    Its job's first due time (from the id) or the cancel's time, whichever
    is later, plus the margin: a job cancelled before it was due is dropped
    when it comes due and never retried; one cancelled later may be running
    or waiting for a retry due at most a margin later. An id this library
    did not make names no job: it is kept for the margin only.
    """
    due = due_of(job_id)
    start = at if due is None else max(due, at)
    return start.timestamp() + margin_s


class CancelView:
    """The cancels in force, in memory: job id -> when it may be forgotten; and the
    debounce keys (``keys``) and moves (``moves``) in force, which live in the
    same stream."""

    def __init__(self, margin_s: float) -> None:
        self.margin_s = margin_s
        self._until: dict[str, float] = {}
        self.keys = KeyView(margin_s)
        self.moves = MoveView(margin_s)

    def apply(self, record: tuple[list[str], datetime] | Job, now: float) -> None:
        """One record of the stream, read in the stream's order (``decode_record``)."""
        if isinstance(record, Job):
            if record.gen is not None:
                self.moves.add(
                    record.id,
                    record.gen,
                    record.due.timestamp(),
                    now,
                    attempt=record.attempt,
                    old_due_s=record.first_due.timestamp(),
                )
                # A cancel made before the move holds until the moved copy is due.
                if record.id in self._until:
                    self._until[record.id] = max(
                        self._until[record.id], self.moves.until(record.id)
                    )
            if record.key is not None:
                self.keys.add(record.key, record.id, record.first_due.timestamp(), now)
        else:
            self.add(*record, now)

    def add(self, ids: Iterable[str], at: datetime, now: float) -> None:
        until = self._until
        for job_id in ids:
            # A moved job's cancel holds until its moved copy is due.
            expiry = max(expires(job_id, at, self.margin_s), self.moves.until(job_id))
            if expiry > now and expiry > until.get(job_id, 0.0):
                until[job_id] = expiry

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._until

    def __len__(self) -> int:
        return len(self._until)

    def sweep(self, now: float) -> int:
        """Forget the cancels and keys whose time is up; how many were forgotten."""
        expired = [job_id for job_id, until in self._until.items() if until <= now]
        for job_id in expired:
            del self._until[job_id]
        return len(expired) + self.keys.sweep(now) + self.moves.sweep(now)


#: How long the status waits for a stream's first messages.
QUIET_S = 0.2


def read_cancels(settings: DeferredSettings | None = None, *, timeout: float = 30.0) -> CancelView:
    """The cancels in force now: the whole stream, read once (status command and page).

    ``BrokerError`` if the stream cannot be read.
    """
    settings = settings or get_settings()
    view = CancelView(settings.cancel_margin_ms / 1000)
    now = time.time()

    def on_message(_offset: int, body: bytes, headers: dict[str, Any]) -> None:
        try:
            record = decode_record(body)
            if settings.signing:
                signing.verify(body, headers, settings.signing_keys)
        except ValueError:  # BadSignature too: what a worker would ignore
            return
        view.apply(record, now)

    follower = broker.StreamFollower(
        settings.broker_urls, plan_topology(settings).cancels_queue.name, on_message
    )
    started = time.monotonic()
    follower.connect(timeout=timeout)
    try:
        # A new consumer's first messages come a moment after it subscribed:
        # wait for a quiet moment before the round trips that prove the rest.
        # (A count for people; a worker proves it with a marker instead.)
        while True:
            before = follower.received
            follower.poll(QUIET_S)
            if follower.received == before or time.monotonic() - started > timeout:
                break
        follower.sync(timeout=max(0.1, timeout - (time.monotonic() - started)))
    finally:
        follower.close()
    return view
