"""Cancels: what a cancel costs, how fast every worker knows it, and worker memory.

- The cost of a ``cancel()`` call (one id, confirmed), one after the other, and
  of ``cancel_many()`` of 1,000 ids.
- Propagation: three readers in three processes (the worker's own
  ``CancelWatch``), each noting when it read each id; the figure is, per
  cancel, the time from ``cancel()`` returning to the *last* reader knowing it.
- The race: jobs cancelled a moment before they are due (100, 10 and 2 ms),
  with a worker running; how many of them ran anyway (the promise: none, for a
  cancel that returned before the due time).
- Worker memory: the RSS of a worker process started on an empty stream, and
  of one started after ``n_force`` cancels of pending jobs (due in an hour),
  once it logged that it read them; and how long that read took.
"""

from __future__ import annotations

import multiprocessing
import re
import time
from datetime import timedelta
from typing import Any

from bench.common import Config, Worker, summary, topology, wait_until
from bench.tasks import noop
from deferred import cancel, cancel_many, defer
from deferred.conf import get_settings
from deferred.core.jobs import new_job_id, utcnow
from deferred.records.cancels import decode, marker_of
from deferred.worker.cancel_watch import CancelWatch

READ = re.compile(r"Read the cancels: (\d+) in force \(([\d.]+) s\)")


class _TimedWatch(CancelWatch):
    """The worker's reader, noting when each id was read."""

    seen: dict[str, float]

    def _on_message(self, offset: int, body: bytes, headers: dict[str, Any]) -> None:
        super()._on_message(offset, body, headers)
        now = time.time()
        if marker_of(body) is None:
            for job_id in decode(body)[0]:
                self.seen.setdefault(job_id, now)


def _reader(settings: Any, ready: Any, done: Any, out: Any) -> None:
    watch = _TimedWatch(settings)
    watch.seen = {}
    watch.start()
    watch.connected.wait(30)
    ready.set()
    done.wait(120)
    time.sleep(0.5)
    watch.stop()
    out.put(watch.seen)


def run(p: dict[str, Any]) -> dict[str, Any]:
    config = Config(16)
    out: dict[str, Any] = {}
    with topology(config) as (prefix, _plan):
        settings = get_settings()
        # Worker memory: a worker started on an empty stream, then one started on
        # n_force cancels of pending jobs (one topology, so one declare).
        _memory(config, prefix, "empty", out)
        ids = [new_job_id(utcnow() + timedelta(hours=1)) for _ in range(p["n_force"])]
        for start in range(0, len(ids), 10_000):
            cancel_many(ids[start : start + 10_000])
        _memory(config, prefix, "in_force", out)
        grown = out["worker_rss_mb_in_force"] - out["worker_rss_mb_empty"]
        out["bytes_per_cancel"] = grown * 1024 * 1024 / max(1, p["n_force"])
        out["n_force"] = p["n_force"]
        out.update(_cost(p["calls"]))
        out.update(_propagation(settings, p["propagation"]))
        out.update(_race(config, prefix, p["race"]))
    return out


def _memory(config: Config, prefix: str, label: str, out: dict[str, Any]) -> None:
    worker = Worker(config, prefix, 1)
    try:
        wait_until(lambda: READ.search(worker.log()) is not None, 120, 0.05)
        match = READ.search(worker.log())
        time.sleep(1.0)
        out[f"worker_rss_mb_{label}"] = worker.rss_mb()
        if match:
            out[f"worker_read_{label}"] = {"in_force": int(match[1]), "seconds": float(match[2])}
    finally:
        worker.stop()


def _cost(calls: int) -> dict[str, Any]:
    pending = [new_job_id(utcnow() + timedelta(hours=1)) for _ in range(calls)]
    cancel(pending[0])  # the connection is open from here on
    costs = []
    for job_id in pending[1:]:
        started = time.perf_counter()
        cancel(job_id)
        costs.append((time.perf_counter() - started) * 1000)
    batch = [new_job_id(utcnow() + timedelta(hours=1)) for _ in range(1000)]
    started = time.perf_counter()
    cancel_many(batch)
    return {
        "cancel_ms": summary(costs),
        "cancel_many_1000_ms": (time.perf_counter() - started) * 1000,
    }


def _propagation(settings: Any, count: int) -> dict[str, Any]:
    """Three readers in three processes; per cancel, until the last one has it."""
    context = multiprocessing.get_context("fork")
    ready = [context.Event() for _ in range(3)]
    done = context.Event()
    queue = context.Queue()
    readers = [
        context.Process(target=_reader, args=(settings, ready[n], done, queue)) for n in range(3)
    ]
    for reader in readers:
        reader.start()
    for event in ready:
        event.wait(60)
    returned: dict[str, float] = {}
    for _ in range(count):
        job_id = new_job_id(utcnow() + timedelta(hours=1))
        cancel(job_id)
        returned[job_id] = time.time()
        time.sleep(0.02)
    done.set()
    seen = [queue.get(timeout=60) for _ in readers]
    for reader in readers:
        reader.join(30)
    last = [
        (max(s.get(job_id, float("inf")) for s in seen) - at) * 1000
        for job_id, at in returned.items()
    ]
    return {
        "propagation_ms": summary(last),
        "propagation_missed": sum(1 for v in last if v == float("inf")),
    }


def _race(config: Config, prefix: str, per_lead: int) -> dict[str, Any]:
    """Jobs each cancelled `lead` seconds before they are due, a worker running."""
    worker = Worker(config, prefix, 4)
    cancelled: set[str] = set()
    late_cancels = 0
    try:
        for lead in (0.1, 0.01, 0.002):
            for _ in range(per_lead):
                due = time.time() + 0.2
                job_id = defer(noop, 0.2)
                time.sleep(max(0.0, due - lead - time.time()))
                cancel(job_id)
                if time.time() >= due:
                    late_cancels += 1  # returned after the due time: not a race
                else:
                    cancelled.add(job_id)
        time.sleep(1.0)
    finally:
        ran = {job_id for job_id, _at, _late in worker.stop()}
    return {
        "race_leads_ms": [100, 10, 2],
        "race_cancelled_in_time": len(cancelled),
        "race_late_cancels": late_cancels,
        "race_ran_anyway": len(cancelled & ran),
    }
