"""Scenario 6, the closest peer: Celery against the same broker, in both of its modes.

- classic queue, ``countdown``: the worker takes the message at once and holds
  it in memory until its ETA; we measure its RSS per pending job, and what
  RabbitMQ's ``consumer_timeout`` does to held messages;
- quorum queue: Celery 5.5+ native delayed delivery (kombu's 28 binary levels
  in whole seconds); we measure sustained rate and lateness on our delay mix.
"""

from __future__ import annotations

import importlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pika

from bench.common import BROKER_URL, ROOT, rss_mb, summary, wait_until


class CeleryWorker:
    def __init__(self, queue_type: str, concurrency: int = 4) -> None:
        self.seen = Path(tempfile.mkstemp(prefix="bench-celery-seen-")[1])
        self.log = Path(tempfile.mkstemp(prefix="bench-celery-log-")[1])
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "BENCH_CELERY_QUEUE_TYPE": queue_type,
            "BENCH_SEEN": str(self.seen),
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "bench.celery_app",
                "worker",
                "-P",
                "threads",
                "-c",
                str(concurrency),
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        if not wait_until(
            lambda: "ready." in self.log.read_text() or self.proc.poll() is not None, 60
        ):
            raise RuntimeError("celery worker did not start")
        if self.proc.poll() is not None:
            raise RuntimeError(self.log.read_text()[-3000:])

    def stop(self) -> list[tuple[float, float]]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        rows = [tuple(map(float, line.split())) for line in self.seen.read_text().splitlines()]
        return rows  # type: ignore[return-value]


def _cleanup(queue_type: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = connection.channel()
    channel.queue_delete(f"bench_celery_{queue_type}")
    connection.close()


def _app(queue_type: str) -> Any:
    """The Celery app module, configured for ``queue_type`` (re-imported each time)."""
    os.environ["BENCH_CELERY_QUEUE_TYPE"] = queue_type
    if "bench.celery_app" in sys.modules:
        return importlib.reload(sys.modules["bench.celery_app"])
    return importlib.import_module("bench.celery_app")


def eta_memory(pending: int) -> dict[str, Any]:
    """Classic queue: RSS of a worker holding ``pending`` ETA jobs."""
    mod = _app("classic")
    worker = CeleryWorker("classic")
    try:
        before = rss_mb(worker.proc.pid)
        due = time.time() + 3600
        start = time.perf_counter()
        for _ in range(pending):
            mod.ran.apply_async(args=[due], countdown=3600)
        publish_s = time.perf_counter() - start
        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        channel = connection.channel()
        ready = lambda: channel.queue_declare(mod.QUEUE_NAME, passive=True).method.message_count  # noqa: E731
        wait_until(lambda: ready() == 0, 120, interval=1)
        time.sleep(2)
        after = rss_mb(worker.proc.pid)
        left_in_broker = ready()
        held = pending - left_in_broker
        connection.close()
    finally:
        worker.stop()
        _cleanup("classic")
    return {
        "pending": pending,
        "publish_per_s": pending / publish_s,
        "worker_rss_mb_before": before,
        "worker_rss_mb_after": after,
        "held_by_worker": held,
        "kb_per_held_job": (after - before) * 1024 / held if held else float("nan"),
        "left_ready_in_broker": left_in_broker,
    }


def consumer_timeout(timeout_ms: int, countdown_s: float, jobs: int) -> dict[str, Any]:
    """Classic queue: what RabbitMQ's consumer_timeout does to ETA jobs held unacked.

    The broker's timeout is lowered for the experiment and restored after.
    """

    def set_timeout(ms: int) -> None:
        subprocess.run(
            ["rabbitmqctl", "eval", f"application:set_env(rabbit, consumer_timeout, {ms})."],
            check=True,
            capture_output=True,
            timeout=60,
        )

    mod = _app("classic")
    set_timeout(timeout_ms)
    try:
        worker = CeleryWorker("classic")
        try:
            due = time.time() + countdown_s
            for _ in range(jobs):
                mod.ran.apply_async(args=[due], countdown=countdown_s)
            time.sleep(countdown_s + 20)
        finally:
            runs = worker.stop()
        log = worker.log.read_text()
    finally:
        set_timeout(1_800_000)
        _cleanup("classic")
    return {
        "broker_consumer_timeout_ms": timeout_ms,
        "countdown_s": countdown_s,
        "jobs": jobs,
        "runs": len(runs),
        "channel_closed_by_timeout": "acknowledgement" in log or "PRECONDITION_FAILED" in log,
        "duplicate_runs": len(runs) - jobs,
    }


def native_delayed_delivery(rate: float, seconds: float, high_s: float = 5.0) -> dict[str, Any]:
    """Quorum queue: sustained rate and lateness, delays uniform 0-``high_s`` s (as ours)."""
    mod = _app("quorum")
    worker = CeleryWorker("quorum")
    rng = random.Random(5)
    errors = 0
    first_error: str | None = None
    sent = 0
    try:
        count = int(rate * seconds)
        start = time.perf_counter()
        for n in range(count):
            pause = start + n / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            delay = rng.uniform(0, high_s)
            try:
                mod.ran.apply_async(args=[time.time() + delay], countdown=delay)
                sent += 1
            except Exception as exc:  # noqa: BLE001 - counted and reported
                errors += 1
                first_error = first_error or repr(exc)
        achieved = sent / (time.perf_counter() - start)
        time.sleep(high_s + 3)
    finally:
        runs = worker.stop()
        _cleanup("quorum")
    lateness = [late for _at, late in runs]
    return {
        "offered_per_s": rate,
        "achieved_per_s": achieved,
        "sent": sent,
        "publish_errors": errors,
        "first_error": first_error,
        "ran": len(runs),
        "lost": sent - len(runs),
        "early": sum(1 for late in lateness if late < 0),
        "lateness_ms": summary(lateness),
    }
