"""Recurring jobs: lateness of a 1-s schedule with three workers, and a scheduler kill.

Three worker processes (concurrency 2) on one broker, ``bench.tick`` scheduled
every second (DEFERRED['SCHEDULES']). Lateness is run time minus the scheduled
occurrence. Then the scheduling worker is SIGKILLed: takeover is the time
from the kill to another worker's log line saying it schedules; occurrences
are checked for gaps and duplicates over the whole run.
"""

from __future__ import annotations

import itertools
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import Config, Worker, topology, wait_until

LEADS = "now schedules the recurring jobs"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(len(ordered) * q) - 1)] if ordered else float("nan")


def run(p: dict[str, Any]) -> dict[str, Any]:
    config = Config(16)
    ticks = Path(tempfile.mkstemp(prefix="bench-ticks-")[1])
    env = {"BENCH_EVERY_S": "1", "BENCH_TICKS": str(ticks)}
    with topology(config) as (prefix, _plan):
        workers = [Worker(config, prefix, 2, extra_env=env) for _ in range(3)]
        try:
            started = time.time()
            time.sleep(p["steady_s"])
            leaders = [w for w in workers if LEADS in w.log()]
            takeover = None
            killed_at = None
            if len(leaders) == 1:
                victim = leaders[0]
                killed_at = time.time()
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(10)
                others = [w for w in workers if w is not victim]
                if wait_until(lambda: any(LEADS in w.log() for w in others), 30, 0.01):
                    takeover = time.time() - killed_at
                time.sleep(p["after_s"])
            ended = time.time()
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.send_signal(signal.SIGTERM)
            for w in workers:
                w.proc.wait(60)
    rows = []
    for line in ticks.read_text().splitlines():
        job_id, occurrence, at, pid = line.split()
        rows.append((job_id, float(occurrence), float(at), int(pid)))
    ticks.unlink(missing_ok=True)
    counts = Counter(occurrence for _id, occurrence, _at, _pid in rows)
    instants = sorted(counts)
    gaps = sum(round(b - a) - 1 for a, b in itertools.pairwise(instants))
    steady = [
        (at - occurrence) * 1000
        for _id, occurrence, at, _pid in rows
        if killed_at is None or occurrence < killed_at
    ]
    after = [
        (at - occurrence) * 1000
        for _id, occurrence, at, _pid in rows
        if killed_at is not None and occurrence >= killed_at
    ]
    return {
        "workers": 3,
        "period_s": 1,
        "seconds": round(ended - started, 1),
        "leaders_before_kill": len(leaders),
        "occurrences": len(instants),
        "runs": len(rows),
        "duplicated": sum(1 for n in counts.values() if n > 1),
        "gaps": gaps,
        "early": sum(1 for _id, occurrence, at, _pid in rows if at < occurrence),
        "lateness_ms": {
            "p50": round(statistics.median(steady), 1) if steady else None,
            "p99": round(_percentile(steady, 0.99), 1) if steady else None,
            "max": round(max(steady), 1) if steady else None,
        },
        "after_kill_lateness_ms": {
            "p50": round(statistics.median(after), 1) if after else None,
            "p99": round(_percentile(after, 0.99), 1) if after else None,
            "max": round(max(after), 1) if after else None,
        },
        "takeover_s": None if takeover is None else round(takeover, 3),
    }
