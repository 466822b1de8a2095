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
- A move is kept until the later of the moved copy's due time and the due time of
  the copy it replaced, plus ``CANCEL_MARGIN``: a job moved earlier leaves its old
  copy in the delay line, which must still be dropped when it comes due. A cancel
  after a move holds as long.
- Retries of a moved job carry its generation: they run. So does the retry of an
  old copy that started before the move was read (its attempt is later than the
  moved copy's, which was then dropped as a duplicate of that start).
- A move due within ``RACE_S`` of now (``run_now()``) is always published as a
  copy: two moves at once (a double click) publish two copies due now, and the
  second must not run if the first did.
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

#: A move meets its job's due time when either copy is due within this of it (clocks
#: apart, the time the mover's look took): the moved copy is then a copy, run only
#: if no attempt of the job started.
RACE_S = 2.0
#: The ``x-deferred-copy`` value of a moved copy published when the job may have
#: started already (its old copy was due, or nearly): run only if no attempt started.
MOVED_COPY = "moved"


def new_gen() -> str:
    """A generation token: unique per move, short (it is in every message of the job)."""
    return secrets.token_hex(6)


class MoveView:
    """The moves in force, in memory: job id -> the latest generation, its attempt, its
    due time, and when it may be forgotten (epoch seconds). Fed in the stream's order."""

    def __init__(self, margin_s: float) -> None:
        self.margin_s = margin_s
        #: job id -> (generation, attempt, due, until)
        self._latest: dict[str, tuple[str, int, float, float]] = {}

    def add(
        self,
        job_id: str,
        gen: str,
        due_s: float,
        now: float,
        *,
        attempt: int = 1,
        old_due_s: float | None = None,
    ) -> None:
        """A move of ``job_id`` to ``due_s``, made after every move added before it.

        Kept until the later of the moved copy's due time and the copy it replaced
        (``old_due_s``: the job's first due time, or an earlier move's), plus the
        margin: a job moved earlier leaves its old copy in the delay line, which
        must still find the move when it comes due."""
        previous = self._latest.get(job_id)
        keep_s = max(due_s, old_due_s or 0.0)
        if previous is not None:
            keep_s = max(keep_s, previous[3] - self.margin_s)
        until = keep_s + self.margin_s
        if until > now:
            self._latest[job_id] = (gen, attempt, due_s, until)
        else:
            self._latest.pop(job_id, None)

    def is_stale(self, job_id: str, gen: str | None, attempt: int = 1) -> bool:
        """Whether a copy of ``job_id`` carrying ``gen`` was replaced by a later move: not
        a retry of an attempt later than the moved copy's (the attempt that moved copy
        stood for ran elsewhere, and failed; its retry is the job now)."""
        entry = self._latest.get(job_id)
        return entry is not None and entry[0] != gen and attempt <= entry[1]

    def gen(self, job_id: str) -> str | None:
        """The generation of the latest move of ``job_id`` in force, or ``None``."""
        entry = self._latest.get(job_id)
        return entry[0] if entry else None

    def due(self, job_id: str) -> float | None:
        """When the latest move of ``job_id`` is due (epoch seconds), or ``None``."""
        entry = self._latest.get(job_id)
        return entry[2] if entry else None

    def until(self, job_id: str) -> float:
        """When the latest move of ``job_id`` may be forgotten (0.0: none in force)."""
        entry = self._latest.get(job_id)
        return entry[3] if entry else 0.0

    def __len__(self) -> int:
        return len(self._latest)

    def sweep(self, now: float) -> int:
        """Forget the moves whose time is up; how many were forgotten."""
        gone = [job_id for job_id, entry in self._latest.items() if entry[3] <= now]
        for job_id in gone:
            del self._latest[job_id]
        return len(gone)
