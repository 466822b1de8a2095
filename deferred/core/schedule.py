"""When a recurring task runs: ``every(...)`` and ``cron(...)``.

Pure logic, no I/O: a schedule answers "which occurrence comes after this
instant?", the same way in every process. That is what lets any worker carry
on planning after another one: occurrences are computed, never stored, and
each has an identity (its task and its instant) that every process agrees on.

``every(period)`` is anchored to the Unix epoch (or to ``start``), not to the
moment a worker started: ``every(minutes=5)`` runs at :00, :05, :10... UTC,
whoever plans it. ``cron(expr, tz)`` follows Debian cron on the days the
clocks change, through cronsim: a time skipped by spring-forward runs once,
right after the jump; a time repeated by fall-back runs once, the first time.
cronsim is an optional dependency (``pip install "deferred[cron]"``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from deferred.core.jobs import id_with_due

#: What happens to occurrences missed while nothing could plan them (every
#: worker down, or the broker): ``"coalesce"`` runs one (the latest) in their
#: place, ``"skip"`` runs none, ``"all"`` runs each, up to ``MISFIRE_ALL_CAP``.
Misfire = Literal["coalesce", "skip", "all"]
MISFIRE_POLICIES: tuple[str, ...] = ("coalesce", "skip", "all")
MISFIRE_ALL_CAP = 100

#: The shortest period: below it the scheduler would plan faster than it can
#: publish, and the delay line's own precision (1 ms) stops being small.
MIN_PERIOD = timedelta(milliseconds=100)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class ScheduleError(ValueError):
    """A schedule that cannot be built: a bad period, expression, time zone or policy."""


def _misfire(value: str) -> Misfire:
    if value not in MISFIRE_POLICIES:
        raise ScheduleError(
            f"misfire must be one of {', '.join(map(repr, MISFIRE_POLICIES))}, not {value!r}."
        )
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class Schedule:
    """Base of :class:`Every` and :class:`Cron`."""

    misfire: Misfire = field(default="coalesce", kw_only=True)

    def after(self, instant: datetime) -> datetime:
        """The first occurrence strictly after ``instant`` (aware), in UTC."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    @property
    def key(self) -> str:
        """A short digest of what the schedule is: it changes when the schedule does."""
        return hashlib.sha256(self.describe().encode()).hexdigest()[:12]

    def between(self, start: datetime, end: datetime, limit: int) -> list[datetime]:
        """The occurrences in ``(start, end]``, at most ``limit`` of them (the first ones)."""
        found: list[datetime] = []
        at = start
        while len(found) < limit:
            at = self.after(at)
            if at > end:
                break
            found.append(at)
        return found


def _aware(instant: datetime, what: str) -> datetime:
    if not isinstance(instant, datetime):
        raise ScheduleError(f"{what} must be a datetime, not {type(instant).__name__}.")
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ScheduleError(f"{what} must be an aware datetime (with a time zone).")
    return instant.astimezone(UTC)


@dataclass(frozen=True)
class Every(Schedule):
    """Every ``period``, on the grid ``start + k * period``."""

    period: timedelta = timedelta(minutes=1)
    start: datetime = EPOCH

    def after(self, instant: datetime) -> datetime:
        instant = _aware(instant, "instant")
        elapsed = instant - self.start
        steps = elapsed // self.period + 1 if elapsed >= timedelta(0) else 0
        return self.start + steps * self.period

    def describe(self) -> str:
        start = "" if self.start == EPOCH else f" from {self.start.isoformat()}"
        return f"every {_period_text(self.period)}{start}"


@dataclass(frozen=True)
class Cron(Schedule):
    """A five-field cron expression, read in time zone ``tz``."""

    expression: str = "* * * * *"
    tz: str = "UTC"

    def after(self, instant: datetime) -> datetime:
        from cronsim import CronSim

        zone = ZoneInfo(self.tz)
        # cronsim starts from the next whole minute after a time with seconds.
        local = _aware(instant, "instant").astimezone(zone)
        return next(CronSim(self.expression, local)).astimezone(UTC)

    def describe(self) -> str:
        return f"cron {self.expression!r} ({self.tz})"


def _period_text(period: timedelta) -> str:
    seconds = period.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g} {unit}"
    return f"{seconds * 1000:g} ms"


def every(
    period: timedelta | None = None,
    /,
    *,
    start: datetime | None = None,
    misfire: str = "coalesce",
    **units: float,
) -> Every:
    """Every ``period``: a ``timedelta``, or ``timedelta``'s keywords (``every(minutes=5)``).

    Occurrences fall on the grid ``start + k * period``, where ``start``
    defaults to the Unix epoch: every process computes the same instants.
    """
    if period is not None and units:
        raise ScheduleError("every() takes a timedelta or timedelta's keywords, not both.")
    if period is None:
        if not units:
            raise ScheduleError(
                "every() needs a period: every(minutes=5) or every(timedelta(...))."
            )
        try:
            period = timedelta(**units)
        except TypeError as exc:
            raise ScheduleError(f"every(): {exc}") from None
    if not isinstance(period, timedelta):
        raise ScheduleError(f"every() takes a timedelta, not {type(period).__name__}.")
    if period < MIN_PERIOD:
        raise ScheduleError(
            f"every(): the period must be at least {MIN_PERIOD.total_seconds() * 1000:g} ms, "
            f"not {period}."
        )
    anchor = EPOCH if start is None else _aware(start, "every(start=...)")
    return Every(period=period, start=anchor, misfire=_misfire(misfire))


def cron(expression: str, tz: str | tzinfo | None = None, *, misfire: str = "coalesce") -> Cron:
    """A cron expression (five fields: minute hour day month weekday; names like ``mon-fri``
    allowed), read in ``tz`` (a zone name), or in Django's ``TIME_ZONE`` when omitted."""
    try:
        from cronsim import CronSim, CronSimError
    except ImportError:
        raise ImportError(
            'cron() schedules need cronsim: pip install "deferred[cron]" (or cronsim).'
        ) from None
    if not isinstance(expression, str):
        raise ScheduleError(f"cron() takes the expression as a str, not {type(expression)!r}.")
    zone_name = _zone_name(tz)
    try:
        zone = ZoneInfo(zone_name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"cron(): unknown time zone {zone_name!r}.") from None
    expression = " ".join(expression.split())
    try:
        CronSim(expression, datetime.now(zone))
    except CronSimError as exc:
        raise ScheduleError(f"cron({expression!r}): {exc}.") from None
    if len(expression.split()) != 5:
        # cronsim also takes a sixth field (seconds); deferred keeps to cron's five.
        raise ScheduleError(
            f"cron({expression!r}): five fields expected (minute hour day month weekday)."
        )
    return Cron(expression=expression, tz=zone_name, misfire=_misfire(misfire))


def _zone_name(tz: str | tzinfo | None) -> str:
    if tz is None:
        from django.conf import settings

        return str(getattr(settings, "TIME_ZONE", None) or "UTC")
    if isinstance(tz, ZoneInfo):
        return tz.key
    if isinstance(tz, str):
        return tz
    if tz is UTC:
        return "UTC"
    raise ScheduleError(f"cron(tz=...) takes a zone name such as 'Europe/Paris', not {tz!r}.")


def occurrence_id(task_name: str, occurrence: datetime) -> str:
    """The job id of ``task_name``'s run at ``occurrence``: the same in every process, so a
    duplicate of an occurrence carries the same id."""
    at = _aware(occurrence, "occurrence")
    # The id carries the occurrence as its due time, so it can be cancelled like any job.
    return id_with_due(at, f"{task_name}\0{at.isoformat(timespec='milliseconds')}".encode())
