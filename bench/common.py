"""What every scenario needs: statistics, process metrics, a worker subprocess,
and a throwaway topology per configuration."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.management import call_command
from django.test import override_settings

from deferred.broker import admin_channel
from deferred.conf import DEFAULTS, get_settings
from deferred.topology import Plan, plan_topology

ROOT = Path(__file__).resolve().parent.parent
BROKER_URL = os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
        "mean": statistics.fmean(values) if values else float("nan"),
    }


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def broker_pid() -> int | None:
    """The RabbitMQ (Erlang VM) process, if it runs on this machine."""
    found = subprocess.run(["pgrep", "-f", "beam.smp.*rabbit"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    return pids[0] if pids else None


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time used so far by ``pid`` (0 if unknown)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_meter() -> Iterator[dict[str, float]]:
    """Broker CPU use over the block, in percent of one core."""
    pid = broker_pid()
    start_cpu, start = cpu_seconds(pid), time.monotonic()
    out: dict[str, float] = {}
    yield out
    elapsed = time.monotonic() - start
    out["broker_cpu_pct"] = 100 * (cpu_seconds(pid) - start_cpu) / elapsed if pid else float("nan")


@dataclass(frozen=True)
class Config:
    """One configuration to measure; the defaults are the library's defaults."""

    radix: int = DEFAULTS["RADIX"]
    resolution_s: float = DEFAULTS["RESOLUTION"].total_seconds()
    queue_type: str = DEFAULTS["QUEUE_TYPE"]

    @property
    def label(self) -> str:
        res = (
            f"{self.resolution_s * 1000:g}ms"
            if self.resolution_s < 1
            else f"{self.resolution_s:g}s"
        )
        return f"r{self.radix}/{res}/{self.queue_type}"

    def env(self, prefix: str) -> dict[str, str]:
        return {
            "BENCH_PREFIX": prefix,
            "BENCH_RADIX": str(self.radix),
            "BENCH_RESOLUTION_S": str(self.resolution_s),
            "BENCH_QUEUE_TYPE": self.queue_type,
        }

    def deferred_settings(self, prefix: str) -> dict[str, Any]:
        return {
            "BROKER_URL": BROKER_URL,
            "PREFIX": prefix,
            "RADIX": self.radix,
            "RESOLUTION": self.resolution_s,
            "QUEUE_TYPE": self.queue_type,
            "MAX_DELAY": 400 * 86400,
            "ON_COMMIT": False,
        }


@contextlib.contextmanager
def topology(config: Config) -> Iterator[tuple[str, Plan]]:
    """Declare a fresh topology for ``config`` (settings overridden), delete it after."""
    prefix = f"deferred-bench-{uuid.uuid4().hex[:8]}"
    with override_settings(DEFERRED=config.deferred_settings(prefix)):
        call_command("declare_delay_topology", verbosity=0)
        plan = plan_topology(get_settings())
        try:
            yield prefix, plan
        finally:
            with admin_channel(BROKER_URL) as admin:
                admin.delete_everything(plan)


class Worker:
    """``manage.py run_deferred_worker`` in a subprocess, with the bench settings."""

    def __init__(self, config: Config, prefix: str, concurrency: int, log_level: str = "INFO"):
        self.seen_path = Path(tempfile.mkstemp(prefix="bench-seen-")[1])
        self.log_path = Path(tempfile.mkstemp(prefix="bench-worker-")[1])
        env = {
            **os.environ,
            **config.env(prefix),
            "DJANGO_SETTINGS_MODULE": "bench.settings",
            "PYTHONPATH": str(ROOT),
            "BENCH_SEEN": str(self.seen_path),
            "BENCH_LOG_LEVEL": log_level,
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "manage.py"),
                "run_deferred_worker",
                "--concurrency",
                str(concurrency),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log_path.open("w"),
        )
        deadline = time.monotonic() + 30
        while "Worker consuming" not in self.log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> list[tuple[str, float, float]]:
        """SIGTERM, wait, and return ``(job id, ran at, lateness ms)`` for every job run."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)
        rows = []
        for line in self.seen_path.read_text().splitlines():
            job_id, at, late = line.split()
            rows.append((job_id, float(at), float(late)))
        self.seen_path.unlink(missing_ok=True)
        self.log_path.unlink(missing_ok=True)
        return rows

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
