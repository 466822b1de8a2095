"""The keeper's checkpoints of the ledger, written in a process of their own.

Why a process: a checkpoint decodes every ledger record and result written
since the last one (about 50 µs each in Python: 3 s a minute at 1,000 jobs/s).
On a thread of the worker it held the GIL for those seconds, and the worker's
own threads, which let go of it at each socket call, waited up to the switch
interval to get it back at each: p99 lateness at 1,000 jobs/s went from
11 ms to 110-450 ms while a checkpoint ran. In a child process at a lower
priority (:data:`NICE`) it takes what the host has spare, and the jobs'
path never waits on it.

And why a pace: the broker sends a stream as fast as it is read (about 11 µs
of its CPU a message), and while it does, the jobs' own traffic waits. A
reader of the ledger at 18,000 messages a second, from another process and
decoding nothing, took p99 lateness at 1,000 jobs/s from 11 ms to 257 ms;
a checkpoint in a process of its own, unpaced, to 2.4 s. The reads keep to
:func:`read_rate`: twice what the ledger grew by a second between the last
two checkpoints, at least :data:`READ_PER_S`, in bursts of
``deferred.records.checkpoints.PACED_CREDIT`` messages. At 1,000 jobs/s
a checkpoint's tail is then read in about half the time between two, and
p99 lateness is 16 ms against 9-12 ms without the ledger (docs/bench/ledger.md).
The time between two checkpoints is counted from the CPU the last one took,
not from the time it waited.

The child is started with ``spawn`` (a fork would copy the worker's
connections and threads) and sets Django up from ``DJANGO_SETTINGS_MODULE``,
as the worker's command did: a row says whether its task keeps results,
which the task registry knows. The settings it writes with are the worker's,
passed whole. Without that variable (settings configured in code) the
checkpoint runs on the calling thread. The child ends with the worker: a
keeper that stops ends it, and a child whose worker went (killed, or ended
with ``os._exit``) sees its parent change and exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from deferred import broker
from deferred.broker import ledger_index as ledger_io
from deferred.conf import DeferredSettings
from deferred.core.ledger_index import Head
from deferred.records import checkpoints

logger = logging.getLogger("deferred.keeper")

#: How much lower the checkpoint's process runs than the worker (``os.nice``).
NICE = 10
#: Past the checkpoint's own timeout, how long to wait for its process to answer.
GRACE_S = 30.0
#: The most messages a second a checkpoint reads (the ledger's and the results').
READ_PER_S = 2_000.0


class Pace:
    """Called once per message read: sleeps as needed so that the calls keep to
    ``per_s`` a second, checked every :data:`EVERY` calls (the broker sends in
    bursts of the read's credit anyway).

    The rate doubles every :data:`DOUBLE_EVERY_S` of reading, so that a backlog
    (a keeper back after a long stop) is read in bounded time, at worst unpaced;
    and time spent on anything but reading (a connection, the fold) is not saved
    up for a burst after it: at most one batch is read ahead of the pace."""

    EVERY = 50
    DOUBLE_EVERY_S = 60.0

    def __init__(
        self,
        per_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.per_s = per_s
        self.calls = 0
        self.clock = clock
        self.sleep = sleep
        self.started = self.next_at = clock()
        self.slept = 0.0

    def rate(self, now: float) -> float:
        return self.per_s * 2 ** ((now - self.started) / self.DOUBLE_EVERY_S)

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % self.EVERY:
            return
        now = self.clock()
        # When the next batch may start: one batch's time after this one's, or now if
        # the reads were slower than the pace.
        self.next_at = max(self.next_at, now - self.EVERY / self.rate(now))
        self.next_at += self.EVERY / self.rate(now)
        if self.next_at > now:
            self.sleep(self.next_at - now)
            self.slept += self.next_at - now


@dataclass(frozen=True)
class Written:
    """A checkpoint written: its head, the CPU time its writer spent, and which process
    wrote it at which nice value."""

    head: Head
    cpu_s: float
    pid: int
    nice: int


class CheckpointFailed(RuntimeError):
    """The checkpoint's process ended without writing one (its log says why)."""


def read_rate(before: Head | None, last: Head | None) -> float:
    """The pace of the next checkpoint's reads, in messages a second: twice what the
    ledger grew by a second between the last two checkpoints (its tail is then read
    in about half the time between two), and never under :data:`READ_PER_S`."""
    if before is None or last is None or last.made_ms <= before.made_ms:
        return READ_PER_S
    grew = (last.ledger_offset - before.ledger_offset) / ((last.made_ms - before.made_ms) / 1000)
    return max(READ_PER_S, 2 * grew)


def write_aside(
    settings: DeferredSettings,
    *,
    timeout: float,
    per_s: float = READ_PER_S,
    stop: threading.Event | None = None,
) -> Written:
    """``deferred.records.checkpoints.write`` in a process of its own, its reads paced
    to ``per_s`` messages a second; return what it wrote. Raises
    ``deferred.BrokerError`` as ``write`` does, or ``CheckpointFailed`` (also when
    ``stop`` is set meanwhile: the process is ended)."""
    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        started = time.thread_time()
        head = checkpoints.write(settings, timeout=timeout, pace=Pace(per_s))
        return Written(head, time.thread_time() - started, os.getpid(), _niceness())
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = None
    try:
        child = context.Process(
            target=_child,
            args=(settings, timeout, per_s, send, os.getpid()),
            name="deferred-checkpoint",
            daemon=True,
        )
        # Started from a thread at the lower priority, which the child inherits from
        # its first instruction (on Linux a thread's nice value is its own): its start,
        # Python and Django set up, is no burst at the worker's priority. Elsewhere
        # the child lowers its own once it runs.
        starter = threading.Thread(target=_start_nicely, args=(child,), name="deferred-checkpoint")
        starter.start()
        starter.join()
    finally:
        send.close()
        if child is None or child.pid is None:
            receive.close()
    if child is None or child.pid is None:
        raise CheckpointFailed("The checkpoint's process could not start.")
    answered = False
    try:
        kind, said, cpu_s, nice = _answer(receive, child, timeout + GRACE_S, stop)
        answered = True
    finally:
        receive.close()
        # Answered: it is ending. Otherwise (stopped, or past its time) it goes now.
        _end(child, wait_s=1.0 if answered else 0.0)
    if kind == "head":
        return Written(Head.decode(said), cpu_s, child.pid, nice)
    if kind == "TopologyNotDeclared":
        raise broker.TopologyNotDeclared(said)
    if kind == "broker":
        raise broker.BrokerUnavailable(said)
    raise CheckpointFailed(said)


def _answer(
    receive: Connection,
    child: multiprocessing.process.BaseProcess,
    wait_s: float,
    stop: threading.Event | None,
) -> tuple[str, Any, float, int]:
    deadline = time.monotonic() + wait_s
    try:
        while True:
            if stop is not None and stop.is_set():
                raise CheckpointFailed("The worker stops: its checkpoint's process was ended.")
            if receive.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                break
            if time.monotonic() >= deadline:
                raise CheckpointFailed(f"The checkpoint's process did not answer in {wait_s:g} s.")
        answer: tuple[str, Any, float, int] = receive.recv()
        return answer
    except EOFError:
        child.join(1.0)
        raise CheckpointFailed(
            f"The checkpoint's process ended without a word (exit code {child.exitcode})."
        ) from None


def _end(child: multiprocessing.process.BaseProcess, *, wait_s: float) -> None:
    child.join(wait_s)
    if child.is_alive():
        child.terminate()
        child.join(1.0)


def _start_nicely(child: multiprocessing.process.BaseProcess) -> None:
    if ONE_THREAD_NICE:
        _nice()
    child.start()


def _nice() -> None:
    try:
        os.nice(NICE)
    except (AttributeError, OSError):
        pass  # no nice here (Windows), or not allowed: as it is, then


def _niceness() -> int:
    try:
        return os.nice(0)
    except (AttributeError, OSError):
        return 0


#: Whether ``os.nice`` lowers the calling thread alone (Linux), not the whole process.
ONE_THREAD_NICE = sys.platform.startswith("linux")


def _child(
    settings: DeferredSettings, timeout: float, per_s: float, send: Connection, parent: int
) -> None:
    if not ONE_THREAD_NICE:
        _nice()
    # Ctrl-C is the worker's to handle, and a worker that went (killed, or ended with
    # os._exit) takes its checkpoint with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    said: tuple[str, Any]
    try:
        import django

        django.setup()
        # Spare connections speed look-ups up; one checkpoint needs none, and each is a
        # connection for the broker to open and close.
        ledger_io.SPARES = 0
        said = ("head", checkpoints.write(settings, timeout=timeout, pace=Pace(per_s)).encode())
    except broker.TopologyNotDeclared as exc:
        said = ("TopologyNotDeclared", str(exc))
    except broker.BrokerError as exc:
        said = ("broker", str(exc))
    except Exception as exc:  # said to the keeper, which logs it too
        logger.exception("Could not write the ledger's checkpoint.")
        said = ("error", f"{type(exc).__name__}: {exc}")
    try:
        send.send((*said, time.process_time(), _niceness()))
    finally:
        send.close()


def _end_with(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)
