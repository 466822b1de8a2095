"""A job as it travels through the broker: a small, versioned JSON document.

JSON rather than pickle: a message is data, never code, and a job deferred
by one release of an application can be read by the next one. The ``version``
field lets a later format be introduced without breaking jobs still waiting.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from deferred.core.priorities import level

FORMAT_VERSION = 1

#: Failure reason (``BrokenMessage.reason``): the body is not a JSON object at all.
UNDECODABLE = "undecodable"
#: Failure reason: the body is JSON, but not a job of a format this version knows.
INVALID = "invalid"


class BrokenMessage(ValueError):
    """A message body that is not a job this version can run.

    ``reason`` is ``"undecodable"`` (not a JSON object at all) or ``"invalid"``
    (JSON, but not a job of a format this version knows).
    """

    def __init__(self, message: str, reason: str = INVALID) -> None:
        super().__init__(message)
        self.reason = reason


_MS_MASK = (1 << 48) - 1
#: Version 8 (RFC 9562's own layout): due time, enqueue delay, random bits.
#: Version 7: due time and random bits (ids made before the delay was carried,
#: and the deterministic ids of a schedule's runs).
_ID_RE = re.compile(r"^[0-9a-f]{12}[78][0-9a-f]{3}[89ab][0-9a-f]{15}$")
#: Bits of a version 8 id that carry the delay from enqueue to due, log scale:
#: the code is ``ceil(log2(delay_ms + 1) * _DELAY_STEPS)``, so the delay reads
#: back within 0.0043 % (22 minutes of a year), enough to find the job's
#: ledger record by time; 20 of the 74 random bits, 54 stay random.
_DELAY_BITS = 20
_DELAY_STEPS = 1 << 14
_RANDOM_BITS = 74 - _DELAY_BITS


def new_job_id(due: datetime | None = None, *, now: datetime | None = None) -> str:
    """A new job id: 32 hex digits, laid out as a UUID (version 8) whose first 48 bits are
    the job's first due time, as a UUIDv7's are its creation time.

    A cancel names a job by its id alone: reading the due time from the id
    tells every worker how long the cancel must be kept (until the job has
    come due), with no table to look it up in. The next 20 bits say, on a log
    scale, how long before its due time the job was made (``now``, default
    the current time): where its record is in the ledger stream, so that
    any process can find a job that has not started (:mod:`deferred.records.pending`).
    The other 54 bits are random. Ids of jobs sort by due time, which also
    reads well in logs.
    """
    made = now or utcnow()
    due = due or made
    wait_ms = max(0, math.floor((due - made).total_seconds() * 1000))
    rand = (_delay_code(wait_ms) << _RANDOM_BITS) | secrets.randbits(_RANDOM_BITS)
    return _layout(due, rand, version=8)


def id_with_due(due: datetime, seed: bytes) -> str:
    """A deterministic job id for ``due``: :func:`new_job_id`'s time layout (version 7,
    no delay: every process makes it at another moment), hashed from ``seed``.

    For jobs that must carry the same id in every process that makes them
    (the runs of a schedule).
    """
    return _layout(due, int.from_bytes(hashlib.sha256(seed).digest()[:10]) >> 6, version=7)


def _layout(due: datetime, rand74: int, *, version: int) -> str:
    ms = math.floor(due.timestamp() * 1000) & _MS_MASK
    high, low = rand74 >> 62, rand74 & ((1 << 62) - 1)
    return f"{(ms << 80) | (version << 76) | (high << 64) | (0b10 << 62) | low:032x}"


def _delay_code(wait_ms: int) -> int:
    if wait_ms <= 0:
        return 0
    return min((1 << _DELAY_BITS) - 1, math.ceil(math.log2(wait_ms + 1) * _DELAY_STEPS))


def _delay_bounds(code: int) -> tuple[int, int]:
    """The delays (ms) a code stands for: ``code - 1 < log2(d + 1) * steps <= code``,
    widened by a millisecond each way against float rounding."""
    if code == 0:
        return 0, 0
    lo = 2 ** ((code - 1) / _DELAY_STEPS) - 1
    hi = 2 ** (code / _DELAY_STEPS) - 1
    return max(0, math.floor(lo) - 1), math.ceil(hi) + 1


def made_ms_of(job_id: str) -> tuple[int, int] | None:
    """When the job of ``job_id`` was made (``defer()``, ``enqueue()``), as the earliest
    and latest millisecond since the epoch its id allows; ``None`` for an id that does
    not say (version 7, or not one of ours). The window is a few milliseconds wide
    for a job due within a second, 22 minutes for one due in a year."""
    if not isinstance(job_id, str) or not _ID_RE.match(job_id) or job_id[12] != "8":
        return None
    value = int(job_id, 16)
    rand_a = (value >> 64) & 0xFFF
    rand_b = value & ((1 << 62) - 1)
    code = (rand_a << (_DELAY_BITS - 12)) | (rand_b >> (62 - (_DELAY_BITS - 12)))
    due = value >> 80
    lo, hi = _delay_bounds(code)
    return due - hi, due - lo


_ANY_ID_RE = re.compile(
    r"^(?:[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$"
)


def looks_like_id(value: object) -> bool:
    """Whether ``value`` has the shape of a job id (this version's, or an earlier UUID)."""
    return isinstance(value, str) and bool(_ANY_ID_RE.match(value))


def due_of(job_id: str) -> datetime | None:
    """The first due time a job id carries (to the millisecond, rounded down);
    ``None`` for a string that is not an id this library makes."""
    ms = due_ms_of(job_id)
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


def due_ms_of(job_id: str) -> int | None:
    """:func:`due_of` in milliseconds since the epoch, without making a datetime (the
    results recorder asks for it twice a job)."""
    if not isinstance(job_id, str) or not _ID_RE.match(job_id):
        return None
    return int(job_id[:12], 16)


def body_level(body: bytes) -> int | None:
    """The AMQP priority of the job ``body`` holds, for a copy of a message that must keep
    its place among due jobs; ``None`` for a body that is no job."""
    try:
        return level(Job.decode(body).priority)
    except BrokenMessage:
        return None


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Job:
    id: str
    task: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: The moment before which the job must not run (UTC).
    due: datetime
    queue: str
    #: 1 on the first run.
    attempt: int = 1
    created: datetime = field(default_factory=utcnow)
    #: When the first attempt was due (retries move ``due``); ``None``: ``due``.
    first_due_at: datetime | None = None
    #: The ``TASKS`` alias of the django.tasks backend that enqueued it; ``None``
    #: for a ``@deferred.task`` (``task`` is then a registered name, else a
    #: django.tasks module path).
    backend: str | None = None
    #: The workers that ran the earlier attempts (django.tasks counts attempts by them).
    workers: tuple[str, ...] = ()
    #: For a run of a schedule: the occurrence's scheduled instant (UTC), the same
    #: on every run of it; ``None`` for a job deferred by hand.
    occurrence: datetime | None = None
    #: -100 to 100, higher runs first among due jobs (``deferred.core.priorities``).
    priority: int = 0
    #: The debounce key (``deferred.core.keys``): only the latest job deferred with it runs.
    key: str | None = None
    #: Set on a job that ``run_now()`` or ``reschedule()`` published again under its id
    #: (``deferred.core.moves``): only the copy of the latest move runs.
    gen: str | None = None

    @property
    def first_due(self) -> datetime:
        return self.first_due_at or self.due

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": FORMAT_VERSION,
            "id": self.id,
            "task": self.task,
            "args": list(self.args),
            "kwargs": self.kwargs,
            "due": self.due.isoformat(),
            "attempt": self.attempt,
            "queue": self.queue,
            "created": self.created.isoformat(),
            "first_due": self.first_due.isoformat(),
        }
        # Optional fields only when set: a plain job's body stays as it was.
        if self.backend is not None:
            data["backend"] = self.backend
        if self.workers:
            data["workers"] = list(self.workers)
        if self.occurrence is not None:
            data["occurrence"] = self.occurrence.isoformat()
        if self.priority:
            data["priority"] = self.priority
        if self.key is not None:
            data["key"] = self.key
        if self.gen is not None:
            data["gen"] = self.gen
        return data

    def encode(self) -> bytes:
        """The message body. ``TypeError`` if the arguments are not plain JSON."""
        try:
            return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"The arguments of task {self.task!r} must be JSON-serialisable "
                f"(str, int, float, bool, None, list, dict with str keys): {exc}"
            ) from exc

    def next_attempt(self, due: datetime, worker: str | None = None) -> Job:
        """The job's next attempt, due at ``due``; ``worker`` ran this one."""
        workers = (*self.workers, worker) if worker else self.workers
        return replace(
            self, attempt=self.attempt + 1, due=due, first_due_at=self.first_due, workers=workers
        )

    @classmethod
    def decode(cls, body: bytes) -> Job:
        """Parse a message body; ``BrokenMessage`` says what is wrong with it."""
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise BrokenMessage(f"the body is not JSON: {exc}", UNDECODABLE) from exc
        except RecursionError:  # nested deeper than Python's stack
            raise BrokenMessage("the body is JSON nested too deeply", UNDECODABLE) from None
        if not isinstance(data, dict):
            raise BrokenMessage("the body is not a JSON object", UNDECODABLE)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        """A job from its decoded JSON object; ``BrokenMessage`` says what is wrong with it."""
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise BrokenMessage(f"unsupported format version {version!r}")
        try:
            job = cls(
                id=_typed(data, "id", str),
                task=_typed(data, "task", str),
                args=tuple(_typed(data, "args", list)),
                kwargs=_typed(data, "kwargs", dict),
                due=_moment(data, "due"),
                queue=_typed(data, "queue", str),
                attempt=_typed(data, "attempt", int),
                created=_moment(data, "created"),
                first_due_at=_moment(data, "first_due") if "first_due" in data else None,
                backend=_typed(data, "backend", str) if "backend" in data else None,
                workers=tuple(_typed(data, "workers", list)) if "workers" in data else (),
                occurrence=_moment(data, "occurrence") if "occurrence" in data else None,
                priority=_typed(data, "priority", int) if "priority" in data else 0,
                key=_typed(data, "key", str) if "key" in data else None,
                gen=_typed(data, "gen", str) if "gen" in data else None,
            )
            if not -100 <= job.priority <= 100:
                raise BrokenMessage(f"priority must be from -100 to 100, got {job.priority}")
            if not all(isinstance(w, str) for w in job.workers):
                raise BrokenMessage(f"field 'workers' must be a list of str, got {job.workers!r}")
            if job.first_due_at == job.due:
                job = replace(job, first_due_at=None)
        except KeyError as exc:
            raise BrokenMessage(f"missing field {exc}") from None
        if job.attempt < 1:
            raise BrokenMessage(f"attempt must be at least 1, got {job.attempt}")
        return job


def _typed(data: dict[str, Any], key: str, kind: type) -> Any:
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise BrokenMessage(f"field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _moment(data: dict[str, Any], key: str) -> datetime:
    value = _typed(data, key, str)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise BrokenMessage(f"field {key!r} is not an ISO 8601 time: {value!r}") from None
    if moment.tzinfo is None:
        raise BrokenMessage(f"field {key!r} has no time zone: {value!r}")
    return moment
