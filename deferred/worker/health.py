"""``run_deferred_worker --health-file PATH``: a file that exists and is fresh while consuming.

A Kubernetes exec probe (or any supervisor) checks the file's age: the
worker touches it every few seconds from the loop that consumes, and
removes it when it stops consuming (broker lost, shutting down). A worker
whose consuming loop hangs stops touching it, which a probe on an HTTP
endpoint served by another thread would not notice (jobs that hang in every
``--concurrency`` slot do not stop it: the job log and metrics show those);
and a file needs no port, no network policy and no extra package.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from deferred.core.outcomes import Observer

logger = logging.getLogger("deferred.worker")

#: How often the file is touched while consuming; probes allow a few times this.
INTERVAL_S = 2.0


class HealthFile(Observer):
    """The file, touched at most every :data:`INTERVAL_S` while the worker consumes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise ValueError(f"--health-file: directory {self.path.parent} does not exist.")
        # Left by a worker that was killed: not healthy until this one consumes.
        self.path.unlink(missing_ok=True)
        self._last = 0.0

    def beat(self, *, force: bool = False) -> None:
        """Touch the file if it is due (or ``force``): called from the consuming loop."""
        now = time.monotonic()
        if not force and now - self._last < INTERVAL_S:
            return
        self._last = now
        try:
            self.path.touch()
            os.utime(self.path)
        except OSError as exc:  # a full disk must not stop the jobs; the probe will tell
            logger.warning("Cannot touch the health file %s: %s", self.path, exc)

    def consuming(self, up: bool) -> None:
        """Touched at once when consuming starts, removed when it stops."""
        if up:
            self.beat(force=True)
        else:
            self.remove()

    def remove(self) -> None:
        """Not consuming: the probe must fail from now on."""
        self._last = 0.0
        self.path.unlink(missing_ok=True)
