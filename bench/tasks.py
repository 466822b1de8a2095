"""The benchmark's task: note when it ran, relative to when it was due.

Runs in the worker subprocess; the notes are written once, when the worker
exits, so that measuring costs nothing per job but a list append.
"""

import atexit
import importlib
import json
import os
import threading
import time
from typing import Any

from deferred import current_job, task

_seen: list[tuple[str, float, float]] = []


@task(name="bench.noop")
def noop(n: int = 0) -> None:
    job = current_job()
    assert job is not None
    now = time.time()
    _seen.append((job.id, now, (now - job.due.timestamp()) * 1000))


@task(name="bench.burn")
def burn(work: int) -> None:
    """CPU-bound: ``work`` rounds of arithmetic, holding the GIL throughout."""
    total = 0
    for i in range(work):
        total += i * i % 7
    job = current_job()
    assert job is not None
    now = time.time()
    _seen.append((job.id, now, (now - job.due.timestamp()) * 1000))


@task(name="bench.tick")
def tick() -> None:
    """The schedules scenario's recurring task: one line per run, written at once (the
    scheduling worker may be SIGKILLed)."""
    job = current_job()
    assert job is not None and job.occurrence is not None
    with open(os.environ["BENCH_TICKS"], "a") as f:
        f.write(f"{job.id} {job.occurrence.timestamp():.3f} {time.time():.6f} {os.getpid()}\n")


@task(name="bench.soak_record")
def soak_record(n: int = 0) -> None:
    """The soak's task (``bench.soak``): one JSON line per run, written as it starts.

    One ``os.write`` of a short line to a file opened with ``O_APPEND``: the lines
    of concurrent threads and processes never interleave, and a worker SIGKILLed
    a moment later has lost nothing the checker needs. ``redelivered`` stays
    ``None``: ``current_job()`` does not say. The sleep gives the job the
    millisecond of work of the jobs the soak stands for.
    """
    started = time.time()
    job = current_job()
    assert job is not None
    line = json.dumps(
        {
            "id": job.id,
            "attempt": job.attempt,
            "start": started,
            "due": job.due.timestamp(),
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
            "worker": os.environ.get("BENCH_SOAK_WORKER"),
            "redelivered": None,
            "n": n,
        }
    )
    fd = os.open(os.environ["BENCH_SOAK_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    time.sleep(0.001)


def _write() -> None:
    path = os.environ.get("BENCH_SEEN")
    if path and _seen:
        with open(path, "a") as f:  # --processes: every child adds its own
            f.writelines(f"{job_id} {at:.6f} {late:.3f}\n" for job_id, at, late in _seen)


atexit.register(_write)


def _noop_for_framework(n: int = 0) -> None:
    noop(n)


def _framework() -> Any:
    """django.tasks (Django 6), the backport (5.2), or ``None`` if neither is installed."""
    for package in ("django.tasks", "django_tasks"):
        try:
            return importlib.import_module(package)
        except ImportError:
            continue
    return None


# The worker finds a django.tasks task by its module path: the function's
# name must be the name it has in this module.
_noop_for_framework.__name__ = _noop_for_framework.__qualname__ = "framework_noop"
#: The same note as a django.tasks task; ``None`` without django.tasks.
_tasks_api = _framework()
framework_noop: Any = _tasks_api.task(_noop_for_framework) if _tasks_api else None
