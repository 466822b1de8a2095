"""The keeper: after a broker restart, one worker publishes again what it may have lost.

Every worker runs a :class:`Keeper` thread; the one holding the lease (a
token in ``PREFIX.keeper``, as for the scheduler) keeps the ledger
(:mod:`deferred.core.ledger`):

- **Restarts.** ``PREFIX.up`` holds one transient message while the broker
  runs; a restart drops it. The keeper looks each time it (re)connects: a
  missing message means the broker restarted. The window of the restart runs
  from when the keeper lost its connection (or, for a keeper that did not see
  the broker go, its last "up at" marker in the ledger) to a few seconds after
  it found the message missing. Every job with a hop in that window
  (:func:`deferred.core.ledger.to_repair`) may have been dropped:

  - one due within :data:`NEAR_MS` is checked once it has been due
    :data:`CHECK_AFTER_MS` (the backlog the restart left): one read of the
    results stream tells which of the jobs due by then started, and each that
    did not is published again, due now. A restart moves thousands of jobs and loses a
    handful; checking them in one read, rather than each copy on its own in a
    worker, is what keeps a restart from flooding the workers with copies.
  - one due later is published again at once, as a copy
    (``x-deferred-copy: restart``) due a second after the job, which the worker
    that takes it runs only if no worker started that attempt
    (:mod:`deferred.worker.pipeline`).

  Either way a copy reaches the ready queue behind its job, if the job survived:
  by the time a worker takes the copy, the job has been handed out, and the
  worker's look-up (half a second after it took the copy) finds it started.
  While a ready queue holds a backlog the checks wait (up to
  :data:`MAX_POSTPONE_MS`): a job still waiting there would read as lost.
- **"Up at" markers**, every :data:`ALIVE_EVERY_S`, in the ledger: where a
  restart window starts when no keeper saw the broker go.
- **Checkpoints**, every :data:`CHECKPOINT_EVERY_S` or so, in a process of their
  own (:mod:`deferred.core.ledger_index`, :mod:`deferred.worker.checkpointing`):
  the pending jobs, sorted by due time, for listings to read without the whole
  ledger. A checkpoint that took ``d``
  seconds waits ``CHECKPOINT_COST_FACTOR * d`` before the next one, so that a
  worker spends a bounded share of its time on them with many jobs pending.
- **Carrying records forward**, every :data:`CARRY_EVERY_S`: the record of a
  job still pending is written again before the stream's retention drops it.

A keeper killed during a repair leaves it to the next one only if that one
sees the restart too, which it does: the "up" message is put back after the
repair, not before. Two repairs of one restart (a keeper that lost its lease
half-way) publish copies twice; each runs at most once.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from deferred import broker
from deferred.broker.ledger import EXCHANGE, PRIORITY, ROUTING_KEY
from deferred.conf import DeferredSettings
from deferred.core import ledger, notices
from deferred.core.ledger_index import Head
from deferred.core.topology import LEDGER_CHECKPOINTS_KEEP_MS, LEDGER_KEEP_MS, Plan, plan_topology
from deferred.worker import checkpointing

logger = logging.getLogger("deferred.keeper")

#: How often the lease holder writes its "up at" marker.
ALIVE_EVERY_S = 5.0
#: How often it carries the records of pending jobs forward (deferred.core.ledger, where
#: deferred.records.pending reads it too).
CARRY_EVERY_S = ledger.CARRY_EVERY_S
#: How often the keeper writes a checkpoint of the pending jobs, at most; the first
#: one half a minute after it takes the lease (a worker restarted finds the last
#: keeper's checkpoint, and a topology's first minute has little to fold).
CHECKPOINT_EVERY_S = 60.0
CHECKPOINT_FIRST_S = 30.0
#: A checkpoint that took d seconds of CPU is followed by the next one no sooner than
#: this many times d later: at most a tenth of a core.
CHECKPOINT_COST_FACTOR = 10.0
#: How long one checkpoint may take.
CHECKPOINT_TIMEOUT_S = 600.0
#: A restart window starts this long before the connection was lost: the broker
#: may stop its queues a moment before it closes the connections.
BEFORE_MS = 5_000
#: ... and ends this long after the keeper found the restart: RabbitMQ takes
#: connections once its queues are recovered, and this covers the clocks of
#: the hosts disagreeing a little.
AFTER_MS = 5_000
#: The longest wait between two attempts to reconnect: the restart window ends
#: when the keeper is back, so it does not wait long.
RECONNECT_MAX_S = 2.0
#: A job of a repair due sooner than this is checked against the results once it
#: is due, and published again only if it never started; one due later is published
#: again at once, and its copy is checked by the worker that takes it.
NEAR_MS = 60_000
#: How long after its job a copy published at once is due: it reaches the ready queue
#: behind the job, if that survived, so the worker finds the job run.
FAR_COPY_LAG_MS = 1_000
#: How long after a job due soon is due it is checked: time for a job that survived
#: to start, through the backlog of what came due while the broker was down.
CHECK_AFTER_MS = 10_000
#: The most messages the ready queues may hold for a check to go ahead, how often
#: checks are made (a read of the results each), and how long a job may wait to be
#: called lost while a backlog holds it up.
BACKLOG_LIMIT = 50
BACKLOG_EVERY_S = 5.0
MAX_POSTPONE_MS = 300_000
#: How long reading the whole ledger may take.
READ_TIMEOUT_S = ledger.READ_TIMEOUT_S
#: How long a stopping worker waits for the keeper thread (a daemon: it ends with
#: the process anyway).
STOP_WAIT_S = 2.0
#: The lease connection's heartbeat: a keeper that stops answering loses the lease.
HEARTBEAT_S = 10
#: When a carried record was written (ms).
WRITTEN_HEADER = "x-deferred-written"
#: Headers of a ledger record not to publish again: the stream's own, what
#: :func:`deferred.broker.ledger.read_stream` adds, and a keyed job's ``BCC``
#: (the cancels stream already has that record).
_NOT_COPIED = (
    "x-stream-offset",
    "BCC",
    ROUTING_KEY,
    EXCHANGE,
    PRIORITY,
    ledger.KEY_HEADER,
    ledger.EXCHANGE_HEADER,
    WRITTEN_HEADER,
)


def entry_of(offset: int, body: bytes, headers: dict[str, Any]) -> ledger.Entry | None:
    """The ledger entry a stream message is, or ``None`` (a marker, or not a job)."""
    from deferred.core.jobs import Job

    routing_key = headers.get(ledger.KEY_HEADER) or headers.get(ROUTING_KEY)
    exchange = headers.get(ledger.EXCHANGE_HEADER) or headers.get(EXCHANGE)
    if not isinstance(routing_key, str) or not isinstance(exchange, str):
        return None
    try:
        job = Job.decode(body)
    except Exception:  # noqa: BLE001 - whatever is not a job is not repaired
        return None
    written = headers.get(WRITTEN_HEADER)
    priority = headers.get(PRIORITY)
    return ledger.Entry(
        job_id=job.id,
        due_ms=_ms(job.due),
        routing_key=routing_key,
        exchange=exchange,
        body=body,
        headers={k: v for k, v in headers.items() if k not in _NOT_COPIED},
        priority=priority if isinstance(priority, int) else None,
        # A record as published was written when its job was made (or retried
        # later, which only makes it carried sooner).
        written_ms=written if isinstance(written, int) else _ms(job.created),
        offset=offset,
    )


@functools.lru_cache(maxsize=64)
def _shape(exchange: str) -> ledger.Shape | None:
    return ledger.shape_of(exchange)


def _no_hop(headers: dict[str, Any]) -> bool:
    """Whether a ledger record is of a job that went straight to its ready or hold queue."""
    routing_key = headers.get(ledger.KEY_HEADER) or headers.get(ROUTING_KEY)
    exchange = headers.get(ledger.EXCHANGE_HEADER) or headers.get(EXCHANGE)
    if not isinstance(routing_key, str) or not isinstance(exchange, str):
        return False
    shape = _shape(exchange)
    return shape is not None and ledger.makes_no_hop(shape, routing_key)


def _attempt(entry: ledger.Entry) -> int:
    from deferred.core.jobs import Job

    return Job.decode(entry.body).attempt


def _ms(moment: datetime) -> int:
    return math.floor(moment.timestamp() * 1000)


class Stopping(Exception):
    """The worker stops: a long read or repair ends where it is."""


@dataclass
class Repair:
    """A restart's repair under way: the jobs due soon, each checked once it has been
    due ``CHECK_AFTER_MS``, the last of them at ``check_at_ms``."""

    since_ms: int
    until_ms: int
    near: list[ledger.Entry]
    check_at_ms: int
    #: Copies published when it began (the jobs due later).
    published: int = 0
    #: Copies published since, of jobs due soon that never started.
    copies: int = 0
    #: When it began: the broker was back then (ms).
    begun_ms: int = 0
    #: (due, id, attempt) of every job due around ``near``, the at-risk ones included.
    around: list[tuple[int, str, int]] = field(default_factory=list)


class Keeper:
    """The worker's keeper thread: competes for the lease, keeps the ledger while it leads."""

    def __init__(
        self,
        settings: DeferredSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.plan: Plan = plan_topology(settings)
        assert self.plan.ledger_queue and self.plan.keeper_queue and self.plan.up_queue
        self.link = broker.KeeperLink(
            settings.broker_urls,
            self.plan.keeper_queue.name,
            self.plan.ledger_queue.name,
            self.plan.up_queue.name,
            heartbeat_s=HEARTBEAT_S,
        )
        self.clock = clock
        self.leading = threading.Event()
        #: Set after each repair (tests and the bench wait on it).
        self.repaired = threading.Event()
        #: How many copies the last repair published.
        self.last_repair = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: When this keeper's lease connection was lost (ms), if it was.
        self._lost_ms: int | None = None
        self._checked = False
        #: Repairs begun and not yet finished (their jobs due soon are checked later).
        self._repairs: list[Repair] = []
        #: Whether the "up" message is to be put back once they are finished.
        self._up_missing = False
        #: How long after the last of a repair's jobs due soon the results are read.
        self.check_after_ms = CHECK_AFTER_MS
        self._next_alive = 0.0
        self._next_backlog_look = 0.0
        self._next_carry = 0.0
        self._next_checkpoint = 0.0
        self._checkpointing: threading.Thread | None = None
        #: The last two checkpoints this keeper wrote (the pace of the next one's reads).
        self._heads: tuple[Head | None, Head | None] = (None, None)
        #: Set after each checkpoint written (tests and the bench wait on it).
        self.checkpointed = threading.Event()
        #: Off when the worker must end at once (a job given up at its hard time limit).
        self.wait_on_stop = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deferred-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread; a repair under way ends with it, for the next keeper to do
        again (the "up" message is put back only once a repair is done). The thread
        is waited for a moment, unless :attr:`wait_on_stop` is off (it is a daemon:
        the process may end without it)."""
        self._stop.set()
        if self.wait_on_stop and self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_S)

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _run(self) -> None:
        wait_s = 0.5
        while not self._stop.is_set():
            try:
                self.link.connect()
                wait_s = 0.5
                self._checked = False
                while not self._stop.is_set():
                    if self.link.poll(0.5):
                        if not self.leading.is_set():
                            logger.info("This worker now keeps the ledger.")
                            self.leading.set()
                        self.tick()
            except Stopping:
                break
            except broker.BrokerError as exc:
                if self._lost_ms is None and self.link.node is not None:
                    self._lost_ms = self._now_ms()
                if isinstance(exc, broker.TopologyNotDeclared):
                    notices.topology_missing(exc)
                elif self.leading.is_set():
                    logger.info("This worker no longer keeps the ledger: %s", exc)
                self.leading.clear()
                self.link.close()
                self._stop.wait(wait_s)
                wait_s = min(wait_s * 2, RECONNECT_MAX_S)
            except Exception:  # the keeper must never take the worker down
                logger.exception("The keeper failed; it starts again.")
                self.leading.clear()
                self.link.close()
                self._stop.wait(wait_s)
        self.link.close()
        self.leading.clear()

    def tick(self) -> None:
        """One turn of the lease holder: the restart check once per connection, the
        repairs whose time has come, the marker and the carrying when due."""
        if not self._checked:
            if self.link.up_missing():
                self._up_missing = True
                self._repairs.append(
                    self.begin_repair(self._window_start(), self._now_ms() + AFTER_MS)
                )
            self._checked = True
            self._lost_ms = None
        if self._repairs and self._may_check():
            for repair in list(self._repairs):
                # Not until CHECK_AFTER_MS after the broker was back: jobs that ran as it
                # went have their records written by then (their writers try every
                # second). Then each job once it has been due CHECK_AFTER_MS: the lost
                # ones run that late, not as late as the last job of the window.
                if self._now_ms() < repair.begun_ms + self.check_after_ms:
                    continue
                self.check_repair(repair, until_ms=self._now_ms() - self.check_after_ms)
                if not repair.near:
                    self._repairs.remove(repair)
        if self._up_missing and not self._repairs:
            # Only now: a keeper lost before this finds it missing and repairs again.
            self.link.mark_up()
            self._up_missing = False
        now = time.monotonic()
        if now >= self._next_alive:
            headers: dict[str, Any] = {ledger.ALIVE_HEADER: self._now_ms()}
            if self._repairs:
                # A keeper that takes over before these are done starts from here.
                headers[ledger.UNSETTLED_HEADER] = min(r.since_ms for r in self._repairs)
            self.link.write_record(b"", headers)
            self._next_alive = now + ALIVE_EVERY_S
        if now >= self._next_carry:
            if self._next_carry:
                self.carry()
            self._next_carry = now + CARRY_EVERY_S
        if not self._next_checkpoint:
            self._next_checkpoint = now + CHECKPOINT_FIRST_S
        elif now >= self._next_checkpoint and self._checkpointing is None:
            # Waited on in a thread: a checkpoint of many jobs takes longer than the
            # lease's heartbeats may wait.
            self._checkpointing = threading.Thread(
                target=self._checkpoint, name="deferred-checkpoint", daemon=True
            )
            self._next_checkpoint = float("inf")
            self._checkpointing.start()

    def _checkpoint(self) -> None:
        started = time.monotonic()
        took: float | None = None
        try:
            written = checkpointing.write_aside(
                self.settings,
                timeout=CHECKPOINT_TIMEOUT_S,
                per_s=checkpointing.read_rate(self._heads[0], self._heads[1]),
                stop=self._stop,
            )
            self._heads = (self._heads[1], written.head)
            # Its cost is the CPU it took: its reads are paced, and wait.
            took = written.cpu_s
            self.checkpointed.set()
        except (broker.BrokerError, checkpointing.CheckpointFailed) as exc:
            if self._stop.is_set():  # stopping: its process went with the worker
                logger.debug("The ledger's checkpoint was cut short: %s", exc)
            else:
                logger.warning("Could not write the ledger's checkpoint: %s", exc)
        except Exception:  # the keeper must never take the worker down
            logger.exception("Could not write the ledger's checkpoint.")
        if took is None:
            took = time.monotonic() - started
        # Never so late that the newest checkpoint's pages are past their retention.
        self._next_checkpoint = time.monotonic() + min(
            max(CHECKPOINT_EVERY_S, CHECKPOINT_COST_FACTOR * took),
            LEDGER_CHECKPOINTS_KEEP_MS / 1000 / 4,
        )
        self._checkpointing = None

    def _may_check(self) -> bool:
        """Whether the jobs due by now may be checked: not while a ready queue holds a
        backlog, where a job that survived may still wait its turn (a copy published
        then would be checked by a worker, one look-up each, and under load those
        look-ups would feed the backlog). Past :data:`MAX_POSTPONE_MS` they are
        checked anyway: a copy waits behind its job in the queue, so it finds it run."""
        now = time.monotonic()
        if now < self._next_backlog_look:
            return False
        self._next_backlog_look = now + BACKLOG_EVERY_S
        oldest = min((e.due_ms for r in self._repairs for e in r.near), default=None)
        if oldest is not None and self._now_ms() - oldest > MAX_POSTPONE_MS:
            return True
        queues = [q.name for q in self.plan.ready_queues.values()]
        return self.link.backlog(queues) <= BACKLOG_LIMIT

    def _window_start(self) -> int | None:
        """When the restart window starts: this keeper's lost connection, or
        ``None`` to take the last "up at" marker from the ledger."""
        return None if self._lost_ms is None else self._lost_ms - BEFORE_MS

    def read(self, *, token: str) -> tuple[list[ledger.Entry], list[ledger.Marker]]:
        """Every job record and "up at" marker in the ledger, up to the marker ``token``
        this keeper just wrote."""
        assert self.plan.ledger_queue is not None
        entries: list[ledger.Entry] = []
        markers: list[ledger.Marker] = []
        now_ms = self._now_ms()

        def take(offset: int, body: bytes, headers: dict[str, Any]) -> bool:
            if self._stop.is_set():
                raise Stopping
            alive = headers.get(ledger.ALIVE_HEADER)
            if isinstance(alive, int):
                if headers.get("x-deferred-token") == token:
                    return True
                unsettled = headers.get(ledger.UNSETTLED_HEADER)
                markers.append(
                    ledger.Marker(alive, unsettled if isinstance(unsettled, int) else None)
                )
                return False
            if _no_hop(headers):
                return False  # due at once: nothing to repair, nothing to carry
            entry = entry_of(offset, body, headers)
            if entry is not None:
                entries.append(entry)
            return False

        self.link.write_record(b"", {ledger.ALIVE_HEADER: now_ms, "x-deferred-token": token})
        broker.read_stream(
            self.settings.broker_urls, self.plan.ledger_queue.name, take, timeout=READ_TIMEOUT_S
        )
        return entries, markers

    def repair(self, since_ms: int | None, until_ms: int) -> int:
        """:meth:`begin_repair`, then :meth:`finish_repair` once it may: the whole repair
        in one call (a test's, or a command's); the number of copies published."""
        repair = self.begin_repair(since_ms, until_ms)
        while self._now_ms() < repair.check_at_ms and not self._stop.is_set():
            time.sleep(0.1)
        self.finish_repair(repair)
        return repair.published + repair.copies

    def begin_repair(self, since_ms: int | None, until_ms: int) -> Repair:
        """Find the jobs with a hop between ``since_ms`` (``None``: the last "up at"
        marker) and ``until_ms``: publish a copy of each one due later than
        :data:`NEAR_MS` at once, and keep the others to check in :meth:`finish_repair`."""
        entries, markers = self.read(token=uuid.uuid4().hex)
        if since_ms is None:
            since_ms = ledger.window_start(markers, self._now_ms(), BEFORE_MS)
        found = [e for e in ledger.to_repair(entries, since_ms, until_ms) if self._copyable(e)]
        now_ms = self._now_ms()
        near = [e for e in found if e.due_ms <= now_ms + NEAR_MS]
        # Every job due around the near ones, at risk or not: their progress tells a job
        # late in a backlog from one that is gone (ledger.overtaken).
        around = sorted(
            (e.due_ms, e.job_id, _attempt(e))
            for e in ledger.latest(entries).values()
            if since_ms - BEFORE_MS <= e.due_ms <= now_ms + NEAR_MS + 2 * BEFORE_MS
            and self._copyable(e)
        )
        far = [e for e in found if e.due_ms > now_ms + NEAR_MS]
        for entry in far:
            if self._stop.is_set():
                raise Stopping
            self._publish_copy(entry, entry.due_ms - now_ms + FAR_COPY_LAG_MS)
        check_at = max((e.due_ms for e in near), default=now_ms) + self.check_after_ms
        if not found:
            # A topology's first worker finds no "up" message either: not worth a warning.
            logger.info(
                "The broker started or restarted since %s: no job was moving between delay "
                "queues then.",
                _iso(since_ms) if since_ms > 0 else "this topology's ledger began",
            )
        else:
            logger.warning(
                "The broker restarted (between %s and %s): %d job%s may have been moving between "
                "delay queues then. %d due later than %d s published again, to run once; the %d "
                "due sooner are checked against the results as they come due, the last at %s.",
                _iso(since_ms) if since_ms > 0 else "the ledger's start",
                _iso(until_ms),
                len(found),
                "" if len(found) == 1 else "s",
                len(far),
                NEAR_MS // 1000,
                len(near),
                _iso(check_at),
            )
        return Repair(
            since_ms,
            until_ms,
            near,
            max(check_at, now_ms + self.check_after_ms),
            published=len(far),
            begun_ms=now_ms,
            around=around,
        )

    def finish_repair(self, repair: Repair) -> int:
        """Check every job of ``repair.near`` now (see :meth:`check_repair`)."""
        return self.check_repair(repair, until_ms=None)

    def check_repair(self, repair: Repair, until_ms: int | None) -> int:
        """Publish again, due now, each job of ``repair.near`` due by ``until_ms``
        (``None``: all of them) whose attempt no worker started: it was lost. One read
        of the results stream for all of them; they leave ``repair.near``."""
        from deferred.core.jobs import Job
        from deferred.records.results import started_attempts

        batch = [e for e in repair.near if until_ms is None or e.due_ms <= until_ms]
        if not batch:
            if not repair.near:
                self._done(repair)
            return 0
        earliest = min(e.due_ms for e in batch) - BEFORE_MS
        started = started_attempts(
            self.settings, datetime.fromtimestamp(earliest / 1000, UTC), timeout=READ_TIMEOUT_S
        )
        now_ms = self._now_ms()
        others = [
            (due, started.get(job_id, 0) >= attempt) for due, job_id, attempt in repair.around
        ]
        lost, waiting = [], []
        for entry in batch:
            if started.get(entry.job_id, 0) >= Job.decode(entry.body).attempt:
                continue
            passed = ledger.overtaken(entry.due_ms, others)
            if passed is False and now_ms - entry.due_ms < MAX_POSTPONE_MS:
                waiting.append(entry)  # the jobs after it have not started either: a backlog
            else:
                lost.append(entry)
        for entry in lost:
            if self._stop.is_set():
                raise Stopping
            self._publish_copy(entry, 0)
        taken = {id(e) for e in batch} - {id(e) for e in waiting}
        repair.near = [e for e in repair.near if id(e) not in taken]
        repair.copies += len(lost)
        if lost:
            logger.warning(
                "%d job%s due by %s never started after the broker restart: published again.",
                len(lost),
                "" if len(lost) == 1 else "s",
                _iso(max(e.due_ms for e in batch)),
            )
        if not repair.near:
            self._done(repair)
        return len(lost)

    def _done(self, repair: Repair) -> None:
        total = repair.published + repair.copies
        logger.info(
            "The repair of the restart between %s and %s is done: %d job%s published again.",
            _iso(repair.since_ms) if repair.since_ms > 0 else "the ledger's start",
            _iso(repair.until_ms),
            total,
            "" if total == 1 else "s",
        )
        self.last_repair = total
        self.repaired.set()

    def _publish_copy(self, entry: ledger.Entry, wait_ms: int) -> None:
        broker.publisher_for(self.settings).publish(
            self.plan.ingest_exchange,
            self.plan.routing_key(max(0, wait_ms), entry.queue),
            entry.body,
            message_id=entry.job_id,
            headers={**entry.headers, broker.COPY_HEADER: broker.RESTART_COPY},
            priority=entry.priority,
        )

    def _copyable(self, entry: ledger.Entry) -> bool:
        """Whether a copy of ``entry`` would run only if the job did not: a worker
        tells by the job's results, so not for a job that keeps none (``RESULTS``
        off, ``@task(result=False)``), which would run twice after every restart."""
        from deferred.core.jobs import Job
        from deferred.records.recording import keeps_result

        return self.settings.results and keeps_result(Job.decode(entry.body))

    def carry(self) -> int:
        """Write again the records of pending jobs the stream would soon drop."""
        entries, _ = self.read(token=uuid.uuid4().hex)
        carried = 0
        for entry in ledger.to_carry(entries, self._now_ms(), LEDGER_KEEP_MS):
            headers = {
                **entry.headers,
                ledger.KEY_HEADER: entry.routing_key,
                ledger.EXCHANGE_HEADER: entry.exchange,
                WRITTEN_HEADER: self._now_ms(),
            }
            self.link.write_record(
                entry.body, headers, priority=entry.priority, message_id=entry.job_id
            )
            carried += 1
        if carried:
            logger.info("Carried %d pending job records forward in the ledger.", carried)
        return carried


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
