"""Capacity end to end: offered rate against lateness, this checkout against others.

python -m bench.capacity [--rates 800,900,1000] [--seconds 20] [--rounds 2]
                         [--checkout NAME=PATH ...] [--skip-self] [--queue-type classic]
                         [--delays 0-3] [--profile DIR] [--out FILE]

What a user runs: the public API and the library's default settings (radix 16,
1 ms), delays uniform in 0-3 s (``--delays``), one worker (``run_deferred_worker
--concurrency 4``) and the producer in processes of their own. Each point gets a
fresh topology and worker, a warm-up, then ``SECONDS`` of offered load. The
checkouts take turns at each rate, so that a busy moment of the host does not
fall on one side only.

``--checkout old=/path`` measures another checkout (``git worktree add /path
COMMIT``) with the same harness (``bench/e2e``), which uses only ``defer()``,
``task`` and ``current_job()``. ``--profile DIR`` records the producer and the
worker with py-spy (``pip install py-spy``) at each point, as collapsed stacks
(``python -m bench.profile FILE`` sums them per function; ``flamegraph.pl``
draws them).

Beside each point: the broker's raw limit measured in the same run
(``bench.raw``), and the CPU used by the broker, the worker and the producer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import BROKER_URL, broker_pids, cpu_seconds, percentile

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "bench" / "e2e"
#: The issue's figures: concurrency 4, delays uniform in 0-3 s.
CONCURRENCY = 4
LOW_S, HIGH_S = 0.0, 3.0
WARM_UP_RATE, WARM_UP_S = 200, 2.0
#: The producer's threads, each with its connection: a confirmed publish takes
#: about a millisecond, so 2,000 jobs/s needs several.
PRODUCER_THREADS = 8


def producer_command(
    rate: float,
    seconds: float,
    ids: Path,
    *,
    low: float = LOW_S,
    high: float = HIGH_S,
    threads: int = PRODUCER_THREADS,
    live: bool = False,
) -> list[str]:
    """The harness's producer (``e2e_app.produce``) as a command line: ``rate`` jobs/s
    for ``seconds``, delays uniform in ``low``-``high`` s, their ids written to ``ids``."""
    return [
        sys.executable,
        "-m",
        "e2e_app.produce",
        str(rate),
        str(seconds),
        "--low",
        str(low),
        "--high",
        str(high),
        "--ids",
        str(ids),
        "--threads",
        str(threads),
        *(["--live"] if live else []),
    ]


@dataclass(frozen=True)
class Checkout:
    name: str
    root: Path
    #: DEFERRED settings of this variant only, over ``--setting``.
    settings: tuple[tuple[str, Any], ...] = ()


class Point:
    """One measured point: a topology, a worker and a producer for one checkout."""

    def __init__(
        self,
        checkout: Checkout,
        queue_type: str,
        extra: dict[str, Any],
        work: Path,
        delays: tuple[float, float] = (LOW_S, HIGH_S),
    ) -> None:
        self.checkout = checkout
        self.delays = delays
        self.work = work
        self.prefix = f"deferred-e2e-{uuid.uuid4().hex[:8]}"
        self.seen = work / f"{self.prefix}.seen"
        self.log = work / f"{self.prefix}.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": f"{checkout.root}{os.pathsep}{HARNESS}",
            "DJANGO_SETTINGS_MODULE": "e2e_app.settings",
            "E2E_PREFIX": self.prefix,
            "E2E_DEFERRED": json.dumps({"QUEUE_TYPE": queue_type, **extra}),
            "E2E_SEEN": str(self.seen),
            "E2E_DB": str(work / "e2e.sqlite3"),
        }
        self.worker: subprocess.Popen[bytes] | None = None

    def _django(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        # cwd: a folder without a ``deferred`` of its own (``-m`` puts cwd first).
        return subprocess.run(
            [sys.executable, "-m", "django", *args],
            env=self.env,
            cwd=self.work,
            text=True,
            capture_output=True,
            check=True,
            **kwargs,
        )

    def start(self) -> None:
        self._django("declare_delay_topology", "-v", "0")
        self.worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "django",
                "run_deferred_worker",
                "--concurrency",
                str(CONCURRENCY),
            ],
            env=self.env,
            cwd=self.work,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        deadline = time.monotonic() + 30
        while "Worker consuming" not in self.log.read_text():
            if self.worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def succeeded(self) -> int:
        return self.log.read_text().count("outcome=succeeded")

    def produce(
        self, rate: float, seconds: float, ids: Path, profile: Path | None = None
    ) -> dict[str, Any]:
        """Run the producer; CPU of the broker and the worker over its measured window."""
        assert self.worker is not None
        low, high = self.delays
        command = producer_command(rate, seconds, ids, low=low, high=high)
        if profile is not None:
            command = [
                "py-spy",
                "record",
                "--rate",
                "200",
                "--format",
                "raw",
                "-o",
                str(profile.with_suffix(".producer.txt")),
                "--",
                *command,
            ]
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "-o",
                    str(profile.with_suffix(".worker.txt")),
                    "--duration",
                    str(int(seconds) + 2),
                    "--pid",
                    str(self.worker.pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        brokers = broker_pids([BROKER_URL])
        producer = subprocess.Popen(
            command, env=self.env, cwd=self.work, text=True, stdout=subprocess.PIPE
        )
        assert producer.stdout is not None
        for line in producer.stdout:  # py-spy, when profiling, says a word first
            if line.strip() == "go":
                break
        else:
            raise RuntimeError(f"the producer did not start: {producer.wait()}")
        broker0 = sum(cpu_seconds(p) for p in brokers)
        worker0 = cpu_seconds(self.worker.pid)
        start = time.monotonic()
        last = producer.stdout.read().strip().splitlines()[-1]
        elapsed = time.monotonic() - start
        if producer.wait() != 0:
            raise RuntimeError(f"the producer failed: {last}")
        out: dict[str, Any] = json.loads(last)
        out["broker_cpu_pct"] = 100 * (sum(cpu_seconds(p) for p in brokers) - broker0) / elapsed
        out["worker_cpu_pct"] = 100 * (cpu_seconds(self.worker.pid) - worker0) / elapsed
        if profile is not None:
            spy.wait(60)
        return out

    def stop(self) -> list[tuple[str, float, float]]:
        """SIGTERM the worker; ``(id, ran at, due)`` of every job it ran."""
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
            self.worker.wait(120)
        rows = []
        if self.seen.exists():
            for line in self.seen.read_text().splitlines():
                job_id, at, due = line.split()
                rows.append((job_id, float(at), float(due)))
        return rows

    def delete_topology(self) -> None:
        """Delete every queue and exchange of the prefix (any release's topology)."""
        script = (
            "import pika, subprocess, sys\n"
            "prefix = sys.argv[1]\n"
            "names = lambda kind: [n for n in subprocess.run(['rabbitmqctl', '-q', 'list_' + kind, "
            "'name'], capture_output=True, text=True).stdout.split() if n.startswith(prefix)]\n"
            "conn = pika.BlockingConnection(pika.URLParameters(sys.argv[2]))\n"
            "ch = conn.channel()\n"
            "[ch.queue_delete(n) for n in names('queues')]\n"
            "[ch.exchange_delete(n) for n in names('exchanges')]\n"
            "conn.close()\n"
        )
        subprocess.run([sys.executable, "-c", script, self.prefix, BROKER_URL], check=False)


def measure(
    checkout: Checkout,
    rate: float,
    seconds: float,
    queue_type: str,
    extra: dict[str, Any],
    profile: Path | None,
    logs: Path | None = None,
    delays: tuple[float, float] = (LOW_S, HIGH_S),
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="deferred-e2e-"))
    point = Point(checkout, queue_type, extra, work, delays)
    try:
        point.start()
        # Warm-up: a second of light load through the same topology and worker.
        warm_ids = work / "warm.ids"
        point.produce(WARM_UP_RATE, WARM_UP_S, warm_ids)
        time.sleep(delays[1] + 0.5)
        ids_path = work / "point.ids"
        produced = point.produce(rate, seconds, ids_path, profile)
        ids = set(ids_path.read_text().split())
        # Every job due by now + the longest delay; give an overloaded worker 30 s more.
        time.sleep(delays[1] + 0.5)
        before = point.succeeded()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(1)
            now = point.succeeded()
            if now == before:
                break
            before = now
        rows = point.stop()
    finally:
        point.stop()
        point.delete_topology()
        if logs is not None and point.log.exists():
            slug = checkout.name.split()[0]
            shutil.copy(point.log, logs / f"{slug}-{rate:.0f}-{point.prefix}.log")
        if logs is not None and point.seen.exists():
            # When each job ran and was due (id, epoch seconds, epoch seconds).
            slug = checkout.name.split()[0]
            shutil.copy(point.seen, logs / f"{slug}-{rate:.0f}-{point.prefix}.seen")
        shutil.rmtree(work, ignore_errors=True)
    ran: dict[str, list[float]] = {}
    for job_id, at, due in rows:
        if job_id in ids:
            ran.setdefault(job_id, []).append((at - due) * 1000)
    lateness = sorted(min(v) for v in ran.values())
    return {
        "checkout": checkout.name,
        "rate": rate,
        **produced,
        "ran": len(ran),
        "not_run": len(ids - ran.keys()),
        "duplicates": sum(len(v) - 1 for v in ran.values()),
        "early": sum(1 for v in lateness if v < 0),
        "p50_ms": percentile(lateness, 50) if lateness else None,
        "p99_ms": percentile(lateness, 99) if lateness else None,
        "max_ms": lateness[-1] if lateness else None,
    }


def celery_point(rate: float, seconds: float) -> dict[str, Any]:
    """Celery 5.5+'s native delayed delivery (quorum queues) on the same broker and
    delays, as a row of the table; its producer runs in this process."""
    from bench.celery_peer import native_delayed_delivery

    brokers = broker_pids([BROKER_URL])
    broker0, start = sum(cpu_seconds(p) for p in brokers), time.monotonic()
    result = native_delayed_delivery(rate, seconds, high_s=HIGH_S)
    elapsed = time.monotonic() - start
    lateness = result["lateness_ms"]
    return {
        "checkout": "celery (native delayed delivery)",
        "rate": rate,
        "achieved": result["achieved_per_s"],
        "jobs": result["sent"],
        "errors": result["publish_errors"],
        "call_ms_p50": None,
        "call_ms_p99": None,
        # Over the whole run, the wait for the last jobs included: a lower bound.
        "broker_cpu_pct": 100 * (sum(cpu_seconds(p) for p in brokers) - broker0) / elapsed,
        "worker_cpu_pct": float("nan"),
        "cpu_pct": float("nan"),
        "ran": result["ran"],
        "not_run": result["lost"],
        "duplicates": max(0, result["ran"] - result["sent"]),
        "early": result["early"],
        "p50_ms": lateness.get("p50"),
        "p99_ms": lateness.get("p99"),
        "max_ms": lateness.get("max"),
    }


def raw_limit(seconds: float = 3.0) -> float:
    """Confirmed publishes/s to one queue from one connection: the broker's raw limit."""
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    ch = conn.channel()
    ch.confirm_delivery()
    queue = ch.queue_declare("", exclusive=True).method.queue
    body = b"x" * 400
    props = pika.BasicProperties(delivery_mode=2)
    count, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        ch.basic_publish("", queue, body, props)
        count += 1
    rate = count / (time.monotonic() - start)
    conn.close()
    return rate


def table(points: list[dict[str, Any]]) -> str:
    head = (
        "| checkout | offered | achieved | p50 ms | p99 ms | max ms | refused | not run | early "
        "| dup | defer() p50/p99 ms | broker % | worker % | producer % |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def f(value: Any) -> str:
        return "-" if value is None else f"{value:,.1f}"

    return head + "".join(
        f"| {p['checkout']} | {p['rate']:,.0f} | {p['achieved']:,.0f} | {f(p['p50_ms'])} "
        f"| {f(p['p99_ms'])} | {f(p['max_ms'])} | {p['errors']} | {p['not_run']} | {p['early']} "
        f"| {p['duplicates']} | {f(p['call_ms_p50'])} / {f(p['call_ms_p99'])} "
        f"| {p['broker_cpu_pct']:.0f} | {p['worker_cpu_pct']:.0f} | {p['cpu_pct']:.0f} |\n"
        for p in points
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="800,900,1000")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queue-type", default="classic")
    parser.add_argument(
        "--delays",
        default=f"{LOW_S:g}-{HIGH_S:g}",
        metavar="LOW-HIGH",
        help="delays uniform in LOW-HIGH seconds (0-0: every job due at once)",
    )
    parser.add_argument(
        "--checkout", action="append", default=[], help="NAME=PATH of another checkout"
    )
    parser.add_argument(
        "--setting", action="append", default=[], help="NAME=JSON, a DEFERRED setting"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also this checkout with that DEFERRED setting, alternating with it "
        "(e.g. PRIORITIES=false)",
    )
    parser.add_argument("--skip-self", action="store_true", help="measure only the --checkout ones")
    parser.add_argument(
        "--celery",
        action="store_true",
        help="also Celery's native delayed delivery at each rate (pip install celery)",
    )
    parser.add_argument(
        "--logs", type=Path, help="keep the workers' logs and when each job ran here"
    )
    parser.add_argument("--profile", type=Path, help="folder for py-spy flame graphs")
    parser.add_argument("--out", type=Path, help="write the points as JSON here")
    args = parser.parse_args()

    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    checkouts = [] if args.skip_self else [Checkout(f"main ({head})", ROOT)]
    for item in args.checkout:
        name, path = item.split("=", 1)
        checkouts.append(Checkout(name, Path(path).resolve()))
    low, high = (float(v) for v in args.delays.split("-", 1))
    delays = (low, high)
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.setting)}
    for item in args.variant:
        key, value = item.split("=", 1)
        checkouts.append(Checkout(f"main {key}={value}", ROOT, ((key, json.loads(value)),)))
    for folder in (args.profile, args.logs):
        if folder:
            folder.mkdir(parents=True, exist_ok=True)

    raw = raw_limit()
    print(f"raw confirmed publish, one connection: {raw:,.0f} msg/s", flush=True)
    points = []
    for rate in (float(r) for r in args.rates.split(",")):
        for round_ in range(args.rounds):
            # Alternate which checkout goes first, round to round.
            order = checkouts if round_ % 2 == 0 else checkouts[::-1]
            for checkout in order:
                profile = None
                if args.profile:
                    slug = checkout.name.split()[0]
                    profile = args.profile / f"{slug}-{rate:.0f}-{round_}"
                point = measure(
                    checkout,
                    rate,
                    args.seconds,
                    args.queue_type,
                    {**extra, **dict(checkout.settings)},
                    profile,
                    args.logs,
                    delays,
                )
                points.append(point)
                print(table([point]).splitlines()[-1], flush=True)
            if args.celery:
                point = celery_point(rate, args.seconds)
                points.append(point)
                print(table([point]).splitlines()[-1], flush=True)
    raw_after = raw_limit()
    print(f"\nraw confirmed publish before/after: {raw:,.0f} / {raw_after:,.0f} msg/s\n")
    print(table(points))
    if args.out:
        args.out.write_text(
            json.dumps({"raw_publish": [raw, raw_after], "points": points}, indent=2)
        )


if __name__ == "__main__":
    main()
