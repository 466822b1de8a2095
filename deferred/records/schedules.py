"""What the broker keeps of recurring jobs: the ``PREFIX.schedules`` record queue
(how far each schedule was planned, and the commands waiting for the scheduler),
and what ``deferred_schedules`` and the status page read of it.

The scheduler that plans occurrences and writes the records is the worker's
(:mod:`deferred.worker.scheduler`, where the guarantees are explained).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.core import signing
from deferred.core.jobs import utcnow
from deferred.core.schedule import Schedule
from deferred.core.topology import plan_topology
from deferred.producer.tasks import registered_tasks

logger = logging.getLogger("deferred.scheduler")

#: A reader of the record queue that finds no record reads it again this many
#: times, this far apart (the leader may be holding it for its tick, or a
#: reader for its read, when a new leader reads it first).
PEEK_ATTEMPTS = 5
PEEK_RETRY_S = 0.05


def scheduled_tasks(settings: DeferredSettings) -> dict[str, Schedule]:
    """Every schedule, by task name: ``@task(schedule=...)``, then DEFERRED['SCHEDULES'],
    which adds schedules to tasks of other apps and overrides the decorator's."""
    found = {name: t.schedule for name, t in registered_tasks().items() if t.schedule is not None}
    found.update(dict(settings.schedules))
    return found


@dataclass
class Entry:
    """What the records say of one schedule."""

    #: The last occurrence planned (UTC); ``None`` before the first.
    planned: datetime | None = None
    key: str = ""
    paused: bool = False
    #: The last occurrence that came due (planned, and its time passed).
    last: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "planned": None if self.planned is None else self.planned.isoformat(),
            "key": self.key,
            "paused": self.paused,
            "last": None if self.last is None else self.last.isoformat(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Entry:
        def moment(value: Any) -> datetime | None:
            return None if not value else datetime.fromisoformat(str(value))

        return cls(
            planned=moment(data.get("planned")),
            key=str(data.get("key", "")),
            paused=bool(data.get("paused", False)),
            last=moment(data.get("last")),
        )


@dataclass
class Records:
    """The scheduler's record: one entry per schedule, numbered so the newest wins."""

    seq: int = 0
    entries: dict[str, Entry] = field(default_factory=dict)
    leader: str | None = None
    written: datetime | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "type": "state",
                "seq": self.seq,
                "leader": self.leader,
                "written": None if self.written is None else self.written.isoformat(),
                "schedules": {name: e.to_dict() for name, e in self.entries.items()},
            }
        ).encode()


@dataclass(frozen=True)
class Command:
    """``pause``, ``resume`` or ``run`` (now, once) of one schedule."""

    action: str
    name: str
    id: str
    at: datetime

    def encode(self) -> bytes:
        return json.dumps(
            {"type": self.action, "name": self.name, "id": self.id, "at": self.at.isoformat()}
        ).encode()


COMMANDS = ("pause", "resume", "run")


def signed_bodies(
    messages: list[tuple[bytes, dict[str, Any]]], settings: DeferredSettings
) -> list[bytes]:
    """The bodies of the record queue's messages signed with one of our keys.

    A record or command anyone could write would pause, resume or run a
    schedule: with SIGNING on, the others are left out (and logged), and the
    scheduler's next record replaces them.
    """
    if not settings.signing:
        return [body for body, _headers in messages]
    kept = []
    for body, headers in messages:
        try:
            signing.verify(body, headers, settings.signing_keys)
        except signing.BadSignature as exc:
            logger.error("Ignoring a schedule record or command: %s.", exc)
            continue
        kept.append(body)
    return kept


def read(bodies: list[bytes]) -> tuple[Records, list[Command]]:
    """The newest record among ``bodies`` and the commands not yet applied, in order."""
    newest = Records()
    commands = []
    for body in bodies:
        try:
            data = json.loads(body)
            kind = data["type"]
            if kind == "state":
                if int(data["seq"]) >= newest.seq:
                    newest = Records(
                        seq=int(data["seq"]),
                        entries={
                            str(n): Entry.from_dict(e) for n, e in dict(data["schedules"]).items()
                        },
                        leader=data.get("leader"),
                        written=datetime.fromisoformat(data["written"])
                        if data.get("written")
                        else None,
                    )
            elif kind in COMMANDS:
                commands.append(
                    Command(
                        kind, str(data["name"]), str(data["id"]), datetime.fromisoformat(data["at"])
                    )
                )
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("Ignoring an unreadable schedule record (%s): %r", exc, body[:200])
    return newest, commands


# --------------------------------------------------------------------------- operating


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule as ``deferred_schedules`` and the status page show it."""

    name: str
    rule: str
    misfire: str
    paused: bool
    #: The next occurrence (``None`` while paused).
    next_run: datetime | None
    #: The latest occurrence whose time came, as the scheduler recorded it.
    last_run: datetime | None
    #: How far the scheduler has deferred occurrences already.
    planned_until: datetime | None
    #: Commands sent and not yet applied by a scheduling worker.
    waiting: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        def moment(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()

        return {
            "name": self.name,
            "rule": self.rule,
            "misfire": self.misfire,
            "paused": self.paused,
            "next_run": moment(self.next_run),
            "last_run": moment(self.last_run),
            "planned_until": moment(self.planned_until),
            "waiting_commands": list(self.waiting),
        }


@dataclass(frozen=True)
class Overview:
    schedules: list[ScheduleInfo]
    #: The worker that wrote the latest record (the one scheduling, unless it stopped since).
    leader: str | None
    written: datetime | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "leader": self.leader,
            "record_written": None if self.written is None else self.written.isoformat(),
            # The worker scheduling is the same for all; repeated for readers of one entry.
            "schedules": [{**s.to_dict(), "leader": self.leader} for s in self.schedules],
        }


def overview(settings: DeferredSettings, now: datetime | None = None) -> Overview:
    """Every schedule of this code base, with what the broker's record says of it."""
    topology = plan_topology(settings)
    return read_overview(
        lambda: broker.peek(
            settings.broker_urls, topology.schedules_queue.name, timeout=settings.publish_timeout_s
        ),
        settings,
        now,
    )


def read_overview(
    peek: Callable[[], list[tuple[bytes, dict[str, Any]]]],
    settings: DeferredSettings,
    now: datetime | None = None,
) -> Overview:
    """:func:`overview_of` the record queue as ``peek`` reads it, read again while it
    shows no record.

    The leader holds the record (unacked) for the few milliseconds of each
    tick, every ``TICK_S`` (:mod:`deferred.worker.scheduler`): a reader that
    comes then finds the queue empty, and would show every schedule as never
    planned and none paused. A queue that stays empty across the retries has
    no record yet.
    """
    for attempt in range(PEEK_ATTEMPTS):
        bodies = signed_bodies(peek(), settings)
        if read(bodies)[0].seq or attempt == PEEK_ATTEMPTS - 1:
            break
        time.sleep(PEEK_RETRY_S)
    return overview_of(bodies, settings, now or utcnow())


def overview_of(bodies: list[bytes], settings: DeferredSettings, now: datetime) -> Overview:
    """:func:`overview` from the record queue's messages, already read."""
    records, commands = read(bodies)
    found = []
    for name, schedule in sorted(scheduled_tasks(settings).items()):
        entry = records.entries.get(name, Entry())
        waiting = tuple(c.action for c in commands if c.name == name)
        paused = entry.paused
        for action in waiting:
            paused = {"pause": True, "resume": False}.get(action, paused)
        found.append(
            ScheduleInfo(
                name=name,
                rule=schedule.describe(),
                misfire=schedule.misfire,
                paused=paused,
                next_run=None if paused else schedule.after(now),
                last_run=entry.last,
                planned_until=entry.planned,
                waiting=waiting,
            )
        )
    return Overview(found, records.leader, records.written)


def send_command(settings: DeferredSettings, action: str, name: str) -> Command:
    """Ask the scheduling worker to ``pause``, ``resume`` or ``run`` (now, once) ``name``.

    The command is a durable record in the broker: a worker applies it when
    it next schedules, so it survives restarts of everything. ``LookupError``
    for a name that is not a schedule of this code base.
    """
    if action not in COMMANDS:
        raise ValueError(f"Unknown schedule command {action!r}: one of {', '.join(COMMANDS)}.")
    known = scheduled_tasks(settings)
    if name not in known:
        shown = ", ".join(sorted(known)) or "none"
        raise LookupError(f"No schedule named {name!r} (schedules: {shown}).")
    command = Command(action, name, uuid.uuid4().hex, utcnow())
    topology = plan_topology(settings)
    body = command.encode()
    broker.send_record(
        settings.broker_urls,
        topology.schedules_queue.name,
        body,
        settings.publish_timeout_s,
        signing.sign(body, settings.signing_keys),
    )
    return command
