"""Scenario 7: the operating features' costs.

- ``.enqueue()`` through the django.tasks backend against ``defer()``, in the
  caller, and the django.tasks jobs' lateness through the worker;
- what one ``deferred_status`` read (and so one status page view) costs, with
  no failed job and with a thousand.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any

from bench.common import Config, Worker, summary, topology
from bench.tasks import framework_noop, noop
from deferred import defer
from deferred.conf import get_settings
from deferred.core.jobs import Job, utcnow
from deferred.operate import status
from deferred.records import failures


def _timed(call: Any, n: int) -> list[float]:
    call(0)  # connect first: the first call pays for it
    out = []
    for k in range(n):
        start = time.perf_counter()
        call(k)
        out.append((time.perf_counter() - start) * 1000)
    return out


def _status_ms(reads: int) -> list[float]:
    settings = get_settings()
    out = []
    for _ in range(reads):
        start = time.perf_counter()
        status.collect(settings)
        out.append((time.perf_counter() - start) * 1000)
    return out


def run(n: int, late_jobs: int, failed: int) -> dict[str, Any]:
    if framework_noop is None:
        return {"skipped": "neither django.tasks nor django-tasks is installed"}
    config = Config()
    results: dict[str, Any] = {}
    with topology(config) as (prefix, _plan):
        hour = timedelta(hours=1)
        results["defer_ms"] = summary(_timed(lambda k: defer(noop, hour, k), n))
        results["enqueue_ms"] = summary(
            _timed(lambda k: framework_noop.using(run_after=utcnow() + hour).enqueue(k), n)
        )

        worker = Worker(config, prefix, concurrency=4)
        for k in range(late_jobs):
            wait = timedelta(seconds=random.uniform(0, 2))
            framework_noop.using(run_after=utcnow() + wait).enqueue(k)
        worker.wait_for_runs(late_jobs, 0, 30)
        rows = worker.stop()
        results["enqueue_lateness_ms"] = summary([late for _id, _at, late in rows])
        results["enqueue_jobs_run"] = len(rows)
        results["enqueue_jobs"] = late_jobs

        results["status_pending"] = 2 * n  # the jobs deferred an hour ahead above
        results["status_no_failed_ms"] = summary(_status_ms(20))
        settings = get_settings()
        now = utcnow()
        for k in range(failed):
            job = Job(
                id=f"{k:032x}", task="bench.noop", args=(k,), kwargs={}, due=now, queue="default"
            )
            record = failures.failure_record(
                reason=failures.TASK_ERROR, job=job, body=job.encode(), error=RuntimeError("x")
            )
            failures.store_failure(settings, record)
        results["status_failed"] = failed
        results["status_with_failed_ms"] = summary(_status_ms(20))
    return results
