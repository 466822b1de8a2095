"""Argument types shared by the management commands."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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
