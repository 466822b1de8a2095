"""The benchmark's task: note when it ran, relative to when it was due.

Runs in the worker subprocess; the notes are written once, when the worker
exits, so that measuring costs nothing per job but a list append.
"""

import atexit
import os
import time

from deferred import current_job, task

_seen: list[tuple[str, float, float]] = []


@task(name="bench.noop")
def noop(n: int = 0) -> None:
    job = current_job()
    assert job is not None
    now = time.time()
    _seen.append((job.id, now, (now - job.due.timestamp()) * 1000))


def _write() -> None:
    path = os.environ.get("BENCH_SEEN")
    if path and _seen:
        with open(path, "w") as f:
            f.writelines(f"{job_id} {at:.6f} {late:.3f}\n" for job_id, at, late in _seen)


atexit.register(_write)
