"""Scenario: what signing costs, in ``defer()`` and in a worker's throughput.

Signed (the default) against unsigned (``SIGNING`` off and no key at all, so
nothing is signed nor checked), on the same broker in the same run: the
HMAC alone per message, ``defer()`` one call at a time (each confirmed), and
one worker process running jobs that are already due.
"""

from __future__ import annotations

import time
from typing import Any

from django.test import override_settings

from bench.common import Config, Worker, summary, topology, wait_until
from bench.tasks import noop
from deferred import defer, defer_many
from deferred.broker import admin_channel
from deferred.conf import get_settings
from deferred.core import signing
from deferred.core.jobs import Job, new_job_id, utcnow


def _unsigned(prefix: str, config: Config) -> Any:
    return override_settings(
        SECRET_KEY="", DEFERRED={**config.deferred_settings(prefix), "SIGNING": False}
    )


def _hmac_us(rounds: int) -> dict[str, float]:
    now = utcnow()
    body = Job(
        id=new_job_id(now),
        task="bench.noop",
        args=(12345,),
        kwargs={},
        due=now,
        queue="default",
        created=now,
    ).encode()
    keys = get_settings().signing_keys
    headers = signing.sign(body, keys)
    started = time.perf_counter()
    for _ in range(rounds):
        signing.sign(body, keys)
    sign_us = (time.perf_counter() - started) / rounds * 1e6
    started = time.perf_counter()
    for _ in range(rounds):
        signing.verify(body, headers, keys)
    verify_us = (time.perf_counter() - started) / rounds * 1e6
    return {"sign_us": sign_us, "verify_us": verify_us, "body_bytes": len(body)}


def _defer_ms(n: int) -> list[float]:
    times = []
    for k in range(n):
        started = time.perf_counter()
        defer(noop, 3600, k)
        times.append((time.perf_counter() - started) * 1000)
    return times


def _throughput(config: Config, prefix: str, plan: Any, n: int, signed: bool) -> float:
    for first in range(0, n, 1000):
        defer_many([(noop, 0, (k,)) for k in range(first, min(n, first + 1000))])
    ready = plan.ready_queues["default"].name
    with admin_channel(config.urls) as admin:
        wait_until(lambda: admin.message_count(ready) == n, 30)
        worker = Worker(config, prefix, 8, extra_env={} if signed else {"BENCH_SIGNING": "0"})
        wait_until(lambda: admin.message_count(ready) == 0, 300)
    ran = worker.stop()
    elapsed = max(at for _id, at, _l in ran) - min(at for _id, at, _l in ran)
    return len(ran) / max(elapsed, 1e-9)


def run(p: dict[str, Any]) -> dict[str, Any]:
    config = Config()
    out: dict[str, Any] = {}
    with topology(config) as (prefix, plan):
        out["hmac"] = _hmac_us(p["rounds"])
        signed_ms, unsigned_ms = [], []
        # Interleaved blocks, so that a slower moment of the machine hits both.
        for _ in range(4):
            signed_ms += _defer_ms(p["calls"] // 4)
            with _unsigned(prefix, config):
                unsigned_ms += _defer_ms(p["calls"] // 4)
        out["defer_signed_ms"] = summary(signed_ms)
        out["defer_unsigned_ms"] = summary(unsigned_ms)
        with admin_channel(config.urls) as admin:
            for queue in plan.delay_queues:
                admin.channel.queue_purge(queue.name)
    rates: dict[str, list[float]] = {"signed": [], "unsigned": []}
    for _ in range(p["repeats"]):
        for kind in ("signed", "unsigned"):
            with topology(config) as (prefix, plan):
                if kind == "signed":
                    rates[kind].append(_throughput(config, prefix, plan, p["jobs"], True))
                else:
                    with _unsigned(prefix, config):
                        rates[kind].append(_throughput(config, prefix, plan, p["jobs"], False))
    out["worker_per_s"] = {k: max(v) for k, v in rates.items()}
    out["worker_runs_per_s"] = rates
    out["jobs"] = p["jobs"]
    return out
