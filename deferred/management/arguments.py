"""What the management commands share: argument types and reading DEFERRED."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from datetime import datetime, timedelta

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from django.utils import timezone

from deferred.conf import DeferredSettings, get_settings


def command_settings() -> DeferredSettings:
    """``DEFERRED``, or a ``CommandError`` saying what is wrong with it (not a traceback)."""
    try:
        return get_settings()
    except ImproperlyConfigured as exc:
        raise CommandError(str(exc)) from exc


def seconds(minimum: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds, at least ``minimum``."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
        if not minimum <= number < float("inf"):
            raise argparse.ArgumentTypeError(
                f"must be a finite number of seconds, at least {minimum:g}; got {value}"
            )
        return number

    return parse


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def moment(value: str) -> datetime:
    """An argparse ``type``: a moment, as ISO 8601 (``2026-12-01T18:00``; without a zone,
    in Django's ``TIME_ZONE``), ``now``, or from now: ``+90s``, ``-5m``, ``+2h``, ``+1d``."""
    text = value.strip()
    now = timezone.now()
    if text == "now":
        return now
    if text[:1] in "+-" and text[-1:] in _UNITS:
        try:
            amount = float(text[1:-1])
        except ValueError:
            amount = float("nan")
        if math.isfinite(amount):
            sign = -1 if text[0] == "-" else 1
            return now + timedelta(seconds=sign * amount * _UNITS[text[-1]])
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a moment: give ISO 8601 (2026-12-01T18:00, 2026-12-01T18:00Z), "
            "now, or an offset from now (+90s, -5m, +2h, +1d)"
        ) from None
    if parsed.tzinfo is None:
        parsed = timezone.make_aware(parsed)
    return parsed
