"""Warnings a process says once in a while, whichever of its threads meets the cause.

A worker started before ``declare_delay_topology`` finds the topology missing
in three places at once (its consumer, the keeper of the ledger, the reader of
the cancels), each of which tries again every few seconds. One short line for
the whole process, repeated every :data:`REPEAT_S` while the cause lasts, says
what to do; the other sightings go to DEBUG.
"""

from __future__ import annotations

import logging
import re
import threading
import time

#: How often a notice is said again while its cause lasts.
REPEAT_S = 30.0

_lock = threading.Lock()
_said: dict[str, float] = {}

logger = logging.getLogger("deferred")


def topology_missing(exc: Exception, *, now: float | None = None) -> bool:
    """Say that the topology is not declared, naming what is missing, unless it was said
    less than :data:`REPEAT_S` ago in this process; whether it was said now."""
    what = missing_name(str(exc))
    if not _due("topology", time.monotonic() if now is None else now):
        logger.debug("Still no topology (%s).", what)
        return False
    logger.error(
        "The topology is not declared (%s is missing): run `python manage.py "
        "declare_delay_topology`. Waiting for it; said again every %d s.",
        what,
        REPEAT_S,
    )
    return True


def missing_name(text: str) -> str:
    """``queue 'NAME'`` or ``exchange 'NAME'`` from a broker's NOT_FOUND, else the text's
    first sentence."""
    found = re.search(r"no (queue|exchange) '([^']*)'", text) or re.search(
        r"(Queue|Exchange) '([^']*)'", text
    )
    if found:
        return f"{found.group(1).lower()} {found.group(2)!r}"
    return text.split(". ")[0]


def _due(key: str, now: float) -> bool:
    with _lock:
        last = _said.get(key)
        if last is not None and now - last < REPEAT_S:
            return False
        _said[key] = now
        return True


def forget() -> None:
    """Say every notice again at its next sighting (the topology came back, say)."""
    with _lock:
        _said.clear()
