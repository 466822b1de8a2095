"""Scenario 2: how long ``defer()`` takes in the caller, and ``defer_many()``'s throughput."""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.common import Config, summary, topology
from bench.tasks import noop
from deferred import defer, defer_many


def _timed_defers(count: int, out: list[float]) -> None:
    for n in range(count):
        start = time.perf_counter()
        defer(noop, 3600, n)
        out.append((time.perf_counter() - start) * 1000)


def run(n: int) -> dict[str, Any]:
    with topology(Config()) as (_prefix, _plan):
        defer(noop, 3600, 0)  # connect first: the first call pays for it
        one: list[float] = []
        start = time.perf_counter()
        _timed_defers(n, one)
        one_rate = n / (time.perf_counter() - start)

        per_thread: list[list[float]] = [[] for _ in range(8)]
        threads = [
            threading.Thread(target=_timed_defers, args=(max(1, n // 8), per_thread[t]))
            for t in range(8)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        eight_elapsed = time.perf_counter() - start
        eight = [v for values in per_thread for v in values]

        batch = 1000
        bulk_n = max(batch, n * 5)
        start = time.perf_counter()
        for first in range(0, bulk_n, batch):
            defer_many([(noop, 3600, (k,)) for k in range(first, first + batch)])
        bulk_rate = bulk_n / (time.perf_counter() - start)
    return {
        "one_thread_ms": summary(one),
        "one_thread_per_s": one_rate,
        "eight_threads_ms": summary(eight),
        "eight_threads_per_s": len(eight) / eight_elapsed,
        "defer_many_batch": batch,
        "defer_many_per_s": bulk_rate,
        "one_thread_samples_ms": one,
    }
