"""Scenario: ``adefer()`` from async code, against ``sync_to_async(defer)``.

1,000 calls from 100 coroutines (10 each, one after the other) in one event
loop, every call published and confirmed; a ticker coroutine beside them
sleeps 1 ms at a time and records by how much each sleep overran: that is
the loop's lag, what every other request of an ASGI server would wait.
Measured for ``adefer()`` (its publishing threads), ``sync_to_async(defer)``
(Django's one sync thread), and plain ``defer()`` called in the loop (what
an async view did before ``adefer`` existed). With aio-pika installed, also
a bare aio-pika publisher (confirms on, no deferred at all): the ceiling an
async AMQP client could give.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.test import override_settings

from bench.common import Config, summary, topology
from bench.tasks import noop
from deferred import adefer, defer
from deferred.broker import admin_channel
from deferred.core.jobs import Job, new_job_id, utcnow

TICK_S = 0.001


async def _measure(
    call: Callable[[int], Awaitable[Any]], calls: int, coroutines: int
) -> dict[str, Any]:
    lags: list[float] = []
    latencies: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append((time.perf_counter() - before - TICK_S) * 1000)

    async def client(first: int) -> None:
        for k in range(first, calls, coroutines):
            started = time.perf_counter()
            await call(k)
            latencies.append((time.perf_counter() - started) * 1000)

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)  # the ticker's first laps, before any call
    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(coroutines)))
    elapsed = time.perf_counter() - started
    done.set()
    await ticking
    return {
        "jobs_per_s": calls / elapsed,
        "call_ms": summary(latencies),
        "loop_lag_ms": summary(lags),
    }


async def _blocking(k: int) -> None:
    defer(noop, 3600, k)


async def _aio_pika(
    url: str, exchange: str, routing_key: str, calls: int, coroutines: int
) -> dict[str, Any]:
    import aio_pika

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        target = await channel.get_exchange(exchange, ensure=False)

        async def publish(k: int) -> None:
            now = utcnow()
            body = Job(
                id=new_job_id(now),
                task="bench.noop",
                args=(k,),
                kwargs={},
                due=now,
                queue="default",
            ).encode()
            await target.publish(aio_pika.Message(body), routing_key=routing_key)

        return await _measure(publish, calls, coroutines)
    finally:
        await connection.close()


def _keep_best(out: dict[str, Any], name: str, result: dict[str, Any]) -> None:
    best = out.get(name)
    if best is None or result["jobs_per_s"] > best["jobs_per_s"]:
        out[name] = result


def run(p: dict[str, Any]) -> dict[str, Any]:
    config = Config()
    out: dict[str, Any] = {"calls": p["calls"], "coroutines": p["coroutines"]}
    with topology(config) as (prefix, plan):
        # Connections opened first: the first call of each thread connects.
        defer(noop, 3600, 0)
        asyncio.run(adefer(noop, 3600, 0))
        ways: dict[str, Callable[[int], Awaitable[Any]]] = {
            "adefer": lambda k: adefer(noop, 3600, k),
            "sync_to_async(defer)": lambda k: sync_to_async(defer)(noop, 3600, k),
            "defer in the loop": _blocking,
        }
        try:
            import aio_pika  # noqa: F401
        except ImportError:
            has_aio_pika = False
        else:
            has_aio_pika = True
        for _ in range(p["repeats"]):
            for name, call in ways.items():
                result = asyncio.run(_measure(call, p["calls"], p["coroutines"]))
                _keep_best(out, name, result)
            # ON_COMMIT on (the library's default): each call first asks the
            # sync thread whether a transaction is open there.
            with override_settings(
                DEFERRED={**config.deferred_settings(prefix), "ON_COMMIT": True}
            ):
                result = asyncio.run(_measure(ways["adefer"], p["calls"], p["coroutines"]))
                _keep_best(out, "adefer, ON_COMMIT on", result)
            if has_aio_pika:
                key = plan.routing_key(3_600_000, "default")
                result = asyncio.run(
                    _aio_pika(
                        config.urls[0], plan.ingest_exchange, key, p["calls"], p["coroutines"]
                    )
                )
                _keep_best(out, "aio-pika bare publish", result)
        with admin_channel(config.urls) as admin:
            for queue in plan.delay_queues:
                admin.channel.queue_purge(queue.name)
    return out
