"""What the management commands share: argument types and reading DEFERRED."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError

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
