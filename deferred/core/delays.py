"""Turning what a caller passes as a delay into whole milliseconds.

Pure functions, exact arithmetic: a float such as ``0.3`` is converted with
``Fraction`` so that rounding to the resolution is always *up*. Rounding down
by even a millisecond would let a job run before its time.
"""

from __future__ import annotations

import math
import numbers
from datetime import datetime, timedelta
from decimal import Decimal
from fractions import Fraction

Delay = int | float | timedelta | datetime


class InvalidDelay(ValueError):
    """A delay that can never be honoured: negative, not finite, naive or too long."""


def exact_delay_ms(delay: object, now: datetime) -> Fraction:
    """The delay in (possibly fractional) milliseconds, validated.

    ``delay`` is seconds (int, float or Decimal), a ``timedelta``, or an aware
    ``datetime`` meaning "at that time"; a time in the past means "now". A
    naive ``datetime`` is ambiguous and refused, except under Django's
    ``USE_TZ = False``, where ``timezone.now()`` itself is naive and Django
    reads such times in ``TIME_ZONE``.
    """
    if isinstance(delay, datetime):
        if (delay.tzinfo is None or delay.utcoffset() is None) and not _uses_tz():
            # As everywhere in Django with USE_TZ = False: a local time in TIME_ZONE.
            from django.utils import timezone

            delay = timezone.make_aware(delay)
        if delay.tzinfo is None or delay.utcoffset() is None:
            raise InvalidDelay(
                f"The datetime {delay.isoformat()} is naive: pass an aware datetime "
                "(e.g. django.utils.timezone.now() + timedelta(...)) so its moment is unambiguous."
            )
        remaining = delay - now
        return max(Fraction(0), _timedelta_ms(remaining))
    if isinstance(delay, timedelta):
        value = _timedelta_ms(delay)
    elif isinstance(delay, bool) or not isinstance(delay, numbers.Real | Decimal):
        raise TypeError(
            "The delay must be a number of seconds, a datetime.timedelta or an aware "
            f"datetime.datetime; got {type(delay).__name__} {delay!r}."
        )
    else:
        if not math.isfinite(delay):
            raise InvalidDelay(f"The delay must be a finite number of seconds, got {delay!r}.")
        exact = delay if isinstance(delay, int | float | Decimal | Fraction) else float(delay)
        value = Fraction(exact) * 1000
    if value < 0:
        raise InvalidDelay(f"The delay must not be negative, got {delay!r}.")
    return value


def _timedelta_ms(value: timedelta) -> Fraction:
    microseconds = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    return Fraction(microseconds, 1000)


def delay_ms(delay: object, *, now: datetime, resolution_ms: int, max_delay_ms: int) -> int:
    """Validate ``delay`` and round it *up* to a whole number of resolution steps.

    Raises ``InvalidDelay`` (a ``ValueError``) or ``TypeError``.
    """
    exact = exact_delay_ms(delay, now)
    if exact > max_delay_ms:
        raise InvalidDelay(
            f"The delay {_human(exact)} is above DEFERRED['MAX_DELAY'] ({_human(max_delay_ms)}). "
            "Raise MAX_DELAY (and run declare_delay_topology) to defer that far."
        )
    steps = math.ceil(exact / resolution_ms)
    return steps * resolution_ms


def _human(ms: Fraction | int) -> str:
    try:
        return str(timedelta(milliseconds=float(ms)))
    except OverflowError:
        return f"{float(ms) / 1000:g} s"


def capped_delay_ms(delay: object, *, now: datetime, resolution_ms: int, max_delay_ms: int) -> int:
    """Like :func:`delay_ms`, but a delay above the maximum waits the maximum.

    For retries: a backoff that grows past MAX_DELAY should wait as long as
    the topology allows, not turn a retry into a failure.
    """
    exact = min(exact_delay_ms(delay, now), Fraction(max_delay_ms))
    return math.ceil(exact / resolution_ms) * resolution_ms


def _uses_tz() -> bool:
    """Django's ``USE_TZ``; true (naive times refused) outside a configured project."""
    from django.conf import settings

    return not settings.configured or bool(settings.USE_TZ)
