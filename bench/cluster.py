"""Scenario 8: a three-node RabbitMQ cluster (``scripts/local-cluster.sh``).

1. Sustained offered rate against lateness on the cluster with quorum queues
   (``BROKER_URL`` = the three nodes), beside the single broker on 5672 with
   quorum and with classic queues, in the same run: the machinery of
   scenario 4 (:mod:`bench.sustained`) with the cluster's URLs.
2. The failover gap: a worker subprocess runs a steady stream of jobs while
   the bench SIGKILLs a node's Erlang VM, as ``local-cluster.sh kill-node``
   does, and starts it again. Two kinds of kill: the node the worker consumes
   from (the worker must fail over, and so must the producers, connected to
   the same first URL), and the node leading the most queues among the other
   two (the worker stays; the queues it led elect new leaders). Measured: the
   time from the kill to the next job run and the longest pause between two
   runs, the ``defer()`` calls that raised, the lateness of the jobs due after
   the kill, duplicates, and the jobs lost once the node is back and
   ``deferred_repair`` has released any stuck dead-letters. Jobs stranded
   that way (a RabbitMQ bug after a leader change, see ``deferred.cluster.stuck``)
   are counted apart, with how late they ran.

The cluster is started if it does not run, and stopped at the end only then.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.management import call_command

from bench import sustained
from bench.common import ROOT, Config, Worker, percentile, summary, topology, wait_until
from bench.tasks import noop
from deferred import broker, defer
from deferred.broker import BrokerError
from deferred.cluster.nodes import management_api
from deferred.cluster.repair import cli_dead_lettered
from deferred.cluster.stuck import find_stuck
from deferred.conf import get_settings
from deferred.core.topology import Plan

SCRIPT = ROOT / "scripts" / "local-cluster.sh"
PORT = int(os.environ.get("DEFERRED_CLUSTER_PORT", "5681"))
NODES = ("rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost")
URLS = tuple(f"amqp://guest:guest@127.0.0.1:{PORT + i}/%2F" for i in range(3))
MANAGEMENT = tuple(f"http://127.0.0.1:{PORT + 10000 + i}/" for i in range(3))
#: The delay mix of the sustained points (as scenario 4's main table).
MIX = "uniform 0-5 s"
#: Producer threads calling ``defer()`` during a failover run.
PRODUCERS = 4
#: How long the stuck rule, then ``deferred_repair``, may take.
STUCK_DETECT_S = 60.0
REPAIR_WAIT_S = 60.0
#: How long dead-letters still unconfirmed once every job ran get to clear by themselves.
STUCK_SETTLE_S = 20.0
#: Samples of the lateness timeline (plot): one bin per this many seconds of due time.
TIMELINE_BIN_S = 0.5


class ClusterUnavailable(RuntimeError):
    """The local cluster cannot be started or driven: the scenario fails."""


def _script(*args: str, timeout: float = 300) -> str:
    try:
        done = subprocess.run(
            ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        msg = f"local-cluster.sh {' '.join(args)}: no end in {timeout} s"
        raise ClusterUnavailable(msg) from exc
    if done.returncode != 0:
        raise ClusterUnavailable(
            f"scripts/local-cluster.sh {' '.join(args)} failed ({done.returncode}):\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout


def _running() -> bool:
    done = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, timeout=120)
    return done.returncode == 0


@contextlib.contextmanager
def local_cluster() -> Iterator[bool]:
    """The three nodes, running; yields whether they were started here (then stopped after)."""
    started = not _running()
    if started:
        print("  starting the local cluster (scripts/local-cluster.sh start)...", flush=True)
        try:
            _script("start", timeout=600)
        except ClusterUnavailable as exc:
            raise ClusterUnavailable(
                f"The cluster scenario needs the local three-node cluster, which did not "
                f"start: {exc}"
            ) from exc
    try:
        yield started
    finally:
        try:
            _heal()
        finally:
            if started:
                print("  stopping the local cluster (it was started here)...", flush=True)
                _script("stop", timeout=600)


def _vm_pid(node: int) -> int | None:
    """The OS pid of node ``node``'s (1-3) Erlang VM, found by its RABBITMQ_NODENAME."""
    want = f"RABBITMQ_NODENAME={NODES[node - 1]}".encode()
    found = subprocess.run(["pgrep", "-x", "beam.smp"], capture_output=True, text=True)
    for pid in (int(p) for p in found.stdout.split()):
        with contextlib.suppress(OSError):
            if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
    return None


def _heal() -> None:
    """Start every node that is down (a run that failed halfway)."""
    for node in (1, 2, 3):
        if _vm_pid(node) is None:
            print(f"  node {node} is down: starting it again", flush=True)
            _script("start-node", str(node))


def kill(node: int) -> float:
    """SIGKILL node ``node``'s Erlang VM (like ``local-cluster.sh kill-node``); when, exactly."""
    pid = _vm_pid(node)
    if pid is None:
        raise ClusterUnavailable(f"{NODES[node - 1]} is not running: nothing to kill")
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    if not wait_until(lambda: not _answers(PORT + node - 1), 10, 0.02):
        raise ClusterUnavailable(f"{NODES[node - 1]} (pid {pid}) still answers after SIGKILL")
    return at


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


def cluster_config(order: tuple[str, ...] = URLS) -> Config:
    """The library's defaults (radix 16, 1 ms) on quorum queues, on the three nodes."""
    return Config(queue_type="quorum", broker_urls=order, management_urls=MANAGEMENT)


# --------------------------------------------------------------------------- sustained


def sustained_points(rates: list[float], seconds: float) -> list[dict[str, Any]]:
    configs = [cluster_config(), Config(queue_type="quorum"), Config(queue_type="classic")]
    points = []
    for config in configs:
        for point in sustained.run([config], rates, [MIX], seconds):
            point["nodes"] = len(config.urls)
            point["queue_type"] = config.queue_type
            points.append(point)
    return points


# --------------------------------------------------------------------------- failover

_RAN = re.compile(r"job=(\S+) task=\S+ attempt=\d+ lateness_ms=\S+ outcome=succeeded")
_CONSUMING = re.compile(r"Worker consuming .* at 127\.0\.0\.1:(\d+)/")


def _worker_nodes(worker: Worker) -> list[int]:
    """The nodes (1-3) the worker consumed from, in order, from its log."""
    ports = [int(p) for p in _CONSUMING.findall(worker.log_path.read_text())]
    return [port - PORT + 1 for port in ports]


def _ran_ids(worker: Worker) -> set[str]:
    return set(_RAN.findall(worker.log_path.read_text()))


@dataclass
class Call:
    started: float
    seconds: float
    delay: float
    job_id: str | None
    error: str | None = None


class Producer:
    """Threads calling ``defer()`` at a steady rate; no catching up after a slow call."""

    def __init__(self, rate: float, max_delay: float, threads: int = PRODUCERS) -> None:
        self.rate, self.max_delay, self.threads = rate, max_delay, threads
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def start(self) -> None:
        self._workers = [
            threading.Thread(target=self._run, args=(seed,)) for seed in range(self.threads)
        ]
        for thread in self._workers:
            thread.start()

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        pause = self.threads / self.rate
        n = 0
        while not self._stop.is_set():
            delay = rng.uniform(0, self.max_delay)
            started = time.time()
            job_id: str | None
            error: str | None = None
            try:
                job_id = defer(noop, delay, n)
            except BrokerError as exc:
                job_id, error = getattr(exc, "job_id", None), type(exc).__name__
            seconds = time.time() - started
            self.calls.append(Call(started, seconds, delay, job_id, error))
            n += 1
            self._stop.wait(max(0.0, pause - seconds))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._workers:
            thread.join(60)


def _leaders(prefix: str, plan: Plan) -> dict[str, Any]:
    """Which node leads each of the topology's queues (management API)."""
    api = management_api(get_settings())
    queues = api.queues(prefix) or {}
    delay = [q.name for q in plan.delay_queues]
    ready = [q.name for q in plan.ready_queues.values()]
    counts: dict[int, int] = {}
    for name in delay + ready:
        info = queues.get(name)
        if info and info.leader in NODES:
            node = NODES.index(info.leader) + 1
            counts[node] = counts.get(node, 0) + 1
    ready_info = queues.get(ready[0])
    return {
        "per_node": counts,
        "queues": len(delay) + len(ready),
        "ready_leader": NODES.index(ready_info.leader) + 1
        if ready_info and ready_info.leader in NODES
        else None,
    }


def _stuck_now(plan: Plan) -> int:
    """Dead-lettered messages not moved on in the delay queues (rabbitmqctl: no lag)."""
    for node in NODES:
        counts = cli_dead_lettered("/", node)
        if counts is not None:
            return sum(counts.get(q.name, 0) for q in plan.delay_queues)
    return -1


def _repair(prefix: str, plan: Plan) -> dict[str, Any]:
    """Wait for the stuck rule (``STUCK_AFTER``), run ``deferred_repair``; what it said."""
    settings = get_settings()
    api = management_api(settings)
    names = [q.name for q in plan.delay_queues]
    since = time.monotonic()
    while time.monotonic() - since < STUCK_DETECT_S:
        queues = api.queues(prefix, history_s=settings.stuck_after_s) or {}
        if find_stuck(queues, names, settings.stuck_after_s):
            break
        time.sleep(2)
    out = io.StringIO()
    started = time.monotonic()
    problem = None
    try:
        call_command("deferred_repair", "--wait", str(REPAIR_WAIT_S), "--json", stdout=out)
    except Exception as exc:  # noqa: BLE001 - reported; the run goes on to count
        problem = f"{type(exc).__name__}: {exc}"
    try:
        outcomes = json.loads(out.getvalue() or "[]")
    except ValueError:
        outcomes = []
    return {
        "detected_after_s": round(started - since, 1),
        "repair_seconds": round(time.monotonic() - started, 1),
        "queues": len(outcomes),
        "released": sum(o.get("released") or 0 for o in outcomes),
        "methods": sorted({o.get("method") for o in outcomes if o.get("method")}),
        "problem": problem,
    }


def _pauses(ats: list[float], since: float) -> tuple[float, float]:
    """The longest interval without a job run among ``ats`` from ``since`` on: (length, start)."""
    window = sorted(a for a in ats if a >= since)
    if len(window) < 2:
        return float("nan"), float("nan")
    gaps = [(b - a, a) for a, b in itertools.pairwise(window)]
    return max(gaps)


def _timeline(first: dict[str, tuple[float, float]], killed_at: float) -> list[list[float]]:
    """Per bin of due time since the kill: [start s, jobs, p50 ms, max ms] of lateness."""
    bins: dict[int, list[float]] = {}
    for at, late in first.values():
        due = at - late / 1000 - killed_at
        bins.setdefault(int(due // TIMELINE_BIN_S), []).append(late)
    return [
        [k * TIMELINE_BIN_S, len(v), round(percentile(v, 50), 1), round(max(v), 1)]
        for k, v in sorted(bins.items())
    ]


def failover_run(
    kind: str,
    repeat: int,
    rate: float,
    max_delay: float,
    before_s: float,
    down_s: float,
    after_s: float,
) -> dict[str, Any]:
    """One node killed under a steady stream of jobs; see the module's docstring."""
    shift = repeat % 3
    order = URLS[shift:] + URLS[:shift]  # each repeat starts the clients on another node
    config = cluster_config(order)
    # This process's clients start on the first URL, whatever an earlier run's failover left.
    broker.failover.connected(order, 0)
    out: dict[str, Any] = {"kind": kind, "repeat": repeat + 1}
    with topology(config) as (prefix, plan):
        worker = Worker(config, prefix, concurrency=4)
        producer = Producer(rate, max_delay)
        rows: list[tuple[str, float, float]] = []
        try:
            worker_node = _worker_nodes(worker)[-1]
            leaders = _leaders(prefix, plan)
            per_node = leaders["per_node"]
            if kind == "worker":
                victim = worker_node
            else:
                others = [n for n in (1, 2, 3) if n != worker_node]
                victim = max(others, key=lambda n: (per_node.get(n, 0), -n))
            out.update(
                victim=NODES[victim - 1],
                worker_node=NODES[worker_node - 1],
                producer_node=NODES[URLS.index(order[0])],
                victim_leads=per_node.get(victim, 0),
                victim_leads_most=per_node.get(victim, 0) == max(per_node.values(), default=0),
                queues=leaders["queues"],
                leaders_per_node={NODES[n - 1]: c for n, c in sorted(per_node.items())},
                ready_leader_killed=leaders["ready_leader"] == victim,
            )
            producer.start()
            time.sleep(before_s)
            killed_at = kill(victim)
            time.sleep(down_s)
            restart = time.time()
            _script("start-node", str(victim))
            back_at = time.time()
            time.sleep(after_s)
            producer.stop()
            stopped_at = time.time()
            returned = {c.job_id for c in producer.calls if c.job_id and c.error is None}
            raised = [c for c in producer.calls if c.error is not None]
            # Every job due has run, unless some are stuck.
            wait_until(lambda: returned <= _ran_ids(worker), max_delay + 15, 0.5)
            missing = returned - _ran_ids(worker)
            dead_letters = stuck = _stuck_now(plan)
            if stuck > 0 and not missing:
                # Every job ran: dead-letters whose confirm is late, or stuck ones
                # whose job ran anyway. Only those that stay count.
                wait_until(lambda: _stuck_now(plan) == 0, STUCK_SETTLE_S, 2)
                stuck = _stuck_now(plan)
            repair = _repair(prefix, plan) if missing or stuck > 0 else None
            if repair is not None:
                wait_until(lambda: returned <= _ran_ids(worker), 60, 0.5)
                repair["stuck_dead_letters_after"] = _stuck_now(plan)
            out["worker_nodes"] = [NODES[n - 1] for n in _worker_nodes(worker)]
        finally:
            producer.stop()
            rows = worker.stop()
    first: dict[str, tuple[float, float]] = {}
    for job_id, at, late in rows:
        if job_id not in first or at < first[job_id][0]:
            first[job_id] = (at, late)
    ran = set(first)
    raised_ids = {c.job_id for c in raised if c.job_id}
    after_repair = missing & ran
    due_after = [late for i, (at, late) in first.items() if at - late / 1000 >= killed_at]
    due_after_not_stuck = [
        late
        for i, (at, late) in first.items()
        if at - late / 1000 >= killed_at and i not in after_repair
    ]
    next_run = min((at for _i, at, _l in rows if at >= killed_at), default=float("nan"))
    # While jobs kept coming due: from just before the kill to the producers' stop.
    pause, pause_start = _pauses(
        [at for i, at, _l in rows if i not in after_repair and at <= stopped_at], killed_at - 1.0
    )
    calls_s = [c.seconds for c in producer.calls]
    during = [c for c in producer.calls if killed_at <= c.started < back_at]
    out.update(
        killed_at=killed_at,
        down_s=round(back_at - killed_at, 1),
        start_node_s=round(back_at - restart, 1),
        produced_s=round(stopped_at - producer.calls[0].started, 1) if producer.calls else 0,
        deferred=len(returned),
        raised=len(raised),
        raised_errors=sorted({c.error for c in raised if c.error}),
        raised_ran=len(raised_ids & ran),
        # When each raising call started, relative to the kill, and how long it took (s).
        raised_calls=[[round(c.started - killed_at, 2), round(c.seconds, 2)] for c in raised],
        defer_ms=summary([s * 1000 for s in calls_s]),
        defer_over_1s=sum(1 for s in calls_s if s > 1),
        offered_during_outage_per_s=len(during) / max(back_at - killed_at, 1e-9),
        ran=len(returned & ran),
        lost=len(returned - ran),
        duplicates=len(rows) - len(ran),
        early=sum(1 for _at, late in first.values() if late < 0),
        next_run_s=next_run - killed_at,
        longest_pause_s=pause,
        longest_pause_from_s=pause_start - killed_at,
        due_after_kill=len(due_after),
        lateness_after_kill_ms=summary(due_after_not_stuck),
        dead_letters_at_end=dead_letters,
        stuck_dead_letters=max(stuck, 0),
        stuck_jobs=len(after_repair),
        stuck_lateness_ms=summary([first[i][1] for i in after_repair]),
        repair=repair,
        timeline=_timeline({i: v for i, v in first.items() if i not in after_repair}, killed_at),
    )
    return out


def failover(p: dict[str, Any]) -> list[dict[str, Any]]:
    runs = []
    for repeat in range(p["repeats"]):
        for kind in p["kinds"]:
            _heal()
            run = failover_run(
                kind,
                repeat,
                p["rate"],
                p["max_delay_s"],
                p["before_s"],
                p["down_s"],
                p["after_s"],
            )
            runs.append(run)
            lat = run["lateness_after_kill_ms"]
            print(
                f"  kill {run['victim']:19} ({kind:6}) next run {run['next_run_s']:5.2f} s, "
                f"pause {run['longest_pause_s']:5.2f} s, raised {run['raised']}, "
                f"lost {run['lost']}, dup {run['duplicates']}, stuck {run['stuck_jobs']}, "
                f"p99 {lat['p99']:7.0f} ms, max {lat['max']:7.0f} ms",
                flush=True,
            )
    return runs


def run(p: dict[str, Any]) -> dict[str, Any]:
    with local_cluster() as started:
        out: dict[str, Any] = {
            "started_cluster": started,
            "nodes": list(NODES),
            "mix": MIX,
            "seconds": p["seconds"],
            "failover_parameters": {**p["failover"], "producers": PRODUCERS},
        }
        out["points"] = sustained_points(p["rates"], p["seconds"])
        out["failover"] = failover(p["failover"])
    return out
