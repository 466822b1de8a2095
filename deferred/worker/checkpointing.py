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
a checkpoint's tail is then read in about half the time between two,
smoothly, and p99 lateness is what it is without the ledger.
The time between two checkpoints is counted from the CPU the last one took,
not from the time it waited.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

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
    """Called once per message read: sleeps as needed so that the calls keep, on
    average, to ``per_s`` a second (checked every :data:`EVERY` calls: the broker
    sends in bursts of the read's credit anyway)."""

    EVERY = 50

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self.calls = 0
        self.started = time.monotonic()
        self.slept = 0.0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls % self.EVERY:
            return
        ahead = self.calls / self.per_s - (time.monotonic() - self.started)
        if ahead > 0:
            time.sleep(ahead)
            self.slept += ahead


@dataclass(frozen=True)
class Written:
    """A checkpoint written: its head, and the CPU time its process spent."""

    head: Head
    cpu_s: float


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
    settings: DeferredSettings, *, timeout: float, per_s: float = READ_PER_S
) -> Written:
    """``deferred.records.checkpoints.write`` in a process of its own, its reads paced
    to ``per_s`` messages a second; return what it wrote. Raises
    ``deferred.BrokerError`` as ``write`` does, or ``CheckpointFailed``."""
    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        started = time.thread_time()
        head = checkpoints.write(settings, timeout=timeout, pace=Pace(per_s))
        return Written(head, time.thread_time() - started)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_child,
        args=(settings, timeout, per_s, send),
        name="deferred-checkpoint",
        daemon=True,
    )
    # Started from a thread at the lower priority, which the child inherits from its
    # first instruction (on Linux a thread's nice value is its own): its start,
    # Python and Django set up, is no burst at the worker's priority. Elsewhere the
    # child lowers its own once it runs.
    starter = threading.Thread(target=_start_nicely, args=(child,), name="deferred-checkpoint")
    starter.start()
    starter.join()
    send.close()
    try:
        if not receive.poll(timeout + GRACE_S):
            raise CheckpointFailed(f"The checkpoint's process did not answer in {timeout:g} s.")
        kind, said, cpu_s = receive.recv()
    except EOFError:
        raise CheckpointFailed(
            f"The checkpoint's process ended without a word (exit code {child.exitcode})."
        ) from None
    finally:
        receive.close()
        if child.is_alive():
            child.join(1.0)
        if child.is_alive():
            child.terminate()
            child.join(1.0)
    if kind == "head":
        return Written(Head.decode(said), cpu_s)
    if kind == "broker":
        raise broker.BrokerUnavailable(said)
    raise CheckpointFailed(said)


def _start_nicely(child: multiprocessing.process.BaseProcess) -> None:
    if ONE_THREAD_NICE:
        _nice()
    child.start()


def _nice() -> None:
    try:
        os.nice(NICE)
    except OSError:
        pass  # as it is, then


#: Whether ``os.nice`` lowers the calling thread alone (Linux), not the whole process.
ONE_THREAD_NICE = sys.platform.startswith("linux")


def _child(settings: DeferredSettings, timeout: float, per_s: float, send: Connection) -> None:
    if not ONE_THREAD_NICE:
        _nice()
    try:
        import django

        django.setup()
        # Spare connections speed look-ups up; one checkpoint needs none, and each is a
        # connection for the broker to open and close.
        ledger_io.SPARES = 0
        head = checkpoints.write(settings, timeout=timeout, pace=Pace(per_s))
        send.send(("head", head.encode(), time.process_time()))
    except broker.BrokerError as exc:
        send.send(("broker", str(exc), time.process_time()))
    except Exception as exc:  # said to the keeper, which logs it too
        logger.exception("Could not write the ledger's checkpoint.")
        send.send(("error", f"{type(exc).__name__}: {exc}", time.process_time()))
    finally:
        send.close()
