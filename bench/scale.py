"""Scenario 5: many pending jobs with long delays.

Publish time, broker memory and disk while they wait, the worker's memory
(it must not grow: it holds nothing that is pending), and a sample of short
jobs deferred among them that must still run, on time and once.
"""

from __future__ import annotations

import random
import subprocess
import time
from typing import Any

from bench.common import BROKER_URL, Config, Worker, broker_pid, rss_mb, topology
from bench.tasks import noop
from deferred import defer_many
from deferred.broker import admin_channel


def _broker_disk_mb() -> float:
    found = subprocess.run(
        ["du", "-sm", "/var/lib/rabbitmq/mnesia"], capture_output=True, text=True
    )
    return float(found.stdout.split()[0]) if found.returncode == 0 else float("nan")


def run(pending: int, config: Config | None = None) -> dict[str, Any]:
    config = config or Config()
    rng = random.Random(7)
    pid = broker_pid()
    out: dict[str, Any] = {"pending": pending, "config": config.label}
    with topology(config) as (prefix, plan):
        worker = Worker(config, prefix, concurrency=4)
        out["broker_rss_mb_before"] = rss_mb(pid) if pid else float("nan")
        out["broker_disk_mb_before"] = _broker_disk_mb()
        samples = [(0, worker.rss_mb())]
        batch = 2000
        start = time.perf_counter()
        for first in range(0, pending, batch):
            count = min(batch, pending - first)
            # Between one and thirty days: nothing comes due during the run.
            defer_many([(noop, rng.uniform(86400, 30 * 86400), (k,)) for k in range(count)])
            if (first // batch) % max(1, pending // batch // 10) == 0:
                samples.append((first + count, worker.rss_mb()))
        out["publish_seconds"] = time.perf_counter() - start
        out["publish_per_s"] = pending / out["publish_seconds"]
        samples.append((pending, worker.rss_mb()))
        out["worker_rss_mb"] = samples
        with admin_channel(BROKER_URL) as admin:
            waiting = admin.pending(plan) or 0
        out["waiting_in_delay_queues"] = waiting
        out["lost"] = pending - waiting
        out["broker_rss_mb_after"] = rss_mb(pid) if pid else float("nan")
        out["broker_disk_mb_after"] = _broker_disk_mb()

        # A sample of short jobs among them: all run, once, none early.
        ids = defer_many([(noop, rng.uniform(0.1, 2.0), (k,)) for k in range(200)])
        worker.wait_for_runs(len(ids), 2.0)  # the longest delay of the sample
        ran = worker.stop()
        ran_ids = [job_id for job_id, _at, _late in ran]
        out["sample"] = {
            "deferred": len(ids),
            "ran": len(set(ran_ids) & set(ids)),
            "duplicates": len(ran_ids) - len(set(ran_ids)),
            "early": sum(1 for _id, _at, late in ran if late < 0),
            "p99_lateness_ms": sorted(late for _i, _a, late in ran)[int(0.99 * len(ran)) - 1]
            if ran
            else float("nan"),
        }
    return out
