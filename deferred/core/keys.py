"""Debounced jobs: of all jobs deferred with the same key, only the latest runs.

``defer(send_digest.using(key="digest:42"), timedelta(minutes=5), user_id)``
defers a job as usual, and marks it as the latest of its key. An earlier job
of that key that comes due afterwards is dropped by the worker with the
outcome ``superseded``: counted and logged, never failed.

Where "latest" is kept, with no table: a keyed job is published once, with a
``BCC`` routing key (RabbitMQ's sender-selected distribution) that also puts
a copy of it in the cancels stream (``deferred.records.cancels``). One publish, one
confirm: a ``defer()`` that returned has both its job in the delay queues and
its record in the stream, and one that raised may have neither or both, never
the one without the other. The broker strips ``BCC`` on delivery, so the
job's later hops, retries and hand-backs never add a record. Every worker
already follows that stream for the cancels; it reads the keyed jobs there
too and keeps, per key, the latest job, and the jobs that a later one
superseded.

The guarantee, precisely:

- "Latest" is the stream's order: the order in which the broker confirmed the
  ``defer()`` calls, whatever the hosts' clocks say. Two hosts whose clocks
  differ still agree on it. A job is superseded when a later job of its key
  was confirmed before the worker took it up: a key deferred a moment before
  the older job comes due wins, as a cancel does (the worker reads the stream
  up to the job's due time before running it).
- A superseded job is dropped at each of its attempts, retries included, for
  as long as the cancels are kept: its first due time (from its id) plus
  ``CANCEL_MARGIN``. A retry due later than that runs. A job already running
  when it is superseded finishes (and if it fails, its retry is dropped when
  it comes due). A job in the failed list stays there; a retry from it
  (``deferred_failed retry``) runs if it is still its key's latest job, and
  is dropped as superseded if a later job of the key was deferred meanwhile.
- Whose clock: "before the older job comes due" compares the worker's clock
  with the due time the deferring host wrote into the older job. With clocks
  apart by ``d``, a later job deferred within ``d`` of that due time may come
  too late or just in time; outside that, the order is exact. The stream's
  order itself depends on no clock.
- The state survives restarts: the stream is on disk (replicated on a cluster),
  and a worker reads it from the start when it boots. On a cluster, a reader
  that follows a replica may learn of a record a few milliseconds late, as it
  may for a cancel.
- Memory holds a key for as long as its latest job can still come due (its
  due time plus ``CANCEL_MARGIN``), and a superseded job's id until its own
  due time plus the margin. A job is superseded only once its id was read as
  replaced: a job whose own record the worker has not read yet (a job due
  at once can reach a worker a moment before the stream has its copy) is
  never taken for an older one, so it runs.
- Without the binding from the ingest exchange to the cancels stream (a
  topology declared before cancels existed), the copy goes nowhere and every
  job runs: ``manage.py check`` reports the missing binding.
"""

from __future__ import annotations

#: The longest key accepted: a key is in every message of its jobs.
MAX_KEY_LENGTH = 200


def validate_key(key: object) -> str:
    """``key`` if it can be a debounce key; ``TypeError``/``ValueError`` otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"A debounce key is a string, got {key!r}.")
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise ValueError(
            f"A debounce key is 1 to {MAX_KEY_LENGTH} printable characters, got {key!r}."
        )
    return key


class KeyView:
    """The keys in force, in memory: per key its latest job, and the superseded jobs.

    Fed in the stream's order; ``now`` is epoch seconds, and so is each
    ``until``: when an entry may be forgotten (its job's due time plus the margin).
    """

    def __init__(self, margin_s: float) -> None:
        self.margin_s = margin_s
        #: key -> (its latest job's id, when that entry may be forgotten)
        self._latest: dict[str, tuple[str, float]] = {}
        #: job id -> when it may be forgotten
        self._superseded: dict[str, float] = {}

    def add(self, key: str, job_id: str, due_s: float, now: float) -> None:
        """A job of ``key`` due at ``due_s``, deferred after every job added before it."""
        previous = self._latest.get(key)
        if previous is not None and previous[0] != job_id and previous[1] > now:
            old_id, old_until = previous
            if old_until > self._superseded.get(old_id, 0.0):
                self._superseded[old_id] = old_until
        until = due_s + self.margin_s
        if until > now:
            self._latest[key] = (job_id, until)
        else:
            # Past already (a record read at boot): nothing after it can be
            # superseded by it, and what it superseded is recorded above.
            self._latest.pop(key, None)

    def is_superseded(self, job_id: str) -> bool:
        return job_id in self._superseded

    def latest(self, key: str) -> str | None:
        """The id of the latest job of ``key`` still in force, or ``None``."""
        entry = self._latest.get(key)
        return entry[0] if entry else None

    def __len__(self) -> int:
        """The keys in force."""
        return len(self._latest)

    @property
    def superseded(self) -> int:
        """The superseded jobs still remembered."""
        return len(self._superseded)

    def sweep(self, now: float) -> int:
        """Forget what is past; how many entries were forgotten."""
        gone_keys = [key for key, (_, until) in self._latest.items() if until <= now]
        for key in gone_keys:
            del self._latest[key]
        gone_jobs = [job_id for job_id, until in self._superseded.items() if until <= now]
        for job_id in gone_jobs:
            del self._superseded[job_id]
        return len(gone_keys) + len(gone_jobs)
