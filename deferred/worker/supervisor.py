"""``run_deferred_worker --processes N``: N worker processes under one parent.

Threads share one GIL, so CPU-bound tasks need processes to use more than
one core, as Celery's prefork pool and Dramatiq's processes do. Each child
is a whole ``run_deferred_worker`` started afresh (not forked: a fork of a
process holding pika connections and threads is not safe), with its own
connection, prefetch and signal handling; the parent only supervises:

- a child that dies is started again after a backoff that doubles from
  1 s to 30 s (reset once a child has run for a minute), so a task that
  kills its process cannot turn the parent into a fork bomb;
- a child that made way on purpose (:class:`deferred.worker.exits.WorkerExit`:
  recycled, or a job past its hard time limit, each settled or handed back
  first) is replaced at once, with no backoff;
- a child that cannot end itself is killed: each child touches a liveness
  file of the parent's every second from a thread of its own
  (:class:`Liveness`); a task stuck in C code that holds the GIL stops every
  thread, the time limits' watchdog too, and the file goes stale. Past
  ``liveness_s`` the parent sends SIGKILL and starts a fresh child (its
  jobs are redelivered, as after any crash: the broker dropped its
  connection by then anyway, for want of heartbeats);
- SIGTERM or SIGINT is passed to every child, which finishes its running
  jobs and exits; the parent exits 0 once all of them exited 0;
- with ``--health-file PATH`` each child keeps ``PATH.<n>`` and the parent
  keeps ``PATH`` while every child's file is fresh;
- with ``--metrics-port P`` child ``n`` serves its metrics on ``P + n``.

Children run in a process group of their own, so a Ctrl-C in a terminal
reaches them once, through the parent; on Linux they also get SIGTERM if
the parent is killed outright.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from deferred.worker.exits import WorkerExit

logger = logging.getLogger("deferred.worker")

RESTART_FIRST_S = 1.0
RESTART_CAP_S = 30.0
#: A child that ran this long before dying starts again after the first wait.
STABLE_S = 60.0
#: Exit statuses of a child that ended on purpose, everything settled: replaced at once.
PLANNED = frozenset({WorkerExit.RECYCLED, WorkerExit.TIMED_OUT})
#: The environment variable naming a child's liveness file.
LIVENESS_ENV = "DEFERRED_WORKER_LIVENESS"
#: How often a child touches it.
LIVENESS_EVERY_S = 1.0
#: The parent's health file is kept while each child's is younger than this.
HEALTH_STALE_S = 10.0


@dataclass
class _Slot:
    number: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    wait_s: float = RESTART_FIRST_S
    restart_at: float = 0.0
    exits: list[int] = field(default_factory=list)


class Supervisor:
    """Runs ``processes`` children of ``child_args`` (a ``run_deferred_worker`` command line)."""

    def __init__(
        self,
        processes: int,
        child_args: Sequence[str],
        *,
        metrics_port: int | None = None,
        health_file: str | None = None,
        poll_interval: float = 0.2,
        liveness_s: float | None = None,
    ) -> None:
        self.slots = [_Slot(n) for n in range(processes)]
        #: A child whose liveness file is older than this is killed (``None``: never).
        self.liveness_s = liveness_s
        self._liveness_dir: str | None = None
        self.child_args = list(child_args)
        self.metrics_port = metrics_port
        self.health_file = Path(health_file) if health_file else None
        self.poll_interval = poll_interval
        #: Set by the signal handler (a plain flag: no lock a handler could deadlock on).
        self._stopping = False
        self._signals: list[int] = []
        self._forwarded: set[int] = set()

    def run(self) -> int:
        """Supervise until a signal; return 0 if every child finished cleanly."""
        previous = {
            signum: signal.signal(signum, self._on_signal)
            for signum in (signal.SIGTERM, signal.SIGINT)
        }
        if self.liveness_s is not None:
            self._liveness_dir = tempfile.mkdtemp(prefix="deferred-liveness-")
        try:
            for slot in self.slots:
                self._start(slot)
            while not self._stopping:
                for slot in self.slots:
                    self._watch(slot)
                self._beat()
                time.sleep(self.poll_interval)
            return self._shutdown()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.health_file is not None:
                self.health_file.unlink(missing_ok=True)
            if self._liveness_dir is not None:
                for slot in self.slots:
                    self._liveness(slot).unlink(missing_ok=True)
                os.rmdir(self._liveness_dir)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)
        self._stopping = True

    def _forward_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            logger.warning(
                "%s received: passing it to %d worker process(es).",
                signal.Signals(signum).name,
                sum(1 for s in self.slots if s.process and s.process.poll() is None),
            )
            self._forwarded.add(signum)
            for slot in self.slots:
                if slot.process is not None and slot.process.poll() is None:
                    slot.process.send_signal(signum)

    def _shutdown(self) -> int:
        """Pass the signal on, then wait for every child (passing on later signals too)."""
        self._forward_signals()
        while True:
            running = [s for s in self.slots if s.process and s.process.poll() is None]
            if not running:
                break
            time.sleep(self.poll_interval)
            self._forward_signals()
            for slot in running:
                assert slot.process is not None
                self._check_alive(slot, slot.process, time.monotonic())
        codes = [s.process.returncode for s in self.slots if s.process is not None]
        # A child still starting when the signal came has no handler yet and
        # dies of it: that is a clean stop too (it had no job).
        failed = [
            code
            for code in codes
            if code != 0 and code not in PLANNED and -code not in self._forwarded
        ]
        if failed:
            logger.error("Worker processes exited with %s.", ", ".join(map(str, failed)))
            return 1
        logger.info("All %d worker processes finished.", len(codes))
        return 0

    def _watch(self, slot: _Slot) -> None:
        now = time.monotonic()
        process = slot.process
        if process is not None:
            code = process.poll()
            if code is None:
                self._check_alive(slot, process, now)
                return
            slot.exits.append(code)
            slot.process = None
            if code in PLANNED and not self._stopping:
                logger.info(
                    "Worker process %d (pid %d) made way for a fresh one (%s); starting it.",
                    slot.number,
                    process.pid,
                    WorkerExit(code).name.lower().replace("_", " "),
                )
                self._start(slot)
                return
            if now - slot.started >= STABLE_S:
                slot.wait_s = RESTART_FIRST_S
            slot.restart_at = now + slot.wait_s
            logger.error(
                "Worker process %d (pid %d) exited with %s; starting it again in %.0f s.",
                slot.number,
                process.pid,
                _describe(code),
                slot.wait_s,
            )
            slot.wait_s = min(slot.wait_s * 2, RESTART_CAP_S)
            return
        if now >= slot.restart_at and not self._stopping:
            self._start(slot)

    def _start(self, slot: _Slot) -> None:
        args = list(self.child_args)
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port + slot.number)]
        if self.health_file is not None:
            args += ["--health-file", str(self._child_health(slot))]
        # The project is importable in the child as here (manage.py's folder, --pythonpath).
        path = [sys.path[0] or os.getcwd(), os.environ.get("PYTHONPATH", "")]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "DEFERRED_WORKER_PROCESS": str(slot.number),
        }
        if self._liveness_dir is not None:
            liveness = self._liveness(slot)
            liveness.touch()  # from now: a child gets liveness_s to start its thread
            env[LIVENESS_ENV] = str(liveness)
        slot.process = subprocess.Popen(
            args, env=env, start_new_session=True, preexec_fn=_die_with_parent
        )
        slot.started = time.monotonic()
        logger.info("Started worker process %d (pid %d).", slot.number, slot.process.pid)

    def _liveness(self, slot: _Slot) -> Path:
        assert self._liveness_dir is not None
        return Path(self._liveness_dir) / f"{slot.number}"

    def _check_alive(self, slot: _Slot, process: subprocess.Popen[bytes], now: float) -> None:
        """SIGKILL a child whose liveness file went stale: nothing in it runs any more
        (stopping too: such a child would never finish)."""
        if self._liveness_dir is None or self.liveness_s is None:
            return
        try:
            age = time.time() - self._liveness(slot).stat().st_mtime
        except FileNotFoundError:
            return
        if age > self.liveness_s:
            logger.error(
                "Worker process %d (pid %d) has run no Python code for %.0f s (a task stuck "
                "in C code holding the GIL?); killing it. Its jobs go back to RabbitMQ.",
                slot.number,
                process.pid,
                age,
            )
            process.kill()

    def _child_health(self, slot: _Slot) -> Path:
        assert self.health_file is not None
        return self.health_file.with_name(f"{self.health_file.name}.{slot.number}")

    def _beat(self) -> None:
        """Keep the parent's health file while every child's is fresh."""
        if self.health_file is None:
            return
        now = time.time()
        fresh = True
        for slot in self.slots:
            try:
                fresh = fresh and now - self._child_health(slot).stat().st_mtime < HEALTH_STALE_S
            except FileNotFoundError:
                fresh = False
        if fresh:
            self.health_file.touch()
        else:
            self.health_file.unlink(missing_ok=True)


class Liveness:
    """In a child: touch the parent's liveness file every second, from a daemon thread."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._thread = threading.Thread(target=self._run, name="deferred-liveness", daemon=True)

    @classmethod
    def from_environment(cls) -> Liveness | None:
        """The liveness file the parent named for this child, started; ``None`` if none."""
        path = os.environ.get(LIVENESS_ENV)
        if not path:
            return None
        liveness = cls(path)
        liveness._thread.start()
        return liveness

    def _run(self) -> None:
        while True:
            try:
                self.path.touch()
            except OSError:
                return  # the parent is gone, or cleaned up
            time.sleep(LIVENESS_EVERY_S)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc: Any = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def child_command(argv: Sequence[str]) -> list[str]:
    """The command line of one child: this interpreter, this command, without the parent's
    own options (``--processes``, ``--metrics-port``, ``--health-file``)."""
    return [sys.executable, "-m", "django", "run_deferred_worker", *argv]
