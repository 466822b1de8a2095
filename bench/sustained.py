"""Scenario 4: offered rate against lateness, per configuration and delay mix.

Producers call ``defer()`` at a fixed offered rate for a while; a worker
subprocess runs the jobs and notes how late each one ran. The achieved rate,
the hops per job (from the plan) and the broker's CPU use go beside the
lateness percentiles.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.common import Config, Worker, broker_pids, cpu_meter, summary, topology
from bench.tasks import noop
from deferred import defer
from deferred.core.topology import Plan

#: Real-world delays, in seconds; run scaled down by HUMAN_SCALE.
HUMAN_DELAYS = [30, 60, 300, 3600, 86400]
HUMAN_SCALE = 1 / 1000
#: An exponential retry schedule (1 s doubling to 2 min), scaled down like the human mix.
RETRY_DELAYS = [1, 2, 4, 8, 16, 32, 64, 120]
RETRY_SCALE = 1 / 20
#: Jobs run before each measured point and left out of it (see ``_warm_up``).
WARM_UP_JOBS = 200
#: The longest delay a warm-up job gets, in seconds.
WARM_UP_MAX_DELAY = 1.0


def mixes() -> dict[str, Callable[[random.Random], float]]:
    return {
        "uniform 0-5 s": lambda rng: rng.uniform(0, 5),
        "uniform 0-0.5 s": lambda rng: rng.uniform(0, 0.5),
        "human (30 s-1 day, x1/1000)": lambda rng: rng.choice(HUMAN_DELAYS) * HUMAN_SCALE,
        "retry backoff (1-120 s, x1/20)": lambda rng: rng.choice(RETRY_DELAYS) * RETRY_SCALE,
    }


def hops_for_real_delays(plan: Plan) -> dict[str, int]:
    """Hop counts the plan gives the unscaled human delays."""
    return {f"{d} s": plan.hops(d * 1000) for d in HUMAN_DELAYS}


def _produce(
    rate: float,
    seconds: float,
    delay_of: Callable[[random.Random], float],
    threads: int,
    delays: list[float],
) -> float:
    """Defer at ``rate`` jobs/s from ``threads`` threads; return the achieved rate."""
    per_thread = rate / threads
    count = int(per_thread * seconds)
    start = time.perf_counter()

    def loop(seed: int) -> None:
        rng = random.Random(seed)
        for n in range(count):
            target = start + n / per_thread
            pause = target - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            delay = delay_of(rng)
            delays.append(delay)
            defer(noop, delay, n)

    workers = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return count * threads / (time.perf_counter() - start)


def _warm_up(delay_of: Callable[[random.Random], float]) -> set[str]:
    """Run a few jobs of the same mix through a fresh topology and worker; return their ids.

    The first point measured after a fresh topology and worker paid for
    connections, channels and the worker's first imports: its p99 was the
    worst of its run for no reason of the load. These jobs take those costs
    and are left out of the point.
    """
    rng = random.Random(-1)
    ids = {defer(noop, min(delay_of(rng), WARM_UP_MAX_DELAY), n) for n in range(WARM_UP_JOBS)}
    time.sleep(WARM_UP_MAX_DELAY + 1.0)
    return ids


def run_point(
    config: Config, mix: str, rate: float, seconds: float, concurrency: int = 4
) -> dict[str, Any]:
    delay_of = mixes()[mix]
    with topology(config) as (prefix, plan):
        worker = Worker(config, prefix, concurrency)
        warm = _warm_up(delay_of)
        delays: list[float] = []
        with cpu_meter(broker_pids(config.urls)) as cpu:
            achieved = _produce(rate, seconds, delay_of, threads=4, delays=delays)
            # Let the last jobs come due and run.
            worker.wait_for_runs(len(warm) + len(delays), max(delays, default=0))
        ran = [row for row in worker.stop() if row[0] not in warm]
    lateness = [late for _id, _at, late in ran]
    hops = [plan.hops(int(d * 1000)) for d in delays]
    return {
        "config": config.label,
        "mix": mix,
        "offered_per_s": rate,
        "achieved_per_s": achieved,
        "jobs": len(delays),
        "ran": len(ran),
        "early": sum(1 for late in lateness if late < 0),
        "hops_mean": sum(hops) / len(hops) if hops else 0,
        "lateness_ms": summary(lateness),
        **cpu,
    }


def run(
    configs: list[Config], rates: list[float], mixes_to_run: list[str], seconds: float
) -> list[dict[str, Any]]:
    points = []
    for config in configs:
        for mix in mixes_to_run:
            for rate in rates:
                point = run_point(config, mix, rate, seconds)
                points.append(point)
                print(
                    f"  {config.label:22} {mix:32} offered {rate:6.0f}/s achieved "
                    f"{point['achieved_per_s']:6.0f}/s p99 {point['lateness_ms']['p99']:8.1f} ms "
                    f"cpu {point.get('broker_cpu_pct', float('nan')):5.0f}%",
                    flush=True,
                )
                # Past saturation, higher rates only take longer to say the same.
                saturated = point["achieved_per_s"] < 0.9 * rate
                if saturated or point["lateness_ms"]["p99"] > 2000 or point["ran"] < point["jobs"]:
                    break
    return points
