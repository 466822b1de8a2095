"""Scenario: CPU-bound jobs at 1 and 2 worker processes (``--processes``).

The same number of jobs, each ``work`` rounds of pure-Python arithmetic,
already due when the worker starts; jobs/s from the first job's end to the
last's. Threads (``--concurrency 2``) in one process are measured too: the
GIL lets them use one core between them.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import Config, Worker, topology, wait_until
from bench.tasks import burn
from deferred import defer_many
from deferred.broker import admin_channel


def _rate(config: Config, jobs: int, work: int, processes: int, concurrency: int) -> float:
    with topology(config) as (prefix, plan):
        defer_many([(burn, 0, (work,)) for _ in range(jobs)])
        ready = plan.ready_queues["default"].name
        with admin_channel(config.urls) as admin:
            wait_until(lambda: admin.message_count(ready) == jobs, 30)
            started = time.monotonic()
            worker = Worker(config, prefix, concurrency, extra_args=("--processes", str(processes)))
            wait_until(lambda: admin.message_count(ready) == 0, 600)
        # The last jobs were taken; give them time to finish before stopping.
        time.sleep(max(1.0, (time.monotonic() - started) / jobs * 4))
        ran = worker.stop()
    if len(ran) < 2:
        return float("nan")
    ends = sorted(at for _id, at, _late in ran)
    return (len(ends) - 1) / max(ends[-1] - ends[0], 1e-9)


def run(p: dict[str, Any]) -> dict[str, Any]:
    config = Config()
    out: dict[str, Any] = {"jobs": p["jobs"], "work": p["work"], "jobs_per_s": {}}
    for processes in p["counts"]:
        out["jobs_per_s"][f"{processes} process(es) x 1 thread"] = _rate(
            config, p["jobs"], p["work"], processes, 1
        )
    out["jobs_per_s"]["1 process x 2 threads"] = _rate(config, p["jobs"], p["work"], 1, 2)
    return out
