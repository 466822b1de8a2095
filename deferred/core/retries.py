"""Retry policies: how many times a failing task is tried again, and how long to wait.

Pure logic, no broker: the worker asks :meth:`RetryPolicy.decide` what to do
with an exception and publishes the retry through the delay topology itself,
so a job waiting for its next attempt costs the worker nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any


class Retry(Exception):
    """Raise from a task to run it again later: ``raise Retry(delay=30)``.

    ``delay`` is what ``defer()`` accepts (seconds, ``timedelta`` or an aware
    ``datetime``); ``None`` uses the task's backoff. It counts as an attempt:
    once the task's ``max_retries`` are used up, the job goes to the failed
    queue.
    """

    # The path results and the failed store record: the public one.
    __module__ = "deferred"

    def __init__(
        self, delay: int | float | timedelta | datetime | None = None, reason: str = ""
    ) -> None:
        super().__init__(reason or "retry requested by the task")
        self.delay = delay


@dataclass(frozen=True)
class Exponential:
    """Wait ``base * factor**(retry - 1)`` seconds, at most ``cap``, plus up to
    ``jitter`` (a fraction) more, so that jobs failing together do not all come
    back at the same instant. Jitter only adds: a retry never comes sooner
    than the nominal wait."""

    base: float = 10.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        for name in ("base", "factor", "cap", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"Exponential {name} must be a number, got {value!r}.")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"Exponential {name} must be finite and >= 0, got {value!r}.")
        if self.factor < 1:
            raise ValueError(f"Exponential factor must be at least 1, got {self.factor!r}.")

    def seconds(self, retry: int) -> float:
        try:
            nominal = min(self.cap, self.base * self.factor ** (retry - 1))
        except OverflowError:  # factor ** retry beyond floats: long past the cap
            nominal = self.cap
        return nominal * (1 + random.uniform(0, self.jitter))


@dataclass(frozen=True)
class Schedule:
    """An explicit list of waits in seconds; the last one repeats."""

    delays: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.delays:
            raise ValueError("A retry schedule needs at least one delay.")
        for value in self.delays:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"Retry delays must be numbers of seconds, got {value!r}.")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"Retry delays must be finite and >= 0, got {value!r}.")

    def seconds(self, retry: int) -> float:
        return float(self.delays[min(retry, len(self.delays)) - 1])


Backoff = Exponential | Schedule


def parse_backoff(value: Any) -> Backoff:
    """A backoff from what users write: a list of seconds, a dict or an ``Exponential``."""
    if isinstance(value, Exponential | Schedule):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"base", "factor", "cap", "jitter"}
        if unknown:
            raise ValueError(f"Unknown exponential backoff key(s): {', '.join(sorted(unknown))}.")
        return Exponential(**value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Schedule((value,))
    if isinstance(value, Sequence) and not isinstance(value, str):
        return Schedule(tuple(value))
    raise ValueError(
        "retry_backoff must be a list of seconds (e.g. [10, 60, 600]; the last repeats), "
        "a dict {'base', 'factor', 'cap', 'jitter'} or deferred.Exponential(...); "
        f"got {value!r}."
    )


def validate_max_retries(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_retries must be a non-negative integer, got {value!r}.")
    return value


def validate_exception_types(name: str, value: Any) -> tuple[type[BaseException], ...]:
    types = value if isinstance(value, tuple | list) else (value,)
    for kind in types:
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            raise ValueError(f"{name} must be exception classes, got {kind!r}.")
    return tuple(types)


#: Failure reason: the task raised and is not retried (no retries configured,
#: or an exception its policy does not retry).
TASK_ERROR = "task_error"
#: Failure reason: the task raised on its last allowed attempt.
RETRIES_EXHAUSTED = "retries_exhausted"


@dataclass(frozen=True)
class Decision:
    """What the worker does with a failure: retry after ``delay``, or fail for ``reason``."""

    retry: bool
    delay: int | float | timedelta | datetime = 0
    reason: str = ""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int
    backoff: Backoff
    retry_for: tuple[type[BaseException], ...] = (Exception,)
    dont_retry_for: tuple[type[BaseException], ...] = ()

    def decide(self, error: BaseException, attempt: int) -> Decision:
        """Retry or fail, after ``attempt`` (1 for the first run) raised ``error``."""
        retries_left = attempt <= self.max_retries
        if isinstance(error, Retry):
            if not retries_left:
                return Decision(False, reason=RETRIES_EXHAUSTED)
            delay = error.delay if error.delay is not None else self.backoff.seconds(attempt)
            return Decision(True, delay)
        if isinstance(error, self.dont_retry_for) or not isinstance(error, self.retry_for):
            return Decision(False, reason=TASK_ERROR)
        if not retries_left:
            return Decision(False, reason=RETRIES_EXHAUSTED if self.max_retries else TASK_ERROR)
        return Decision(True, self.backoff.seconds(attempt))
