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
keys: an entry whose signature does not match (another project's, another
key's) is ignored. What it cannot guard against is whoever may write to the
cache, since Django's shared caches unpickle what they read.

Not put: a redelivered attempt. Its first delivery may have run too (a worker
whose connection was lost runs its job to the end), and the stream keeps the
first end of the two, which no single worker knows.

How it is written: one ``set_many`` per stream message once the broker
confirmed it, on a thread of the cache's own (:class:`CachePutter`); a cache
that fails is logged and otherwise ignored (the stream has the record).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.core.cache import caches
from django.db import close_old_connections

from deferred import broker
from deferred.conf import DeferredSettings

logger = logging.getLogger("deferred.results")

#: The most confirmed messages' entries waiting for the cache: about 10 seconds'
#: worth for a worker writing 20 messages a second.
MAX_BATCHES = 200
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


@dataclass(eq=False)
class _Batch:
    """Entries to put once one stream message is confirmed: records by job id."""

    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


class CachePutter:
    """The worker's side: collects each finished job's records by the stream message
    they go out in, and once that message is confirmed, puts them in the cache.

    The puts run on a thread of their own, never a job's or the results
    writer's: a cache that is slow or hangs (a client with no timeout) must not
    hold up the stream's records, nor, through them, the jobs. What waits for it
    is bounded (``MAX_BATCHES`` messages' worth); beyond that, entries are
    dropped and counted, and their look-ups read the stream.
    """

    def __init__(
        self,
        settings: DeferredSettings,
        alias: str,
        encode: Callable[[list[dict[str, Any]]], tuple[bytes, dict[str, Any]]],
    ) -> None:
        self.settings = settings
        self.alias = alias
        self.encode = encode
        self.timeout = settings.result_cache_timeout_s
        self._lock = threading.Lock()
        self._batches: dict[broker.Written, _Batch] = {}
        self._queue: queue.Queue[_Batch | None] = queue.Queue(MAX_BATCHES)
        self._thread: threading.Thread | None = None
        #: Entries put; entries the cache refused, or dropped for want of room.
        self.put = 0
        self.failed = 0

    def add(self, written: broker.Written, job_id: str, records: list[dict[str, Any]]) -> None:
        """Put ``records`` (all of ``job_id``'s) once ``written`` is confirmed; never
        if it is not."""
        with self._lock:
            batch = self._batches.get(written)
            first = batch is None
            if batch is None:
                batch = self._batches[written] = _Batch()
            batch.records[job_id] = records
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="deferred-results-cache", daemon=True
                )
                self._thread.start()
        if first:
            # Outside the lock: a message already confirmed calls back at once, here.
            written.add_done_callback(lambda ok: self._confirmed(written, ok))

    def stop(self, timeout: float = 1.0) -> None:
        """Put what is queued, for ``timeout`` seconds at most, then end the thread."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        thread.join(timeout)

    def _confirmed(self, written: broker.Written, ok: bool) -> None:
        with self._lock:
            batch = self._batches.pop(written, None)
        if batch is None or not ok:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.failed += len(batch.records)
            _warn("keep up with", RuntimeError(f"{MAX_BATCHES} messages' entries waiting"))

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            # The database cache: a connection the server dropped is replaced, as a
            # request or a job would have it.
            close_old_connections()
            try:
                entries = {
                    cache_key(self.settings, job_id): self.encode(records)
                    for job_id, records in batch.records.items()
                }
                caches[self.alias].set_many(entries, timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - the stream has the records
                self.failed += len(batch.records)
                _warn("write", exc)
            else:
                self.put += len(entries)


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
