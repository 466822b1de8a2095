"""Recycling: a worker process that has run enough jobs, or grown too large, makes way.

Task code leaks: a cache that only grows, a C extension that never frees.
Celery answers with ``--max-tasks-per-child`` and ``--max-memory-per-child``;
so do we (``run_deferred_worker --max-jobs-per-child J --max-memory-per-child
MB``). A worker past a limit stops as on SIGTERM (its running jobs finish,
its held jobs go back to their queues) and exits with
:data:`deferred.worker.exits.WorkerExit.RECYCLED`; the ``--processes`` parent starts
its replacement at once, as systemd or Kubernetes would restart a single one.

Memory is the resident set size, read from ``/proc/self/statm`` where there is
one (what the process holds now, so a peak that was freed does not count), or
else ``getrusage``'s peak; it is looked at once a second, not per job.
"""

from __future__ import annotations

import os
import resource
import sys
import time

#: How often the resident set size is read.
MEMORY_EVERY_S = 1.0
MIB = 1024 * 1024


def resident_bytes() -> int:
    """The process's resident set size now (or its peak, where "now" is not known)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class Recycling:
    """Says when a worker should end for a fresh process, and why."""

    def __init__(self, max_jobs: int | None = None, max_memory_mib: int | None = None) -> None:
        for name, value in (("max_jobs", max_jobs), ("max_memory_mib", max_memory_mib)):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be at least 1, got {value!r}.")
        self.max_jobs = max_jobs
        self.max_memory_mib = max_memory_mib
        self._next_look = 0.0

    def reason(self, jobs: int) -> str | None:
        """Why a worker that has handled ``jobs`` jobs should make way; ``None``: it should not."""
        if self.max_jobs is not None and jobs >= self.max_jobs:
            return f"it has handled {jobs} jobs (--max-jobs-per-child {self.max_jobs})"
        # Memory only once a job ran: a fresh process over the limit has nothing to
        # shed, and making way at once would only start the next one over it.
        if self.max_memory_mib is not None and jobs > 0:
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + MEMORY_EVERY_S
                mib = resident_bytes() / MIB
                if mib > self.max_memory_mib:
                    return (
                        f"it holds {mib:.0f} MiB of memory (--max-memory-per-child "
                        f"{self.max_memory_mib})"
                    )
        return None
