"""Run the benchmarks and write ``docs/bench/``: results.json, README.md and plots.

python -m bench [--quick] [--only raw,latency,dispatch,sustained,scale,alternatives,operate,
                                 schedules,cancels,signing,async,processes,cluster,releases]

The cluster scenario runs on the local three-node cluster (scripts/local-cluster.sh),
which it starts if it does not run (and then stops at the end); --smoke leaves it out.
The releases scenario runs RabbitMQ 4.3 beside the system broker
(scripts/rabbitmq-release.sh 4.3 start), which it starts if it does not run (and then
stops at the end); --smoke runs it on the system broker alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = [
    "raw",
    "latency",
    "dispatch",
    "sustained",
    "scale",
    "alternatives",
    "operate",
    "schedules",
    "cancels",
    "signing",
    "async",
    "processes",
    "cluster",
    "releases",
]


def parameters(quick: bool, smoke: bool = False) -> dict[str, Any]:
    from bench.common import Config

    if smoke:  # the test suite's check that the benchmarks still run
        return {
            "raw": 200,
            "latency": 30,
            "dispatch": 200,
            "dispatch_concurrency": (2,),
            "sustained_configs": [Config(16)],
            "sustained_rates": [50],
            "sustained_mixes": ["uniform 0-0.5 s"],
            "sustained_seconds": 1,
            "mix_configs": [],
            "mix_rates": [],
            "scale": 500,
            "alt_jobs": 20,
            "alt_delay_s": 0.3,
            "alt_polls": [0.2],
            "celery": None,
            "operate": (20, 20, 20),
            "schedules": {"steady_s": 4, "after_s": 3},
            "cancels": {"calls": 20, "propagation": 10, "race": 5, "n_force": 1000},
            "signing": {"rounds": 1000, "calls": 40, "jobs": 200, "repeats": 1},
            "async": {"calls": 100, "coroutines": 10, "repeats": 1},
            "processes": {"jobs": 20, "work": 10_000, "counts": (1, 2)},
            "cluster": None,  # the smoke run needs no cluster
            # Nor a second broker: the system broker alone, one point.
            "releases": {
                "brokers": ["system"],
                "queue_types": ["classic"],
                "rates": [50],
                "mix": "uniform 0-0.5 s",
                "seconds": 1,
                "rounds": 1,
                "raw": 200,
                "warm_up": False,
            },
        }
    if quick:
        return {
            "raw": 5000,
            "latency": 500,
            "dispatch": 3000,
            "dispatch_concurrency": (1, 8),
            "sustained_configs": [Config(2), Config()],
            "sustained_rates": [100, 500],
            "sustained_mixes": ["uniform 0-5 s"],
            "sustained_seconds": 3,
            "mix_configs": [],
            "mix_rates": [],
            "scale": 20_000,
            "alt_jobs": 300,
            "alt_delay_s": 2.0,
            "alt_polls": [1.0],
            "operate": (300, 200, 1000),
            "schedules": {"steady_s": 20, "after_s": 10},
            "cancels": {"calls": 300, "propagation": 100, "race": 50, "n_force": 100_000},
            "signing": {"rounds": 100_000, "calls": 1000, "jobs": 5000, "repeats": 2},
            "async": {"calls": 1000, "coroutines": 100, "repeats": 2},
            "processes": {"jobs": 200, "work": 300_000, "counts": (1, 2)},
            "celery": {"eta_pending": 5000, "timeout": None, "rates": [100], "seconds": 3},
            "cluster": {
                "rates": [100, 400],
                "seconds": 3,
                "failover": {
                    "repeats": 1,
                    "kinds": ["worker", "leader"],
                    "rate": 100,
                    "max_delay_s": 1.0,
                    "before_s": 5,
                    "down_s": 5,
                    "after_s": 5,
                },
            },
            "releases": {
                "brokers": ["system", "4.3"],
                "queue_types": ["classic", "quorum"],
                "rates": [100, 500],
                "mix": "uniform 0-5 s",
                "seconds": 3,
                "rounds": 1,
                "raw": 5000,
                "warm_up": True,
            },
        }
    return {
        "raw": 20_000,
        "latency": 2000,
        "dispatch": 20_000,
        "dispatch_concurrency": (1, 4, 8),
        "sustained_configs": [
            Config(2),
            Config(4),
            Config(8),
            Config(10),
            Config(16),
            Config(2, 1.0),
            Config(16, 1.0),
            Config(16, 0.01),
            Config(2, queue_type="quorum"),
            Config(16, queue_type="quorum"),
        ],
        "sustained_rates": [100, 300, 500, 800, 1200, 1600],
        "sustained_mixes": ["uniform 0-5 s"],
        "sustained_seconds": 8,
        "mix_configs": [Config(2), Config()],
        "mix_rates": [100, 500],
        "scale": 1_000_000,
        "alt_jobs": 500,
        "alt_delay_s": 5.0,
        "alt_polls": [1.0, 60.0],
        "operate": (2000, 1000, 1000),
        "schedules": {"steady_s": 120, "after_s": 30},
        "cancels": {"calls": 1000, "propagation": 300, "race": 200, "n_force": 100_000},
        "signing": {"rounds": 200_000, "calls": 4000, "jobs": 20_000, "repeats": 3},
        "async": {"calls": 1000, "coroutines": 100, "repeats": 5},
        "processes": {"jobs": 400, "work": 300_000, "counts": (1, 2)},
        "celery": {
            "eta_pending": 100_000,
            "timeout": (5000, 90.0, 20),
            "rates": [100, 300],
            "seconds": 8,
        },
        "cluster": {
            "rates": [50, 100, 200, 400],
            "seconds": 8,
            "failover": {
                "repeats": 3,
                # The node the worker consumes from; the busiest leader of the other two.
                "kinds": ["worker", "leader"],
                "rate": 100,
                "max_delay_s": 1.0,
                "before_s": 10,
                "down_s": 15,
                "after_s": 10,
            },
        },
        "releases": {
            "brokers": ["system", "4.3"],
            "queue_types": ["classic", "quorum"],
            "rates": [100, 300, 500, 800],
            "mix": "uniform 0-5 s",
            "seconds": 8,
            # Two rounds: the spread between them shows the machine's noise.
            "rounds": 2,
            "raw": 20_000,
            "warm_up": True,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes: about 10 minutes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from bench import (
        alternatives,
        asyncdefer,
        cancels,
        cluster,
        dispatch,
        latency,
        operate,
        processes,
        raw,
        releases,
        report,
        scale,
        schedules,
        signing,
        sustained,
    )

    chosen = [s for s in args.only.split(",") if s]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    p = parameters(args.quick, args.smoke)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if results_path.exists() else {}
    results["meta"] = {
        "command": "python -m bench"
        + (" --quick" if args.quick else "")
        + ("" if chosen == SCENARIOS else f" --only {','.join(chosen)}"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "rabbitmq": _rabbitmq_version(),
        "quick": args.quick,
        "smoke": args.smoke,
    }

    def step(name: str, fn: Any) -> None:
        if name not in chosen:
            return
        print(f"== {name}", flush=True)
        started = time.monotonic()
        results[name] = fn()
        results[name + "_seconds"] = round(time.monotonic() - started, 1)
        results_path.write_text(json.dumps(results, indent=1, default=str))

    step("raw", lambda: raw.run(p["raw"]))
    step("latency", lambda: latency.run(p["latency"]))
    step("dispatch", lambda: dispatch.run(p["dispatch"], p["dispatch_concurrency"]))

    def run_sustained() -> dict[str, Any]:
        points = sustained.run(
            p["sustained_configs"],
            p["sustained_rates"],
            p["sustained_mixes"],
            p["sustained_seconds"],
        )
        other_mixes = [m for m in sustained.mixes() if m not in p["sustained_mixes"]]
        if p["mix_configs"]:
            points += sustained.run(
                p["mix_configs"], p["mix_rates"], other_mixes, p["sustained_seconds"]
            )
        from deferred.core.topology import build_plan

        hops = {}
        for config in p["sustained_configs"]:
            plan = build_plan(
                prefix="x",
                radix=config.radix,
                resolution_ms=max(1, round(config.resolution_s * 1000)),
                max_delay_ms=400 * 86400 * 1000,
                queue_type=config.queue_type,
                queues=("default",),
            )
            hops[config.label] = sustained.hops_for_real_delays(plan)
        return {"points": points, "human_delay_hops": hops}

    step("sustained", run_sustained)
    step("scale", lambda: scale.run(p["scale"]))
    step(
        "alternatives",
        lambda: {
            "per_message_ttl": alternatives.per_message_ttl(p["alt_jobs"], p["alt_delay_s"]),
            "queue_per_delay": alternatives.queue_per_delay(p["alt_jobs"], p["alt_delay_s"]),
            "table_scan": [
                alternatives.table_scan(p["alt_jobs"], p["alt_delay_s"] * 2, poll)
                for poll in p["alt_polls"]
            ],
            "celery": _celery(p["celery"]),
        },
    )
    step("operate", lambda: operate.run(*p["operate"]))
    step("schedules", lambda: schedules.run(p["schedules"]))
    step("cancels", lambda: cancels.run(p["cancels"]))
    step("signing", lambda: signing.run(p["signing"]))
    step("async", lambda: asyncdefer.run(p["async"]))
    step("processes", lambda: processes.run(p["processes"]))
    # Last: it starts three more brokers on this machine (and stops them if it started them).
    if p["cluster"] is None:
        if "cluster" in chosen:
            print("== cluster: skipped (the smoke run needs no cluster)", flush=True)
    else:
        step("cluster", lambda: cluster.run(p["cluster"]))
    # It starts RabbitMQ 4.3 beside the system broker (and stops it if it started it).
    step("releases", lambda: releases.run(p["releases"]))
    report.write(results, out_dir)
    print(f"Report: {out_dir / 'README.md'}")
    return 0


def _celery(p: dict[str, Any] | None) -> dict[str, Any] | None:
    """Celery in both of its modes, when it is installed (``pip install .[bench]``)."""
    if p is None:
        return None
    try:
        from bench import celery_peer
    except ImportError:
        print("  celery is not installed: skipped (pip install -e '.[bench]')", flush=True)
        return None
    out: dict[str, Any] = {"eta_memory": celery_peer.eta_memory(p["eta_pending"])}
    if p["timeout"]:
        out["consumer_timeout"] = celery_peer.consumer_timeout(*p["timeout"])
    out["native"] = [celery_peer.native_delayed_delivery(rate, p["seconds"]) for rate in p["rates"]]
    return out


def _rabbitmq_version() -> str:
    try:
        found = subprocess.run(
            ["rabbitmqctl", "version"], capture_output=True, text=True, timeout=30
        )
        return found.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
