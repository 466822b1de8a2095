"""The results stream's I/O: the workers' writer, and the look-up by timestamp.

What goes in the records and how they are read back is :mod:`deferred.records.results`;
this module only moves bytes. Two parts:

- :class:`ResultWriter`, one per worker: a thread that publishes the records
  the job threads hand it, as few stream messages as possible. Everything
  that arrives while one message waits for its confirm, or within
  ``LINGER_S`` of the first, goes out in the next one (a group commit), so
  the broker sees a few messages per second, not one per job, whatever the
  rate; and no job thread waits for a confirm.
- :class:`ResultReader`, one per process: reads the stream from a timestamp
  until a caller's predicate says it has what it needs, or up to a marker it
  wrote itself, or until its time is up. The marker is the proof of "read to
  the end": a stream consumer that has just subscribed is told of the
  stream's contents a moment later (see
  :class:`deferred.broker.streams.StreamFollower`), so no round trip on its
  own channel proves that nothing more is there. A marker is a replicated
  write and a confirm, so the reader writes one only once the stream has
  gone quiet (``IDLE_S`` with no delivery), or after ``MARK_BY_S`` on a
  stream that never goes quiet, without the predicate being satisfied: a
  look-up that finds what it needs in the first messages
  delivered, the usual case for a job that ended, writes nothing.
"""

from __future__ import annotations

import atexit
import enum
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pika
import pika.exceptions as px

from deferred.broker.admin import declared_queue
from deferred.broker.connection import (
    CONNECTION_ERRORS,
    Urls,
    as_urls,
    close_quietly,
    hide_pika_lines,
    open_connection,
    setting_up,
    within_deadline,
)
from deferred.broker.errors import BrokerError, BrokerUnavailable
from deferred.broker.publisher import publisher

logger = logging.getLogger("deferred.broker")

#: The most records one stream message carries.
RECORDS_PER_MESSAGE = 500
#: How long the writer waits, after a record arrives, for others to share its
#: message. A look-up reads the stream message by message, and RabbitMQ's cost
#: is per message (a stream chunk each, at the rates workers write): at 100
#: jobs/s, 5 ms made 1.7 records a message and a look-up read about 50 messages
#: to reach its job, over 20 ms of the broker's time alone. No job waits for it
#: (jobs are acked as they end); what it delays is when a finished job reads as
#: such, and it is the window of records a worker killed outright takes with it.
LINGER_S = 0.05
#: The most records waiting for the writer. A job thread that would add one more
#: waits for room (``PUBLISH_TIMEOUT`` at most, then the record is counted lost):
#: a results stream slower than the jobs slows the jobs, rather than the
#: worker's memory growing without bound.
MAX_WAITING = 20_000
#: How long a reader waits with no delivery before it writes its marker. A fresh
#: consumer is handed its first messages some milliseconds after it subscribed
#: (mostly under 20 ms, rarely up to about 60 ms, measured on a loaded host); a
#: quiet moment longer than that means the predicate found nothing in what the
#: stream had, and only then is the marker's write worth it. A look-up of a job
#: still waiting or running pays this once; one that finds its job's end pays
#: nothing. Too short costs a marker (correct, as before); too long, latency.
IDLE_S = 0.1
#: The marker is written at the latest this long after the read began, quiet or not:
#: a stream the workers append to more often than ``IDLE_S`` never goes quiet.
MARK_BY_S = 0.3
#: A look-up's credit: the messages the broker may send ahead of its acks. RabbitMQ
#: 3.10 reads a stream consumer's whole credit from disk before it sends the first
#: message: with messages of a chunk each (a worker's writes at moderate rates),
#: the first delivery came after 7 ms with a credit of 5 or 10, 16 ms with 50 and
#: 23-25 ms with 100, and reading 15 messages took 18 ms with 10 against 55 ms with
#: 100 (connection included, one machine). The reader acks as it goes, so the
#: credit refills; a finished job's record is one of the first messages read.
READ_CREDIT = 10
#: How long past its own deadline a read's connection is torn down, should a call
#: block (a broker that stopped answering): the read itself stops at the deadline.
BACKSTOP_S = 1.0
#: How long the writer keeps trying to write a batch the broker did not take (a
#: restart), and its first and longest pauses between two tries.
RETRY_FOR_S = 120.0
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 1.0
#: Pause after an unexpected error in the writer's own loop, so a bug that repeats
#: logs a line per pause instead of spinning.
ERROR_PAUSE_S = 0.1


@dataclass(eq=False)
class Written:
    """The stream message a record goes out in: who waits for its confirm."""

    records: list[Any] = field(default_factory=list)
    _callbacks: list[Callable[[bool], None]] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: Whether the broker confirmed it (known once done).
    ok: bool = False

    def add_done_callback(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(ok)`` once the message is confirmed or given up: now, on
        this thread, if that happened already, else on the writer's thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self.ok)

    def wait(self, timeout: float) -> bool:
        """Whether the message was confirmed within ``timeout`` seconds."""
        return self._done.wait(timeout) and self.ok

    def _finish(self, ok: bool) -> None:
        with self._lock:
            self.ok = ok
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(ok)
            except Exception:  # a callback's bug must not stop the writer
                logger.exception("A result write callback raised.")


class ResultWriter:
    """Publishes records to the results stream from a thread of its own.

    ``encode(records) -> (body, headers)`` makes one message of a batch (the
    caller signs it). :meth:`write` queues a record and returns the
    :class:`Written` it goes out in, whose callbacks run once the broker
    confirmed it or it was given up (for tests, and for whoever must know).
    :meth:`delay` queues a record to go out ``after_s`` from now unless
    :meth:`take` takes it back first (a job's "started" record, which a job
    that ends sooner folds into its final one).
    """

    def __init__(
        self,
        urls: Urls,
        exchange: str,
        routing_key: str,
        encode: Callable[[list[Any]], tuple[bytes, dict[str, Any]]],
        *,
        timeout: float,
        linger_s: float = LINGER_S,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self.urls = as_urls(urls)
        self.exchange = exchange
        self.routing_key = routing_key
        self.encode = encode
        self.timeout = timeout
        self.linger_s = linger_s
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._next = Written()
        #: Delayed records by key: (when they go out, time.monotonic(); the record).
        self._delayed: dict[str, tuple[float, Any]] = {}
        #: Until when the writer sleeps waiting for records (``math.inf``: until one
        #: comes); ``None`` while it lingers or publishes, when it needs no waking.
        self._idle_until: float | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: Records the broker could not take (logged, counted for tests and status).
        self.lost = 0
        self._last_warning = 0.0

    def start(self) -> None:
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="deferred-results", daemon=True)
        self._thread.start()

    def write(self, record: Any) -> Written:
        """Queue ``record`` for the next message; once stopped, or with no room for
        ``timeout`` seconds (:data:`MAX_WAITING`), a message already given up (``ok`` false)."""
        with self._cond:
            deadline = time.monotonic() + self.timeout
            while not self._stopped and len(self._next.records) >= self.max_waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._stopped or len(self._next.records) >= self.max_waiting:
                self.lost += 1
                gone = Written([record])
                gone._finish(False)
                return gone
            written = self._next
            written.records.append(record)
            if len(written.records) == 1:  # the writer waits for a first record only
                self._cond.notify_all()
        return written

    def delay(self, key: str, record: Any, after_s: float) -> None:
        """Queue ``record`` to go out ``after_s`` from now, unless taken back."""
        with self._cond:
            if not self._stopped:
                at = time.monotonic() + after_s
                self._delayed[key] = (at, record)
                # Wake the writer only if it sleeps past this record's time: a wake per
                # job (a "started" record each) cost a busy worker a tenth of its rate.
                if self._idle_until is not None and at < self._idle_until:
                    self._cond.notify_all()

    def take(self, key: str) -> Any:
        """The delayed record ``key`` if it has not gone out yet (it no longer will)."""
        with self._cond:
            entry = self._delayed.pop(key, None)
        return None if entry is None else entry[1]

    def stop(self, timeout: float | None = None) -> None:
        """Publish what is queued (delayed records too), then end the thread; waits
        ``timeout`` seconds at most (default: the publish timeout, and a second)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout + 1.0 if timeout is None else timeout)

    def _run(self) -> None:
        """The writer's thread. Nothing may end it but :meth:`stop`: a dead writer
        would leave a worker whose jobs run and whose results are never written,
        and, once :data:`MAX_WAITING` records wait, whose jobs each wait
        ``PUBLISH_TIMEOUT`` for room."""
        while True:
            try:
                written = self._collect()
            except Exception:  # see the docstring
                logger.exception("The results writer failed to collect records; it goes on.")
                time.sleep(ERROR_PAUSE_S)
                continue
            if written is None:
                return
            self._publish(written)

    def _collect(self) -> Written | None:
        """Wait for records, linger for more, and take them with the delayed ones now
        due; ``None`` once stopped with nothing left."""
        with self._cond:
            while True:
                now = time.monotonic()
                due = [k for k, (at, _r) in self._delayed.items() if at <= now or self._stopped]
                if self._next.records or due:
                    break
                if self._stopped:
                    return None
                wake = min((at for at, _r in self._delayed.values()), default=None)
                self._idle_until = math.inf if wake is None else wake
                try:
                    self._cond.wait(None if wake is None else max(0.0, wake - now))
                finally:
                    self._idle_until = None
            end = time.monotonic() + self.linger_s
            while not self._stopped and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
            now = time.monotonic()
            due = [k for k, (at, _r) in self._delayed.items() if at <= now or self._stopped]
            written, self._next = self._next, Written()
            self._cond.notify_all()  # room again for job threads waiting in write()
            # Delayed records first: a "started" record goes out before what follows it.
            written.records[:0] = [self._delayed.pop(k)[1] for k in due]
            return written

    def _publish(self, written: Written) -> None:
        """Publish one batch; whatever happens, settle its :class:`Written` (``ok`` false
        unless every message of it was confirmed), so its jobs are acked either way.

        A broker that went away (a restart, a dropped connection) is waited for, up
        to :data:`RETRY_FOR_S`: a record given up is a job that reads as never
        started, which a copy of it, or its redelivery to another worker, would
        then run again. Messages already confirmed are not sent again.
        """
        ok = False
        sent = 0
        give_up_at = time.monotonic() + RETRY_FOR_S
        pause = RETRY_FIRST_S
        try:
            while True:
                try:
                    sender = publisher(self.urls, self.timeout)
                    while sent < len(written.records):
                        batch = written.records[sent : sent + RECORDS_PER_MESSAGE]
                        body, headers = self.encode(batch)
                        sender.publish(
                            self.exchange,
                            self.routing_key,
                            body,
                            message_id=uuid.uuid4().hex,
                            headers=headers,
                        )
                        sent += len(batch)
                    ok = True
                    return
                except BrokerError as exc:
                    if self._stopped or time.monotonic() + pause > give_up_at:
                        self._give_up(len(written.records) - sent, exc)
                        return
                    logger.info(
                        "Could not write %d result record(s) yet (%s); trying again in %.1f s.",
                        len(written.records) - sent,
                        exc,
                        pause,
                    )
                    with self._cond:
                        self._cond.wait_for(lambda: self._stopped, pause)
                    pause = min(pause * 2, RETRY_MAX_S)
        except Exception:  # a bug (in encode, say) must not end the thread
            self.lost += len(written.records) - sent
            logger.exception(
                "Could not write %d result record(s) to the results stream; the writer "
                "goes on, and those jobs are acked all the same.",
                len(written.records) - sent,
            )
        finally:
            written._finish(ok)

    def _give_up(self, count: int, exc: BaseException) -> None:
        self.lost += count
        now = time.monotonic()
        if now - self._last_warning > 60:
            self._last_warning = now
            logger.warning(
                "Could not write %d result record(s) to the results stream: %s. Those "
                "jobs are acked all the same (running a job again is worse than a "
                "missing result); their results read as the last record that went out.",
                count,
                exc,
            )


class ReadEnd(enum.Enum):
    """How a :meth:`ResultReader.read` ended."""

    #: The caller's predicate said it had what it needs.
    FOUND = "found"
    #: Read up to the reader's own marker: nothing more was in the stream.
    END = "end"
    #: The time given ran out first: what was read is all that is known.
    OUT_OF_TIME = "out_of_time"


class ResultReader:
    """Reads the results stream by timestamp, a connection per look-up.

    Why not one connection kept open: a stream refuses ``basic.reject``, and
    cancelling a consumer makes pika reject what is still on its way (and
    RabbitMQ then closes the whole connection). Closing the connection instead
    drops those deliveries with it, safely; opening one costs about 2 ms on a
    local network, well inside a look-up's budget.
    """

    def __init__(
        self,
        urls: Urls,
        stream: str,
        exchange: str,
        routing_key: str,
        publish_timeout: float,
        *,
        credit: int = READ_CREDIT,
    ) -> None:
        self.urls = as_urls(urls)
        self.publish_timeout = publish_timeout
        #: Messages the broker may send ahead of the acks (:data:`READ_CREDIT`).
        self.credit = credit
        self.stream = stream
        self.exchange = exchange
        self.routing_key = routing_key

    def read(
        self,
        since: datetime,
        on_message: Callable[[bytes, dict[str, Any]], bool],
        *,
        marker_body: Callable[[str], bytes],
        is_marker: Callable[[bytes], str | None],
        timeout: float,
        idle_s: float | None = None,
    ) -> ReadEnd:
        """Hand ``on_message(body, headers)`` every message from ``since`` on, until it
        returns ``True`` (``FOUND``), up to a marker written during the read (``END``),
        or for ``timeout`` seconds at most (``OUT_OF_TIME``). The marker is written
        only once no message came for ``idle_s`` (default: ``IDLE_S``).

        ``BrokerUnavailable`` if no node answers, or the connection is lost;
        ``TopologyNotDeclared`` if the stream does not exist.
        """
        deadline = time.monotonic() + timeout
        connection, node = open_connection(self.urls, timeout=timeout)
        try:
            with setting_up(connection, node, f"read stream {self.stream}"):
                channel = connection.channel()
                declared_queue(channel, self.stream, node)
            # The read stops itself at the deadline; this only ends a call that blocks.
            backstop = max(0.1, deadline - time.monotonic()) + BACKSTOP_S
            with within_deadline(connection, backstop):
                quiet = IDLE_S if idle_s is None else idle_s
                return self._read(
                    connection, channel, since, on_message, marker_body, is_marker, deadline, quiet
                )
        except (*CONNECTION_ERRORS, px.AMQPError) as exc:
            node.lost()
            raise BrokerUnavailable(
                f"Lost the connection reading stream {self.stream}: {exc!r}"
            ) from exc
        finally:
            close_later(connection)

    def _read(
        self,
        connection: pika.BlockingConnection,
        channel: Any,
        since: datetime,
        on_message: Callable[[bytes, dict[str, Any]], bool],
        marker_body: Callable[[str], bytes],
        is_marker: Callable[[bytes], str | None],
        deadline: float,
        idle_s: float,
    ) -> ReadEnd:
        started = time.monotonic()
        progress = _Progress(last=started)
        token = uuid.uuid4().hex
        mark_by = started + max(idle_s, MARK_BY_S)

        def deliver(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            progress.tag = method.delivery_tag
            progress.last = time.monotonic()
            if progress.end is not None:
                return
            if is_marker(body) == token:
                progress.end = ReadEnd.END
            elif on_message(body, dict(props.headers or {})):
                progress.end = ReadEnd.FOUND

        channel.basic_qos(prefetch_count=self.credit)
        channel.basic_consume(self.stream, deliver, arguments={"x-stream-offset": since})
        marked = False
        while progress.end is None:
            now = time.monotonic()
            if now >= deadline:
                progress.end = ReadEnd.OUT_OF_TIME
                break
            if not marked and (now - progress.last >= idle_s or now >= mark_by):
                # Quiet for idle_s (or reading for MARK_BY_S) without what the caller
                # looks for: wherever this lands is the end of the stream for this look-up.
                publisher(self.urls, self.publish_timeout).publish(
                    self.exchange, self.routing_key, marker_body(token), message_id=token
                )
                marked = True
                continue
            wait = (
                deadline - now if marked else min(deadline, progress.last + idle_s, mark_by) - now
            )
            # Returns as soon as a delivery is there to hand over, or after ``wait``.
            connection.process_data_events(time_limit=max(0.0, wait))
            if progress.tag:
                channel.basic_ack(progress.tag, multiple=True)
                progress.tag = 0
        if progress.tag:
            channel.basic_ack(progress.tag, multiple=True)
        return progress.end


#: The most look-up connections waiting for :func:`_closer`.
MAX_CLOSING = 8
#: Look-up connections waiting to be closed by :func:`_closer`.
_to_close: queue.SimpleQueue[pika.BlockingConnection] = queue.SimpleQueue()
_closer_lock = threading.Lock()
_closer_thread: threading.Thread | None = None


def close_later(connection: pika.BlockingConnection) -> None:
    """Close a look-up's connection on a thread of its own: the answer is known by
    then, and a close waits for the broker to tear the stream consumer down (about
    3 ms of a 10 ms look-up, measured on one machine), which the caller need not.
    With ``MAX_CLOSING`` already waiting (a broker slow to close), the caller
    closes it itself, as before: look-ups never run ahead of their closes."""
    global _closer_thread
    if _to_close.qsize() >= MAX_CLOSING:
        with _stream_close_quiet():
            close_quietly(connection)
        return
    with _closer_lock:
        if _closer_thread is None or not _closer_thread.is_alive():
            _closer_thread = threading.Thread(
                target=_closer, name="deferred-results-closer", daemon=True
            )
            _closer_thread.start()
            atexit.register(_close_pending)
    _to_close.put(connection)


def _closer() -> None:
    while True:
        connection = _to_close.get()
        with _stream_close_quiet():
            close_quietly(connection)


def _close_pending() -> None:
    """At exit, close what the closer has not got to (a one-off command's look-up):
    the broker would log a connection closed without a word."""
    while True:
        try:
            connection = _to_close.get_nowait()
        except queue.Empty:
            return
        with _stream_close_quiet():
            close_quietly(connection)


def _stream_close_quiet() -> AbstractContextManager[None]:
    """At the close, pika rejects the deliveries still on their way to a consumer,
    and a stream refuses rejects by closing the connection, which pika logs as an
    ERROR: expected at the end of every read that stops before the stream's end."""
    return hide_pika_lines("pika.adapters.blocking_connection", "not supported by stream queues")


@dataclass
class _Progress:
    """Where one read stands, shared with its delivery callback."""

    #: When the last message was delivered (or the read began), time.monotonic().
    last: float
    #: How the read ended; ``None`` while it goes on.
    end: ReadEnd | None = None
    #: The last delivery tag not acked yet (the ack gives the consumer credit).
    tag: int = 0
