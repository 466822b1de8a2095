"""Tasks the tests defer. They record what happened in a JSON-lines file so
that a worker in another process can report back."""

import asyncio
import json
import logging
import os
import subprocess
import time

from deferred import Retry, current_job, task


def _append(path: str, **fields: object) -> None:
    line = json.dumps({**fields, "at": time.time(), "pid": os.getpid()})
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()


@task
def record(path: str, label: str) -> None:
    _append(path, label=label, event="ran")


@task(name="tests.says")
def says(text: str) -> None:
    """Logs ``text`` at INFO, as a task's own logging does."""
    logging.getLogger("tests.says").info(text)


@task(name="tests.timed")
def timed(path: str, label: str) -> None:
    """Records its job's id and due time, to measure lateness and duplicates."""
    job = current_job()
    assert job is not None
    _append(path, label=label, event="ran", job=job.id, due=job.due.timestamp())


@task(name="tests.tick")
def tick() -> None:
    """Scheduled by the recurring-job tests (DEFERRED_TEST_EVERY); records its occurrence
    and its due time (later than the occurrence only for a missed one, run at once)."""
    job = current_job()
    assert job is not None and job.occurrence is not None
    _append(
        os.environ["DEFERRED_TEST_TICKS"],
        label="tick",
        event="ran",
        job=job.id,
        occurrence=job.occurrence.timestamp(),
        due=job.due.timestamp(),
    )


@task(name="tests.sleepy")
def sleepy(path: str, label: str, seconds: float) -> None:
    _append(path, label=label, event="start")
    time.sleep(seconds)
    _append(path, label=label, event="end")


@task(name="tests.cut_off")
def cut_off(path: str, label: str) -> None:
    """Records its run, then has RabbitMQ close every connection (its worker's among
    them) and returns: its ack goes nowhere, and RabbitMQ delivers it again."""
    _append(path, label=label, event="ran", job=current_job().id)  # type: ignore[union-attr]
    subprocess.run(
        ["rabbitmqctl", "close_all_connections", "test: a job's ack is lost"],
        check=True,
        capture_output=True,
        timeout=60,
    )


@task(name="tests.explode")
def explode(message: str) -> None:
    raise RuntimeError(message)


@task(name="tests.on_other", queue="other")
def on_other(path: str, label: str) -> None:
    _append(path, label=label, event="ran", queue="other")


def read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    # A worker thread may be mid-write: a line without its newline is not out yet.
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def _attempt() -> int:
    job = current_job()
    assert job is not None, "current_job() is None inside a running job"
    return job.attempt


@task(name="tests.flaky", max_retries=3, retry_backoff=[0.5, 1.0])
def flaky(path: str, label: str, failures: int) -> None:
    """Fails its first ``failures`` attempts."""
    attempt = _attempt()
    _append(path, label=label, event="attempt", attempt=attempt, job=current_job().id)
    if attempt <= failures:
        raise ConnectionError(f"attempt {attempt}: the service is down")


@task(name="tests.patient_flaky", max_retries=3, retry_backoff=[3.0])
def patient_flaky(path: str, label: str, failures: int) -> None:
    """flaky with a backoff long enough to act in on a loaded host."""
    flaky.func(path, label, failures)


@task(name="tests.late_retry", max_retries=1, retry_backoff=[30.0])
def late_retry(path: str, label: str, failures: int) -> None:
    """flaky with its retry due well after its first due time."""
    flaky.func(path, label, failures)


@task(name="tests.always_fails", max_retries=2, retry_backoff=[0.1])
def always_fails(path: str, label: str) -> None:
    _append(path, label=label, event="attempt", attempt=_attempt())
    raise RuntimeError(f"{label} always fails")


@task(name="tests.permanent", max_retries=3, retry_backoff=[0.1], dont_retry_for=(ValueError,))
def permanent(path: str, label: str) -> None:
    _append(path, label=label, event="attempt", attempt=_attempt())
    raise ValueError("bad input: retrying will not help")


@task(name="tests.asks_retry", max_retries=1)
def asks_retry(path: str, label: str) -> None:
    attempt = _attempt()
    _append(path, label=label, event="attempt", attempt=attempt)
    if attempt == 1:
        raise Retry(delay=0.3)


@task(name="tests.fails_until_file")
def fails_until_file(path: str, label: str, flag: str) -> None:
    _append(path, label=label, event="attempt", attempt=_attempt())
    if not os.path.exists(flag):
        raise FileNotFoundError(flag)


@task(name="tests.send_invoice")
def send_invoice(path: str, label: str, flag: str) -> None:
    """Fails as a down service would until the file ``flag`` exists; records each attempt."""
    _append(path, label=label, event="attempt", attempt=_attempt())
    if not os.path.exists(flag):
        raise ConnectionError("the invoicing service answered 503 Service Unavailable")


@task(name="tests.crash")
def crash(path: str, label: str) -> None:
    """Kills the worker process every time it runs: a poison job."""
    _append(path, label=label, event="attempt")
    os._exit(3)


@task(name="tests.who_am_i")
def who_am_i(path: str, label: str) -> None:
    job = current_job()
    assert job is not None
    _append(path, label=label, event="ran", job=job.id, attempt=job.attempt, task=job.task)


@task(name="tests.chain")
def chain(path: str, n: int) -> None:
    """Records ``n``, then defers itself with ``n - 1`` until 1."""
    _append(path, label=str(n), event="ran")
    if n > 1:
        from deferred import defer

        defer(chain, 0, path, n - 1)


# The django.tasks tasks of the backend's tests: a tasks.py module imports
# them, as a user's app would, so the worker knows them.
from tests.testapp import framework_tasks  # noqa: E402, F401


@task(name="tests.slow_fail", max_retries=2, retry_backoff=[0.1])
def slow_fail(path: str, label: str, seconds: float) -> None:
    """Records its start and its end, then fails: a retry would show as a second start."""
    _append(path, label=f"{label}:start", attempt=_attempt())
    time.sleep(seconds)
    _append(path, label=f"{label}:end", attempt=_attempt())
    raise RuntimeError(f"{label} failed after running")


@task(name="tests.record_async")
async def record_async(path: str, label: str) -> None:
    """An ``async def`` task: awaits, then records its job (the context reaches it)."""
    await asyncio.sleep(0.01)
    job = current_job()
    _append(path, label=label, event="ran", job=job.id if job else None, kind="async")


@task(name="tests.explode_async", max_retries=1, retry_backoff=[0.05])
async def explode_async(path: str, message: str) -> None:
    job = current_job()
    _append(path, label=message, event="attempt", attempt=job.attempt if job else None)
    raise RuntimeError(message)


# Time limits (tests/worker/test_time_limits.py): 0.3 s each; the tests set a short grace.


@task(name="tests.overrun", time_limit=0.3)
def overrun(path: str, label: str) -> None:
    """Runs Python code until TimeLimitExceeded stops it; cleans up, then lets it go."""
    from deferred import TimeLimitExceeded

    _append(path, label=label, event="start")
    try:
        while True:
            time.sleep(0.01)
    except TimeLimitExceeded:
        _append(path, label=label, event="cleanup")
        raise


@task(name="tests.stubborn", time_limit=0.3)
def stubborn(path: str, label: str, seconds: float) -> None:
    """Catches TimeLimitExceeded and goes on: only the hard limit ends it."""
    from deferred import TimeLimitExceeded

    _append(path, label=label, event="start")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except TimeLimitExceeded:
            _append(path, label=label, event="ignored")
    _append(path, label=label, event="end")


@task(name="tests.stubborn_retried", time_limit=0.3, max_retries=1, retry_backoff=[0.1])
def stubborn_retried(path: str, label: str, seconds: float) -> None:
    """Its first attempt ignores the soft limit and says it is alive every 50 ms for
    ``seconds``; the retry (0.1 s later) returns at once."""
    from deferred import TimeLimitExceeded

    attempt = _attempt()
    _append(path, label=label, event="start", attempt=attempt)
    end = time.monotonic() + (seconds if attempt == 1 else 0)
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
            _append(path, label=label, event="alive", attempt=attempt)
        except TimeLimitExceeded:
            pass


@task(name="tests.blocked", time_limit=0.3)
def blocked(path: str, label: str, seconds: float) -> None:
    """One C call that holds the thread for ``seconds``: no exception reaches it meanwhile."""
    _append(path, label=label, event="start")
    time.sleep(seconds)
    _append(path, label=label, event="end")


@task(name="tests.socket_read", time_limit=0.3)
def socket_read(path: str, label: str) -> None:
    """Reads a socket that never sends, with no timeout: the classic hung job."""
    import socket

    left, right = socket.socketpair()
    _append(path, label=label, event="start")
    try:
        left.recv(1)
    finally:
        left.close()
        right.close()
    _append(path, label=label, event="end")


@task(name="tests.overrun_async", time_limit=0.3)
async def overrun_async(path: str, label: str) -> None:
    """Cancelled at its await by the event loop at the limit; cleans up."""
    _append(path, label=label, event="start")
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        _append(path, label=label, event="cleanup")
        raise


@task(name="tests.overrun_once", time_limit=0.3, max_retries=1, retry_backoff=[0.1])
def overrun_once(path: str, label: str) -> None:
    """Its first attempt runs past the limit; the retry is quick."""
    attempt = _attempt()
    _append(path, label=label, event="attempt", attempt=attempt)
    if attempt == 1:
        while True:
            time.sleep(0.01)


@task(name="tests.unlimited", time_limit=None)
def unlimited(path: str, label: str, seconds: float) -> None:
    """No limit, whatever DEFERRED['TIME_LIMIT'] says."""
    _append(path, label=label, event="start")
    time.sleep(seconds)
    _append(path, label=label, event="end")


_hoard: list[bytearray] = []


@task(name="tests.hoard")
def hoard(path: str, label: str, mib: int) -> None:
    """Keeps ``mib`` MiB for good: the leak that --max-memory-per-child is for."""
    block = bytearray(mib * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])  # touched: resident, not just reserved
    _hoard.append(block)
    _append(path, label=label, event="ran")


@task(name="tests.gil_hog", time_limit=0.3)
def gil_hog(path: str, label: str, flag: str, seconds: float) -> None:
    """The first run holds the GIL in C code for ``seconds``: no thread of the process
    runs, its watchdog neither. Later runs (``flag`` exists) return at once."""
    import ctypes

    _append(path, label=label, event="start")
    if os.path.exists(flag):
        return
    open(flag, "w").close()
    ctypes.PyDLL(None).sleep(int(seconds))


@task(name="tests.add")
def add(a: int, b: int) -> int:
    return a + b


@task(name="tests.add_unrecorded", result=False)
def add_unrecorded(a: int, b: int) -> int:
    return a + b


@task(name="tests.returns_object")
def returns_object() -> object:
    return object()


@task(name="tests.fails_once_until_file", max_retries=0)
def fails_once_until_file(path: str, label: str, flag: str) -> str:
    """Fails (into the failed list at once, no retry) until ``flag`` exists, then
    returns ``label``: a job to re-drive once its cause is fixed."""
    _append(path, label=label, event="attempt", attempt=_attempt())
    if not os.path.exists(flag):
        raise FileNotFoundError(flag)
    return label
