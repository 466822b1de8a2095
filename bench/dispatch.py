"""Scenario 3: how fast one worker process runs no-op jobs that are already due."""

from __future__ import annotations

from typing import Any

from bench.common import Config, Worker, topology, wait_until
from bench.tasks import noop
from deferred import defer_many
from deferred.broker import admin_channel


def run(n: int, concurrencies: tuple[int, ...] = (1, 8)) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs": n}
    config = Config()
    for concurrency in concurrencies:
        with topology(config) as (prefix, plan):
            for first in range(0, n, 1000):
                defer_many([(noop, 0, (k,)) for k in range(first, min(n, first + 1000))])
            ready = plan.ready_queues["default"].name
            with admin_channel(config.deferred_settings(prefix)["BROKER_URL"]) as admin:
                wait_until(lambda: admin.message_count(ready) == n, 30)  # noqa: B023
                # The worker logs its line per job, as in production.
                worker = Worker(config, prefix, concurrency)
                wait_until(lambda: admin.message_count(ready) == 0, 300)  # noqa: B023
            ran = worker.stop()
            elapsed = max(at for _id, at, _l in ran) - min(at for _id, at, _l in ran)
            out[f"concurrency_{concurrency}_per_s"] = len(ran) / max(elapsed, 1e-9)
            out[f"concurrency_{concurrency}_ran"] = len(ran)
    return out
