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
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.management import call_command
from django.test import override_settings

from deferred.broker import admin_channel
from deferred.conf import DEFAULTS, get_settings
from deferred.core.topology import Plan, plan_topology

ROOT = Path(__file__).resolve().parent.parent
BROKER_URL = os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
#: On a cluster: dead-letters that have not moved for this long count as stuck
#: (``DEFERRED['STUCK_AFTER']``; 30 s by default, shortened to keep runs short).
CLUSTER_STUCK_AFTER_S = 10


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


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return dict(pairs)


def broker_pids(urls: Iterable[str]) -> list[int]:
    """The RabbitMQ (Erlang VM) processes on this machine that listen on ``urls``' ports.

    A VM's AMQP port is its ``RABBITMQ_NODE_PORT`` (5672 without one, the
    system broker): the nodes of ``scripts/local-cluster.sh`` run beside the
    system broker, and only the VMs of the broker measured may count. Where
    the environments cannot be read, the first RabbitMQ VM found.
    """
    ports = {urllib.parse.urlsplit(url).port or 5672 for url in urls}
    found = subprocess.run(["pgrep", "-f", "beam.smp.*rabbit"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    chosen, unreadable = [], False
    for pid in pids:
        env = _environ(pid)
        if env is None:
            unreadable = True
        elif int(env.get("RABBITMQ_NODE_PORT") or 5672) in ports:
            chosen.append(pid)
    if not chosen and unreadable:
        return pids[:1]
    return chosen


def broker_pid() -> int | None:
    """The RabbitMQ (Erlang VM) process of the broker the benchmarks use, if it runs here.

    Under ``scripts/rabbitmq-release.sh VERSION run``, the release's node and the
    system broker both listen on 5672 (in network namespaces of their own): the
    broker's own ``rabbitmqctl`` (the release's, first on PATH there) says which."""
    pids = broker_pids([BROKER_URL])
    if len(pids) > 1:
        said = _rabbitmqctl_eval("list_to_integer(os:getpid()).")
        if said is not None and said.isdigit() and int(said) in pids:
            return int(said)
    return pids[0] if pids else None


def broker_data_dir() -> Path | None:
    """The broker's data directory (its ``rabbitmqctl`` says which), if this process
    can read it."""
    said = _rabbitmqctl_eval("rabbit_mnesia:dir().")
    if said is None:
        return None
    path = Path(said.strip('"'))
    return path if (path / "stream").is_dir() else None


def _rabbitmqctl_eval(expression: str) -> str | None:
    """What the broker's ``rabbitmqctl eval`` prints for ``expression``; ``None`` if it
    cannot be asked or fails."""
    try:
        found = subprocess.run(
            ["rabbitmqctl", "eval", expression], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time used so far by ``pid`` (0 if unknown or gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_meter(pids: list[int] | None = None) -> Iterator[dict[str, float]]:
    """Broker CPU use over the block, in percent of one core (summed over ``pids``:
    the broker's VMs, by default the one of ``BROKER_URL``)."""
    if pids is None:
        pid = broker_pid()
        pids = [pid] if pid else []
    start_cpu, start = sum(cpu_seconds(p) for p in pids), time.monotonic()
    out: dict[str, float] = {}
    yield out
    elapsed = time.monotonic() - start
    used = sum(cpu_seconds(p) for p in pids) - start_cpu
    out["broker_cpu_pct"] = 100 * used / elapsed if pids else float("nan")


@dataclass(frozen=True)
class Config:
    """One configuration to measure; the defaults are the library's defaults."""

    radix: int = DEFAULTS["RADIX"]
    resolution_s: float = DEFAULTS["RESOLUTION"].total_seconds()
    queue_type: str = DEFAULTS["QUEUE_TYPE"]
    #: The nodes of a cluster, in the order they are tried; empty: the one
    #: broker of ``BROKER_URL``.
    broker_urls: tuple[str, ...] = ()
    #: The cluster's management API (stuck dead-letters, leaders); empty: the default.
    management_urls: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        res = (
            f"{self.resolution_s * 1000:g}ms"
            if self.resolution_s < 1
            else f"{self.resolution_s:g}s"
        )
        nodes = f"/{len(self.broker_urls)} nodes" if len(self.broker_urls) > 1 else ""
        return f"r{self.radix}/{res}/{self.queue_type}{nodes}"

    @property
    def urls(self) -> tuple[str, ...]:
        return self.broker_urls or (BROKER_URL,)

    def env(self, prefix: str) -> dict[str, str]:
        env = {
            "BENCH_PREFIX": prefix,
            "BENCH_RADIX": str(self.radix),
            "BENCH_RESOLUTION_S": str(self.resolution_s),
            "BENCH_QUEUE_TYPE": self.queue_type,
        }
        if self.broker_urls:
            env["BENCH_BROKER_URLS"] = ",".join(self.broker_urls)
            # The bench counts stuck dead-letters, then repairs them itself.
            env["BENCH_STUCK_AFTER_S"] = str(CLUSTER_STUCK_AFTER_S)
            env["BENCH_REPAIR_STUCK"] = "0"
        if self.management_urls:
            env["BENCH_MANAGEMENT_URLS"] = ",".join(self.management_urls)
        return env

    def deferred_settings(self, prefix: str) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "BROKER_URL": list(self.broker_urls) if self.broker_urls else BROKER_URL,
            "PREFIX": prefix,
            "RADIX": self.radix,
            "RESOLUTION": self.resolution_s,
            "QUEUE_TYPE": self.queue_type,
            "MAX_DELAY": 400 * 86400,
            "ON_COMMIT": False,
        }
        if self.broker_urls:
            settings["STUCK_AFTER"] = CLUSTER_STUCK_AFTER_S
            settings["REPAIR_STUCK"] = False
        if self.management_urls:
            settings["MANAGEMENT_URL"] = list(self.management_urls)
        return settings


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
            with admin_channel(config.urls) as admin:
                admin.delete_everything(plan)


class Worker:
    """``manage.py run_deferred_worker`` in a subprocess, with the bench settings."""

    def __init__(
        self,
        config: Config,
        prefix: str,
        concurrency: int,
        log_level: str = "INFO",
        extra_env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        self.seen_path = Path(tempfile.mkstemp(prefix="bench-seen-")[1])
        self.log_path = Path(tempfile.mkstemp(prefix="bench-worker-")[1])
        env = {
            **os.environ,
            **config.env(prefix),
            **(extra_env or {}),
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
                *extra_args,
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

    def succeeded(self) -> int:
        """Jobs run so far: the notes are written at exit, the log has a line per
        job meanwhile (at INFO, which BENCH_LOG_LEVEL must leave on)."""
        return self.log().count("outcome=succeeded")

    def wait_for_runs(self, count: int, delay: float, timeout: float = 60) -> None:
        """Sleep ``delay`` (the last job's), then until ``count`` jobs ran, then a second more.

        A fixed sleep past the longest delay counted a job that a loaded host
        ran a moment later as never run. The second after lets a late
        duplicate show.
        """
        time.sleep(delay)
        if not wait_until(lambda: self.succeeded() >= count, timeout, interval=0.25):
            print(f"   only {self.succeeded()} of {count} jobs ran within {timeout} s", flush=True)
        time.sleep(1.0)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def wait_until(predicate: Any, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
