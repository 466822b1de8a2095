"""Recurring jobs: one worker plans each schedule's occurrences into the delay line.

No table and no extra process. Every worker runs a :class:`Scheduler`
thread, and the one that holds the lease (:class:`deferred.broker.Lease`: a
token in a single-active-consumer queue) is the scheduler. It defers each
coming occurrence like any other job, a little ahead of time
(``LOOKAHEAD``), with an id computed from the task and the instant
(:func:`deferred.core.schedule.occurrence_id`), and records how far each schedule
has been planned in the broker, in the ``PREFIX.schedules`` queue.

Why each occurrence runs once:

- Only the lease holder plans, and RabbitMQ gives the token to one consumer
  at a time. A lease holder that loses its connection loses the lease, and it
  writes its records over that same connection, so it cannot go on writing.
- An occurrence is published (confirmed) before the record that says it was
  planned. A scheduler killed between the two leaves the occurrence to its
  successor, which publishes it again: at most one occurrence per schedule
  and per kill runs twice, with the same id and ``occurrence``.
- The next scheduler starts from the record, so an occurrence is never lost:
  those that came due while nobody led follow the schedule's misfire policy
  (``coalesce`` by default: one run in their place).
- A changed schedule goes on from the last planned instant with its new
  rule, so nothing already planned is planned again; a schedule removed from
  the code is no longer planned (what was planned, at most ``LOOKAHEAD``
  ahead, still runs if its task still exists).

Commands (``deferred_schedules pause|resume|run``) are records in the same
queue; the scheduler applies them and folds them into its next record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.core import signing
from deferred.core.jobs import Job, utcnow
from deferred.core.schedule import MISFIRE_ALL_CAP, Schedule, occurrence_id
from deferred.core.topology import plan_topology
from deferred.producer.tasks import registered_tasks
from deferred.records.schedules import (
    PEEK_ATTEMPTS,
    PEEK_RETRY_S,
    Command,
    Entry,
    Records,
    read,
    scheduled_tasks,
    signed_bodies,
)

logger = logging.getLogger("deferred.scheduler")

#: How far ahead occurrences are planned: they then travel the delay line and
#: run on time, and a scheduler lost for less than this misses nothing.
LOOKAHEAD = timedelta(seconds=5)
#: How often the scheduler looks at its schedules.
TICK_S = 0.25
#: An occurrence due more than this long ago when it is planned was missed.
GRACE = timedelta(seconds=1)
#: The lease connection's heartbeat: how long a silently lost scheduler holds
#: the lease (RabbitMQ gives it away after two missed heartbeats).
HEARTBEAT_S = 5


@dataclass(frozen=True)
class Occurrence:
    """One run of a schedule to defer: its task, its instant, and when it may run."""

    task: str
    at: datetime
    #: ``at``, or now for an occurrence run late (a misfire) or on command.
    due: datetime
    id: str


def plan(
    records: Records,
    schedules: Mapping[str, Schedule],
    commands: list[Command],
    now: datetime,
    lookahead: timedelta = LOOKAHEAD,
) -> tuple[list[Occurrence], Records]:
    """What to defer now, and the record that follows: pure logic, the scheduler's core.

    ``records`` is left untouched. A schedule seen for the first time starts
    from ``now`` (nothing before it is owed).
    """
    entries = {name: Entry(**vars(e)) for name, e in records.entries.items()}
    out: list[Occurrence] = []
    for command in commands:
        entry = entries.setdefault(command.name, Entry(planned=now))
        if command.action == "pause":
            entry.paused = True
        elif command.action == "resume" and entry.paused:
            entry.paused = False
            entry.planned = max(entry.planned or now, now)
        elif command.action == "run" and command.name in schedules:
            # Its own id: a run on command is not one of the schedule's occurrences.
            out.append(Occurrence(command.name, command.at, now, command.id))
    # A schedule removed from the code is forgotten (added back, it starts afresh).
    for name in [n for n, e in entries.items() if n not in schedules and not e.paused]:
        del entries[name]
    for name, schedule in schedules.items():
        entry = entries.setdefault(name, Entry(planned=now, key=schedule.key))
        entry.key = schedule.key
        planned = entry.planned or now
        if entry.paused:
            entry.planned = max(planned, now)
            continue
        missed = schedule.between(planned, now - GRACE, MISFIRE_ALL_CAP + 1)
        if missed:
            if len(missed) > MISFIRE_ALL_CAP:
                # More than the cap: the last ones, which also ends on the latest.
                missed = schedule.between(
                    _back(schedule, now - GRACE, MISFIRE_ALL_CAP), now - GRACE, MISFIRE_ALL_CAP
                )
            kept = {"coalesce": missed[-1:], "skip": [], "all": missed}[schedule.misfire]
            for at in kept:
                out.append(Occurrence(name, at, now, occurrence_id(name, at)))
            planned = missed[-1]
        for at in schedule.between(planned, now + lookahead, 1000):
            out.append(Occurrence(name, at, at, occurrence_id(name, at)))
            planned = at
        entry.last = _last_due(schedule, entry, planned, now)
        entry.planned = planned
    return out, Records(seq=records.seq + 1, entries=entries, leader=records.leader, written=now)


def _last_due(
    schedule: Schedule, entry: Entry, planned: datetime, now: datetime
) -> datetime | None:
    """The latest occurrence planned so far whose time has come (for listings)."""
    end = min(planned, now)
    start = entry.last or (end - 2 * LOOKAHEAD)
    if end <= start:
        return entry.last
    passed = schedule.between(start, end, 10_000)
    return passed[-1] if passed else entry.last


def _back(schedule: Schedule, end: datetime, count: int) -> datetime:
    """An instant from which ``count`` occurrences reach ``end`` (or a little more)."""
    first = schedule.after(end - timedelta(days=1))
    step = max(schedule.after(first) - first, timedelta(milliseconds=1))
    return end - step * count


def occurrence_job(occurrence: Occurrence, settings: DeferredSettings) -> Job:
    task = registered_tasks().get(occurrence.task)
    queue = (task.target_queue if task else None) or settings.queues[0]
    return Job(
        id=occurrence.id,
        task=occurrence.task,
        args=(),
        kwargs={},
        due=occurrence.due,
        queue=queue,
        created=utcnow(),
        occurrence=occurrence.at,
        priority=task.priority if task else 0,
    )


class Scheduler:
    """The worker's scheduler thread: competes for the lease, and plans while it holds it."""

    def __init__(self, settings: DeferredSettings, worker_name: str) -> None:
        self.settings = settings
        self.worker_name = worker_name
        self.topology = plan_topology(settings)
        self.lease = broker.Lease(
            settings.broker_urls,
            self.topology.scheduler_queue.name,
            self.topology.schedules_queue.name,
            heartbeat_s=HEARTBEAT_S,
        )
        self.leading = threading.Event()
        #: The record this worker last wrote while leading: the authority while it
        #: holds the lease (a command peeking at the queue may hold the stored one).
        self._records: Records | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: set[str] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deferred-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Leave the lease (the next worker takes it at once) and end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        wait_s = 0.5
        while not self._stop.is_set():
            try:
                self.lease.connect()
                wait_s = 0.5
                while not self._stop.is_set():
                    if self.lease.poll(TICK_S):
                        if not self.leading.is_set():
                            logger.info("This worker now schedules the recurring jobs.")
                            self.leading.set()
                        self.tick()
            except broker.BrokerError as exc:
                if self.leading.is_set():
                    logger.warning("This worker no longer schedules: %s", exc)
                elif isinstance(exc, broker.TopologyNotDeclared):
                    logger.error("Recurring jobs cannot be scheduled: %s", exc)
                self.leading.clear()
                self._records = None
                self.lease.close()
                self._stop.wait(wait_s)
                wait_s = min(wait_s * 2, 10.0)
            except Exception:  # the scheduler must never take the worker down
                logger.exception("The scheduler failed; it starts again.")
                self.leading.clear()
                self._records = None
                self.lease.close()
                self._stop.wait(wait_s)
        # pika is not thread-safe: the lease is closed by the thread that uses it.
        self.lease.close()
        self.leading.clear()

    def _schedules(self) -> dict[str, Schedule]:
        """The schedules whose task this process knows (an unknown one is logged once)."""
        known = registered_tasks()
        schedules = scheduled_tasks(self.settings)
        for name in sorted(set(schedules) - set(known) - self._reported):
            logger.error(
                "DEFERRED['SCHEDULES'] names task %r, which is not registered: not scheduled.",
                name,
            )
            self._reported.add(name)
        return {name: s for name, s in schedules.items() if name in known}

    def tick(self) -> None:
        """Read the record, defer what is due, write the next record."""
        from deferred.producer.publishing import publish

        messages, done = self.lease.read_records()
        records, commands = read(signed_bodies(messages, self.settings))
        attempts = 1
        while not records.seq and self._records is None and attempts < PEEK_ATTEMPTS:
            # No record, and none written by this leader yet: a reader (the
            # status page, deferred_schedules) may hold it for a moment. Starting
            # from an empty record would plan again what was planned and lift
            # pauses, so it is read again before it is taken to be absent.
            done(False)
            self._stop.wait(PEEK_RETRY_S)
            messages, done = self.lease.read_records()
            records, commands = read(signed_bodies(messages, self.settings))
            attempts += 1
        if self._records is not None and self._records.seq > records.seq:
            records = self._records
        records.leader = self.worker_name
        occurrences, following = plan(records, self._schedules(), commands, utcnow())
        changed = bool(occurrences or commands) or following.entries != records.entries
        for occurrence in occurrences:
            job = occurrence_job(occurrence, self.settings)
            wait_ms = max(0, int((job.due - utcnow()).total_seconds() * 1000))
            publish(job, wait_ms, settings=self.settings)
        # One record and nothing else is the steady state: anything more (commands,
        # an older record, a message not signed) is replaced by the next record.
        write = changed or len(messages) != 1
        if write:
            body = following.encode()
            self.lease.write_record(body, signing.sign(body, self.settings.signing_keys))
            self._records = following
        # Acked only once their successor is confirmed; else handed back as they were.
        done(write)
