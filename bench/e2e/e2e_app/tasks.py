"""The harness's task: note when it ran against when it was due.

The notes are written once, at the worker's exit (``E2E_SEEN``), so that
measuring costs a list append per job.
"""

import atexit
import os
import time

from deferred import current_job, task

_seen: list[tuple[str, float, float]] = []


@task(name="e2e.note")
def note(n: int = 0) -> None:
    job = current_job()
    assert job is not None
    _seen.append((job.id, time.time(), job.due.timestamp()))


def _write() -> None:
    path = os.environ.get("E2E_SEEN")
    if path and _seen:
        with open(path, "a") as f:
            f.writelines(f"{job_id} {at:.6f} {due:.6f}\n" for job_id, at, due in _seen)


atexit.register(_write)
