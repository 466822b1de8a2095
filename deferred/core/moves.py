"""Moved jobs: ``run_now()`` and ``reschedule()`` publish a job again under its id.

A job waiting in a delay queue cannot be taken out of it, so a move, like a
cancel, publishes instead: a new copy of the job, due at the new time, with
a fresh generation token (:attr:`deferred.core.jobs.Job.gen`). The copy is
published once, with a ``BCC`` routing key that also puts it in the cancels
stream, exactly as a keyed job is (:mod:`deferred.core.keys`): one publish,
one confirm, so a move that returned has both its copy in the delay line and
its record in the stream. Every worker follows that stream; per job id it
keeps the generation of the latest move, and drops any other copy of that job
when it comes due (outcome ``moved``): the copy left in the delay line by the
original ``defer()``, or by a move before.

The guarantee, precisely:

- "Latest" is the stream's order, whatever the hosts' clocks say.
- A copy is dropped only once the move's record was read, and a worker reads
  the stream up to a job's due time before it runs it (as for a cancel). A
  move confirmed before the old copy came due therefore wins; the old copy of
  a move that meets its due time may already be running. The mover looks
  (``deferred.records.changes``): a job that started is not moved, and the
  moved copy is published as a copy (``x-deferred-copy: moved``), which a
  worker runs only if no attempt of it started (as for the keeper's copies,
  ``deferred.worker.copies``). Either way the job runs once.
- A move is kept until the moved copy's due time plus ``CANCEL_MARGIN``, as a
  cancel of it is: a cancel after a move holds until the moved copy is due.
- Retries of a moved job carry its generation: they run.
- Its results: the moved copy's records are written when it runs, and a look-up
  reads from the id's due time (``deferred.records.results``). So the worker that
  drops the old copy writes a ``moved`` record pointing at the moved copy's due
  time, and a look-up that finds one reads from there. Until the old copy comes
  due, ``result()`` of a job moved earlier reads ``pending`` (``deferred_jobs
  show`` knows the move and reads its run).

Pure: no broker I/O.
"""

from __future__ import annotations

import secrets

#: The ``x-deferred-copy`` value of a moved copy published when the job may have
#: started already (its old copy was due, or nearly): run only if no attempt started.
MOVED_COPY = "moved"


def new_gen() -> str:
    """A generation token: unique per move, short (it is in every message of the job)."""
    return secrets.token_hex(6)


class MoveView:
    """The moves in force, in memory: job id -> (latest generation, when it may be
    forgotten, epoch seconds). Fed in the stream's order."""

    def __init__(self, margin_s: float) -> None:
        self.margin_s = margin_s
        self._latest: dict[str, tuple[str, float]] = {}
        self._due: dict[str, float] = {}

    def add(self, job_id: str, gen: str, due_s: float, now: float) -> None:
        """A move of ``job_id`` to ``due_s``, made after every move added before it."""
        until = due_s + self.margin_s
        if until > now:
            self._latest[job_id] = (gen, until)
            self._due[job_id] = due_s
        else:
            self._latest.pop(job_id, None)
            self._due.pop(job_id, None)

    def is_stale(self, job_id: str, gen: str | None) -> bool:
        """Whether a copy of ``job_id`` carrying ``gen`` was replaced by a later move."""
        entry = self._latest.get(job_id)
        return entry is not None and entry[0] != gen

    def gen(self, job_id: str) -> str | None:
        """The generation of the latest move of ``job_id`` in force, or ``None``."""
        entry = self._latest.get(job_id)
        return entry[0] if entry else None

    def due(self, job_id: str) -> float | None:
        """When the latest move of ``job_id`` is due (epoch seconds), or ``None``."""
        return self._due.get(job_id)

    def until(self, job_id: str) -> float:
        """When the latest move of ``job_id`` may be forgotten (0.0: none in force)."""
        entry = self._latest.get(job_id)
        return entry[1] if entry else 0.0

    def __len__(self) -> int:
        return len(self._latest)

    def sweep(self, now: float) -> int:
        """Forget the moves whose time is up; how many were forgotten."""
        gone = [job_id for job_id, (_, until) in self._latest.items() if until <= now]
        for job_id in gone:
            del self._latest[job_id]
            self._due.pop(job_id, None)
        return len(gone)
