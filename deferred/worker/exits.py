"""Why a worker process ended by itself: its exit status.

A worker that stops on SIGTERM exits 0. Two planned exits have statuses of
their own, so that whoever starts the worker (``--processes``' parent,
systemd with ``Restart=on-failure``, Kubernetes) knows a fresh process is
wanted at once and that nothing was lost: every job was settled or handed
back before the exit.
"""

from __future__ import annotations

from enum import IntEnum


class WorkerExit(IntEnum):
    """The exit status of ``run_deferred_worker``."""

    #: Stopped by a signal, every running job finished.
    STOPPED = 0
    #: Recycled: ``--max-jobs-per-child`` or ``--max-memory-per-child`` was reached.
    RECYCLED = 3
    #: A job ran past its hard time limit: it was recorded as ``timed_out`` (or
    #: retried) and acked, and its thread, which nothing can stop, ends with the process.
    TIMED_OUT = 4
