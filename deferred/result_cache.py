"""The optional results cache (``RESULT_CACHE``): a finished job's result in a Django
cache, so that a look-up need not read the stream.

Why: a look-up from the stream costs a connection, a subscription and a few
messages read, about 10-40 ms by the broker's own floor, and more on a busy
broker; a shared cache answers in about a millisecond. Why only a copy: a
cache may drop an entry at any moment (eviction, restart), so the stream
stays the record, and an entry is put only once the stream has confirmed the
message that holds it. A look-up that misses reads the stream as before.

What goes in: the records of a job whose worker knows them all, and whose end
no later record can change. That is a job's first attempt of its first run
that ended ``succeeded``, ``cancelled``, ``superseded`` or ``dropped``: the
worker wrote every record of it (its "started" one too). Not a retried job
(other workers wrote its earlier attempts), not a ``failed`` one (the failed
list may run it again under the same id): those read the stream. An entry is
the stream message's own encoding of those records, signed with the jobs'
keys, so a forged entry is ignored as a forged stream record is.

How it is written: one ``set_many`` per stream message, on the results
writer's thread once the broker confirmed the message; a cache that fails is
logged and otherwise ignored (the stream has the record).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.core.cache import caches

from deferred import broker
from deferred.conf import DeferredSettings

logger = logging.getLogger("deferred.results")

#: Events after which a job's result can no longer change (``failed`` can: a
#: re-drive). Kept here, not imported from deferred.results, which imports this.
FINAL = frozenset({"succeeded", "cancelled", "superseded", "dropped"})
#: Log a failing cache at most this often.
WARN_EVERY_S = 60.0


def cache_key(settings: DeferredSettings, job_id: str) -> str:
    """The cache key of a job's result: the PREFIX keeps two projects apart."""
    return f"deferred:{settings.prefix}:result:{job_id}"


def get(settings: DeferredSettings, job_id: str) -> tuple[bytes, dict[str, Any]] | None:
    """The cached (body, headers) of ``job_id``'s records, or ``None``: no cache, a
    miss, an entry not of this shape, or a cache that failed (logged)."""
    if settings.result_cache is None:
        return None
    try:
        entry = caches[settings.result_cache].get(cache_key(settings, job_id))
    except Exception as exc:  # noqa: BLE001 - the stream answers instead
        _warn("read", exc)
        return None
    if (
        isinstance(entry, tuple)
        and len(entry) == 2
        and isinstance(entry[0], bytes)
        and isinstance(entry[1], dict)
    ):
        return entry
    return None


def cacheable(record: dict[str, Any]) -> bool:
    """Whether ``record`` (a final record) ends a job whose worker wrote every record
    of it: the first attempt of the first run, ended with an event no later record
    changes."""
    return record.get("ev") in FINAL and record.get("a") in (1, None) and "run" not in record


@dataclass(eq=False)
class _Batch:
    """Entries to put once one stream message is confirmed."""

    entries: dict[str, tuple[bytes, dict[str, Any]]] = field(default_factory=dict)


class CachePutter:
    """The worker's side: collects entries by the stream message their records go out
    in, and puts each message's entries in one ``set_many`` once it is confirmed."""

    def __init__(self, settings: DeferredSettings, alias: str) -> None:
        self.settings = settings
        self.alias = alias
        self.timeout = settings.result_cache_timeout_s
        self._lock = threading.Lock()
        self._batches: dict[broker.Written, _Batch] = {}
        #: Entries put, and entries the cache refused (for tests and status).
        self.put = 0
        self.failed = 0

    def add(
        self, written: broker.Written, job_id: str, entry: tuple[bytes, dict[str, Any]]
    ) -> None:
        """Put ``entry`` for ``job_id`` once ``written`` is confirmed (never if it is not)."""
        with self._lock:
            batch = self._batches.get(written)
            first = batch is None
            if batch is None:
                batch = self._batches[written] = _Batch()
            batch.entries[cache_key(self.settings, job_id)] = entry
        if first:
            # Outside the lock: a message already confirmed calls back at once, here.
            written.add_done_callback(lambda ok: self._flush(written, ok))

    def _flush(self, written: broker.Written, ok: bool) -> None:
        with self._lock:
            batch = self._batches.pop(written, None)
        if batch is None or not ok:
            return
        try:
            caches[self.alias].set_many(batch.entries, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - the stream has the records
            self.failed += len(batch.entries)
            _warn("write", exc)
        else:
            self.put += len(batch.entries)


_last_warning = 0.0


def _warn(doing: str, exc: Exception) -> None:
    global _last_warning
    now = time.monotonic()
    if now - _last_warning > WARN_EVERY_S:
        _last_warning = now
        logger.warning(
            "Could not %s the results cache (RESULT_CACHE): %r. Look-ups read the stream "
            "instead, which has every record.",
            doing,
            exc,
        )
