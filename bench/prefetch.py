"""Scenario: one worker over two ready queues, whose unacked jobs are capped at its
concurrency across both (``deferred.broker.consumer``).

What the cap may cost: no-op jobs/s, and the worker's and the broker's CPU
per job, with jobs waiting in one queue or both; how many threads a worker
keeps busy when only one of its queues has jobs (``nap`` jobs, which sleep);
the most jobs it holds unacked; how late sparse jobs start when they arrive
while it is idle; and the broker's CPU while it waits.

The worker runs in this process, in a thread, because the bench settings name
one queue and this scenario needs two; its line per job is logged to stderr,
as in production. One topology serves the whole run, and is deleted at the
end, SIGTERM included::

    PYTHONPATH=. DJANGO_SETTINGS_MODULE=bench.settings python -m bench.prefetch \\
        [--quick] [--queue-type quorum] [--repeats 3] [--json results.jsonl] 2>/dev/null
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import django
from django.core.management import call_command
from django.test import override_settings

from bench.common import BROKER_URL, Config, cpu_seconds, summary, wait_until
from bench.tasks import _seen, noop
from deferred import current_job, defer, defer_many, task
from deferred.broker import admin_channel
from deferred.conf import get_settings
from deferred.core.topology import Plan, plan_topology
from deferred.worker import Worker

QUEUES = ["default", "other"]
#: The queues of the start-latency scenario: a worker consumes the first 1, 2, 4 or 8.
MANY = ["default", "other", *(f"q{n}" for n in range(2, 8))]
#: ``(at, queue)`` of every nap that started.
_naps: list[tuple[float, str]] = []


@task(name="bench.prefetch.nap")
def nap(seconds: float) -> None:
    """Sleep: a job that holds its thread but not the GIL, as I/O does."""
    job = current_job()
    assert job is not None
    _naps.append((time.time(), job.queue))
    time.sleep(seconds)


@contextlib.contextmanager
def _topology(queue_type: str, queues: list[str] = QUEUES) -> Iterator[Plan]:
    """A topology with ``queues``, in force (settings) until the block ends, then deleted."""
    config = Config(queue_type=queue_type)
    prefix = f"deferred-bench-{uuid.uuid4().hex[:8]}"
    values = {**config.deferred_settings(prefix), "QUEUES": queues}
    with override_settings(DEFERRED=values):
        try:
            call_command("declare_delay_topology", verbosity=0, stdout=io.StringIO())
            yield plan_topology(get_settings())
        finally:
            with admin_channel(config.urls) as admin:
                admin.delete_everything(plan_topology(get_settings()))


def _emptied(plan: Plan) -> Plan:
    """``plan``, its ready queues emptied (of what an earlier point left)."""
    with admin_channel(get_settings().broker_urls) as admin:
        for queue in plan.ready_queues.values():
            admin.channel.queue_purge(queue.name)
    return plan


class _Counting(Worker):
    """A worker that counts the jobs it holds unacked: delivered to it, not yet settled.

    Both ends are counted on its I/O thread, in the order RabbitMQ sees them
    (the worker's own count of running jobs drops before the ack is sent), and
    per connection: when one is lost (another client's ``rabbitmqctl
    close_all_connections`` on a shared broker), RabbitMQ takes its jobs back.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.held = self.peak = self.generation = 0
        settle = self.consumer._settle

        def counted(delivery: Any, ack: bool, requeue: bool) -> None:
            if delivery.generation == self.generation:
                self.held -= 1
            settle(delivery, ack, requeue)

        self.consumer._settle = counted  # type: ignore[method-assign]

    def _on_delivery(self, delivery: Any) -> None:
        if delivery.generation != self.generation:
            self.generation, self.held = delivery.generation, 0
        self.held += 1
        self.peak = max(self.peak, self.held)
        super()._on_delivery(delivery)


class _Running:
    """A :class:`_Counting` worker in a thread."""

    def __init__(self, concurrency: int, queues: list[str]) -> None:
        self.worker = _Counting(
            queues=queues, concurrency=concurrency, install_signal_handlers=False, schedules=False
        )
        self._thread = threading.Thread(target=self.worker.run, daemon=True)
        self._thread.start()
        if not self.worker.consuming.wait(30):
            raise RuntimeError("the worker did not start consuming")

    @property
    def peak(self) -> int:
        return self.worker.peak

    def stop(self) -> None:
        self.worker.stop()
        self._thread.join(60)


def _fill(plan: Plan, jobs: dict[str, list[tuple[Any, ...]]]) -> None:
    """Defer already-due jobs into each queue and wait until all are ready there."""
    for calls in jobs.values():
        for first in range(0, len(calls), 1000):
            defer_many(calls[first : first + 1000])
    waiting = {plan.ready_queues[q].name: len(calls) for q, calls in jobs.items()}
    with admin_channel(get_settings().broker_urls) as admin:
        wait_until(lambda: all(admin.message_count(q) == k for q, k in waiting.items()), 60)


def _broker_pid() -> int | None:
    """The RabbitMQ VM listening on ``BROKER_URL``'s port in this network namespace.

    Several brokers may run on this host, each in a namespace of its own
    (``scripts/rabbitmq-release.sh VERSION run``) on the same port: ``ss``
    sees only this namespace's.
    """
    port = urllib.parse.urlsplit(BROKER_URL).port or 5672
    found = subprocess.run(
        ["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True
    ).stdout
    pids = re.findall(r"pid=(\d+)", found)
    return int(pids[0]) if pids else None


def _cpu() -> float:
    """User + system CPU seconds of this process (the worker's threads, while one runs)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def dispatch(
    plan: Plan, concurrency: int, consumed: list[str], loaded: list[str], n: int
) -> dict[str, float]:
    """A worker of ``consumed`` with ``n`` no-op jobs waiting in each of ``loaded`` when it
    starts: jobs/s, and CPU ms per job of the worker and of the broker.

    The CPU figures hold on a busy host, where jobs/s moves with whatever else runs.
    """
    jobs = n * len(loaded)
    _fill(_emptied(plan), {q: [(noop.using(queue=q), 0, (k,)) for k in range(n)] for q in loaded})
    _seen.clear()
    broker = _broker_pid()
    cpu, broker_cpu = _cpu(), cpu_seconds(broker)
    running = _Running(concurrency, consumed)
    wait_until(lambda: len(_seen) >= jobs, 600)
    cpu, broker_cpu = _cpu() - cpu, cpu_seconds(broker) - broker_cpu
    running.stop()
    ats = sorted(at for _id, at, _late in _seen)
    return {
        "jobs_per_s": (len(ats) - 1) / max(ats[-1] - ats[0], 1e-9),
        "worker_cpu_ms_per_job": 1000 * cpu / jobs,
        "broker_cpu_ms_per_job": 1000 * broker_cpu / jobs if broker else float("nan"),
        "peak_held": running.peak,
    }


def busy_threads(plan: Plan, concurrency: int, jobs: int, seconds: float) -> dict[str, Any]:
    """Naps waiting in one queue only: jobs/s over sleep time is the threads kept busy."""
    _fill(_emptied(plan), {"default": [(nap, 0, (seconds,)) for _ in range(jobs)]})
    _naps.clear()
    running = _Running(concurrency, QUEUES)
    wait_until(lambda: len(_naps) >= jobs, 600)
    time.sleep(seconds + 0.2)
    running.stop()
    starts = sorted(at for at, _q in _naps)
    rate = (len(starts) - 1) / max(starts[-1] - starts[0], 1e-9)
    return {"jobs_per_s": rate, "busy_threads": rate * seconds, "peak_held": running.peak}


def held_with_both_busy(plan: Plan, concurrency: int, seconds: float) -> dict[str, Any]:
    """Naps waiting in both queues: the most jobs held, and how the queues took turns."""
    per_queue = 4 * concurrency
    _fill(
        _emptied(plan),
        {q: [(nap.using(queue=q), 0, (seconds,)) for _ in range(per_queue)] for q in QUEUES},
    )
    _naps.clear()
    running = _Running(concurrency, QUEUES)
    # Until half of them ran: both queues still hold jobs then.
    wait_until(lambda: len(_naps) >= per_queue, 600)
    running.stop()
    first = [q for _at, q in sorted(_naps)][:per_queue]
    return {"peak_held": running.peak, "first_half_from_other": first.count("other") / len(first)}


def lateness(plan: Plan, concurrency: int, rate: float, seconds: float) -> dict[str, Any]:
    """Sparse no-op jobs, due 0-1 s after they are deferred into either queue at random:
    how late they start (ms)."""
    rng = random.Random(7)
    _emptied(plan)
    running = _Running(concurrency, QUEUES)
    _seen.clear()
    count = int(rate * seconds)
    start = time.monotonic()
    for k in range(count):
        time.sleep(max(0.0, start + k / rate - time.monotonic()))
        defer(noop.using(queue=rng.choice(QUEUES)), rng.uniform(0, 1), k)
    wait_until(lambda: len(_seen) >= count, 30)
    running.stop()
    return summary([late for _id, _at, late in _seen])


def start_latency(plan: Plan, concurrency: int, queues: int, count: int) -> dict[str, Any]:
    """How late a due job starts on an idle worker of ``queues`` queues (ms): one job at a
    time, into each queue in turn, each 50-150 ms after the previous one started."""
    rng = random.Random(11)
    consumed = MANY[:queues]
    _emptied(plan)
    running = _Running(concurrency, consumed)
    time.sleep(0.5)  # idle: the looks into the queues are at their widest
    _seen.clear()
    for k in range(count):
        defer(noop.using(queue=consumed[k % queues]), 0, k)
        wait_until(lambda k=k: len(_seen) > k, 10)
        time.sleep(rng.uniform(0.05, 0.15))
    running.stop()
    return summary([late for _id, _at, late in _seen])


def idle(plan: Plan, concurrency: int, seconds: float) -> float:
    """The broker's CPU use (percent of a core) while a worker of both queues waits for jobs."""
    running = _Running(concurrency, QUEUES)
    time.sleep(1.0)
    broker = _broker_pid()
    before, start = cpu_seconds(broker), time.monotonic()
    time.sleep(seconds)
    used, elapsed = cpu_seconds(broker) - before, time.monotonic() - start
    running.stop()
    return 100 * used / elapsed if broker else float("nan")


DISPATCH = [
    (1, ["default"], ["default"]),
    (4, ["default"], ["default"]),
    (1, QUEUES, QUEUES),
    (4, QUEUES, QUEUES),
    (4, QUEUES, ["default"]),
]


def _stop_on_sigterm() -> None:
    """SIGTERM ends the run like an error: the topology's ``finally`` deletes it."""

    def stop(signum: int, frame: Any) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue-type", default="classic", choices=["classic", "quorum"])
    parser.add_argument("--quick", action="store_true", help="fewer jobs, shorter runs")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each dispatch point")
    parser.add_argument("--only", default="dispatch,threads,held,lateness,idle,start")
    parser.add_argument("--json", metavar="PATH", help="also append every result to PATH")
    args = parser.parse_args()
    django.setup()
    _stop_on_sigterm()
    qt, only = args.queue_type, args.only.split(",")
    n = 1000 if args.quick else 3000
    seconds = 5 if args.quick else 15

    def report(name: str, result: Any, line: str) -> None:
        print(f"  {line}", flush=True)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps({"queue_type": qt, "name": name, "result": result}) + "\n")

    print(f"queue type {qt}", flush=True)
    if "start" in only:
        with _topology(qt, MANY) as plan:
            for queues in (1, 2, 4, 8):
                for c in sorted({4, queues}):
                    got = start_latency(plan, c, queues, 60 if args.quick else 200)
                    report(
                        f"start c{c} q{queues}",
                        got,
                        f"idle worker, concurrency {c}, {queues} queue(s), a due job at a "
                        f"time: start latency p50 {got['p50']:.1f} ms, mean {got['mean']:.1f} ms, "
                        f"p99 {got['p99']:.1f} ms, max {got['max']:.1f} ms ({got['n']} jobs)",
                    )
    with _topology(qt) as plan:
        if "dispatch" in only:
            for c, consumed, loaded in DISPATCH:
                runs = [dispatch(plan, c, consumed, loaded, n) for _ in range(args.repeats)]
                rate = statistics.median(r["jobs_per_s"] for r in runs)
                cpu = statistics.median(r["worker_cpu_ms_per_job"] for r in runs)
                broker = statistics.median(r["broker_cpu_ms_per_job"] for r in runs)
                report(
                    f"dispatch c{c} {'+'.join(consumed)} jobs in {'+'.join(loaded)}",
                    runs,
                    f"no-op jobs, concurrency {c}, consuming {'+'.join(consumed)}, jobs in "
                    f"{'+'.join(loaded)}: {rate:5.0f}/s, worker {cpu:.3f} ms CPU/job, broker "
                    f"{broker:.3f} ms CPU/job, {max(r['peak_held'] for r in runs)} held at most",
                )
        if "threads" in only:
            for c in (2, 4):
                got = busy_threads(plan, c, 40 * c, 0.05)
                report(
                    f"threads c{c}",
                    got,
                    f"concurrency {c}, naps of 50 ms in one queue of two: "
                    f"{got['busy_threads']:.2f} threads busy, {got['peak_held']} held at most",
                )
        if "held" in only:
            for c in (1, 2):
                got = held_with_both_busy(plan, c, 0.05)
                report(
                    f"held c{c}",
                    got,
                    f"concurrency {c}, naps in both queues: {got['peak_held']} held at most; "
                    f"{got['first_half_from_other']:.0%} of the first half from 'other'",
                )
        if "lateness" in only:
            for c, rate in ((1, 20), (1, 100), (2, 20)):
                got = lateness(plan, c, rate, seconds)
                report(
                    f"lateness c{c} {rate}/s",
                    got,
                    f"concurrency {c}, {rate} jobs/s due 0-1 s into either queue: lateness p50 "
                    f"{got['p50']:.1f} ms, p99 {got['p99']:.1f} ms, max {got['max']:.1f} ms "
                    f"({got['n']} jobs)",
                )
        if "idle" in only:
            for c in (1, 2):
                pct = idle(plan, c, seconds)
                report(
                    f"idle c{c}",
                    pct,
                    f"concurrency {c}, idle over both queues: broker {pct:.1f}% of a core",
                )


if __name__ == "__main__":
    main()
