"""The worker's view of the cancels: a thread that follows the cancels stream and
answers "is this job cancelled?" before each job runs.

Why a cancel issued just before its job is due still wins, and how the reader
proves it has read every cancel confirmed before it (re)connected: see
:mod:`deferred.records.cancels`, where cancels are written and their format is.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.template.defaultfilters import pluralize

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.core import notices, signing
from deferred.core.jobs import Job
from deferred.core.topology import plan_topology
from deferred.records.cancels import CancelView, decode_record, encode_marker, marker_of

logger = logging.getLogger("deferred.cancels")
#: A catch-up younger than this covers a job however long ago it came due: a
#: cancel confirmed while the job waited to be taken still wins, for 20 rounds a second.
FRESH_S = 0.05
#: The shortest time between two catch-up rounds (each is a round trip the broker
#: answers): caps them at 200 a second however many jobs come due.
SYNC_SPACING_S = 0.005
#: How often the reader forgets expired cancels.
SWEEP_EVERY_S = 60.0
#: Reconnection waits double from the first to the last, then stay there.
RECONNECT_FIRST_S = 0.1
RECONNECT_CAP_S = 5.0
#: How long a (re)connected reader may take to read the stream up to its own marker.
MARKER_TIMEOUT_S = 120.0


@dataclass
class _Progress:
    #: Catch-ups asked for, and done (the latest request a completed one covers).
    requested: int = 0
    synced: int = 0
    #: Every cancel confirmed before this time (epoch seconds) has been read.
    proven: float = 0.0


class CancelWatch:
    """A thread that reads the cancels stream and answers "is this job cancelled?".

    :meth:`is_cancelled` first makes the reader catch up with the stream
    (one round trip serves every job waiting at that moment), so a cancel
    confirmed before the question is never missed. While the stream cannot
    be read it raises ``BrokerUnavailable``: a job is not run on a guess.
    """

    def __init__(self, settings: DeferredSettings, *, clock: Callable[[], float] = time.time):
        self.settings = settings
        self.clock = clock
        self.view = CancelView(settings.cancel_margin_ms / 1000)
        self.queue = plan_topology(settings).cancels_queue.name
        self._follower = broker.StreamFollower(settings.broker_urls, self.queue, self._on_message)
        self._next_offset: int | None = None
        #: The marker this reader wrote and has not read back yet.
        self._awaited: str | None = None
        self._progress = _Progress()
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: Set while the stream is being read (tests and status wait on it).
        self.connected = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deferred-cancels", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._follower.wake()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __len__(self) -> int:
        """The cancels in force that this worker knows of."""
        return len(self.view)

    def is_cancelled(self, job_id: str, timeout: float, *, due: float | None = None) -> bool:
        """Whether ``job_id`` is cancelled, once every cancel confirmed before ``due``
        (epoch seconds; default: now) has been read."""
        self.sync(timeout, since=due)
        return job_id in self.view

    def sync(self, timeout: float, *, since: float | None = None) -> None:
        """Wait until the reader has read every cancel confirmed before ``since`` (default: now).

        A catch-up that began after ``since`` proves it already: a backlog of
        jobs that came due a while ago costs one round trip, not one each.
        """
        if since is not None and self._progress.proven >= max(since, time.time() - FRESH_S):
            return
        with self._cond:
            self._progress.requested += 1
            ticket = self._progress.requested
        self._follower.wake()
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._progress.synced >= ticket or self._stopping.is_set(), timeout
            )
        if not done or self._progress.synced < ticket:
            raise broker.BrokerUnavailable(
                f"Could not read the cancels (stream {self.queue}) within {timeout:.0f} s: "
                "the job is handed back rather than run without knowing whether it was cancelled."
            )

    def _on_message(self, offset: int, body: bytes, headers: dict[str, Any]) -> None:
        self._next_offset = offset + 1
        marker = marker_of(body)
        if marker is not None:
            # Unsigned: a marker only ends a catch-up, and its token is a
            # random one no one else knows.
            if marker == self._awaited:
                self._awaited = None
            return
        try:
            record = decode_record(body)
        except ValueError as exc:
            logger.warning(
                "Ignoring a message of stream %s that is neither a cancel nor a keyed job: %s",
                self.queue,
                exc,
            )
            return
        if self.settings.signing:
            try:
                signing.verify(body, headers, self.settings.signing_keys)
            except signing.BadSignature as exc:
                # A forged cancel, or a forged keyed job superseding real ones,
                # would stop jobs from running: it is not applied.
                what = (
                    f"keyed job {record.id}"
                    if isinstance(record, Job)
                    else f"{len(record[0])} cancel{pluralize(len(record[0]))}"
                )
                logger.error(
                    "Ignoring %s of stream %s at offset %d: %s.", what, self.queue, offset, exc
                )
                return
        self.view.apply(record, self.clock())

    def _declare_stream(self) -> bool:
        """With ``DECLARE`` on, create a missing stream (a deploy that skipped
        ``declare_delay_topology`` after an upgrade): jobs must not wait on it."""
        if not self.settings.declare:
            return False
        try:
            with broker.admin_channel(
                self.settings.broker_urls, timeout=self.settings.publish_timeout_s
            ) as admin:
                admin.declare_cancels(plan_topology(self.settings))
        except broker.BrokerError as exc:
            if isinstance(exc, broker.TopologyNotDeclared) or "NOT_FOUND" in str(exc):
                notices.topology_missing(exc)  # its exchange is missing too
            else:
                logger.error("Could not declare the cancels stream %s: %s", self.queue, exc)
            return False
        logger.warning(
            "Declared the missing cancels stream %s; run declare_delay_topology after each "
            "upgrade to create what a new version needs.",
            self.queue,
        )
        return True

    def _read_to_marker(self) -> None:
        """Read up to a marker written now: the proof that every cancel confirmed before
        this (re)connection has been read.

        A new consumer of a stream gets its first messages only after the
        broker's reader notices them, so an empty first read proves nothing.
        One marker per connection of a worker is all the stream gets.
        """
        token = uuid.uuid4().hex
        self._awaited = token
        sent = time.time()
        # Straight into the stream (the worker may use the default exchange):
        # reading the cancels does not depend on the ingest exchange's binding,
        # which a topology declared by an earlier version lacks.
        broker.publisher_for(self.settings).publish(
            "", self.queue, encode_marker(token), message_id=token
        )
        deadline = time.monotonic() + MARKER_TIMEOUT_S
        while self._awaited is not None:
            if time.monotonic() > deadline or self._stopping.is_set():
                raise broker.BrokerUnavailable(
                    f"Did not read back this worker's marker from stream {self.queue} within "
                    f"{MARKER_TIMEOUT_S:.0f} s."
                )
            self._follower.poll(0.05)
        with self._cond:
            self._progress.proven = max(self._progress.proven, sent)

    def _run(self) -> None:
        wait_s = RECONNECT_FIRST_S
        swept = time.monotonic()
        while not self._stopping.is_set():
            try:
                first = self._next_offset is None
                started = time.monotonic()
                self._follower.connect(self._next_offset)
                self._read_to_marker()
                logger.info(
                    "%s the cancels: %d in force (%.1f s).",
                    "Read" if first else "Caught up with",
                    len(self.view),
                    time.monotonic() - started,
                )
                self.connected.set()
                wait_s = RECONNECT_FIRST_S
                last_round = 0.0
                while not self._stopping.is_set():
                    with self._cond:
                        ticket = self._progress.requested
                    if time.monotonic() - swept > SWEEP_EVERY_S:
                        self.view.sweep(self.clock())
                        swept = time.monotonic()
                    if ticket > self._progress.synced:
                        # Rounds at most every SYNC_SPACING_S: under load, the jobs
                        # that came due meanwhile share the next one.
                        wait = last_round + SYNC_SPACING_S - time.monotonic()
                        if wait > 0:
                            self._follower.poll(wait)
                            continue
                        last_round = time.monotonic()
                        sent = time.time()
                        self._follower.sync(timeout=self.settings.publish_timeout_s)
                        with self._cond:
                            self._progress.synced = ticket
                            self._progress.proven = max(self._progress.proven, sent)
                            self._cond.notify_all()
                        continue
                    self._follower.poll(1.0)
            except (broker.BrokerUnavailable, broker.TopologyNotDeclared) as exc:
                self.connected.clear()
                if self._stopping.is_set():
                    break
                if isinstance(exc, broker.StreamGone | broker.TopologyNotDeclared):
                    # A new stream starts its offsets again: read it from its start.
                    self._next_offset = None
                if isinstance(exc, broker.TopologyNotDeclared) and self._declare_stream():
                    continue
                if isinstance(exc, broker.TopologyNotDeclared):
                    notices.topology_missing(exc)
                else:
                    logger.error(
                        "Cannot read the cancels (%s); jobs wait until it can. Retrying in %.1f s.",
                        exc,
                        wait_s,
                    )
                self._stopping.wait(wait_s)
                wait_s = min(wait_s * 2, RECONNECT_CAP_S)
            except Exception:
                self.connected.clear()
                logger.exception("The cancels reader failed; restarting it in %.1f s.", wait_s)
                self._stopping.wait(wait_s)
                wait_s = min(wait_s * 2, RECONNECT_CAP_S)
        self.connected.clear()
        self._follower.close()
