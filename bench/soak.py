"""A nemesis soak: steady load and random faults against real worker processes, then a
check of the complete history (``bench.soak_check``).

python -m bench.soak [--seconds 180] [--workers 3] [--concurrency 4] [--rate 150]
                     [--producers 4] [--delays 0-10] [--long-share 0.05] [--long 30-90]
                     [--faults kill,term,close,restart,pause] [--every 5-20] [--pause 5-40]
                     [--restarts N] [--cover] [--seed S] [--queue-type classic|quorum]
                     [--drain 120] [--rabbitmqctl CMD] [--cluster] [--out DIR]

Jepsen's shape. Worker processes (``run_deferred_worker``) consume a throwaway
PREFIX (radix 16, the product's default); a producer process (``bench.soak_producer``)
calls ``defer()`` from its threads at a steady rate and writes down every call; the task writes
down every run; a nemesis thread here hurts the system at random moments and
writes down every fault. The producer is a process of its own so that a
broker fault cannot stall this one, which must go on scheduling faults and
restarting workers. After ``--seconds`` the faults stop, the jobs drain, the
workers get SIGTERM, and the checker judges the whole history: none lost, none
early; duplicates are listed with their most likely cause.

The faults, one every ``--every`` seconds, among ``--faults``:

- ``kill``: SIGKILL a worker, start it again 1-3 s later;
- ``term``: SIGTERM a worker (its time to exit and its exit code are recorded), restart it;
- ``close``: ``rabbitmqctl close_all_connections`` (every client of the broker; with
  ``--cluster``, of one node);
- ``restart``: ``rabbitmqctl stop_app``, 3 s, ``start_app`` (every client of the broker;
  with ``--cluster``, one node);
- ``pause``: SIGSTOP a worker for ``--pause`` seconds, then SIGCONT (other faults go on);
- ``nodekill`` (``--cluster``, on ``scripts/local-cluster.sh``'s nodes): SIGKILL a node,
  start it again 5-15 s later.

A worker is under one fault at a time; broker faults come one at a time.
``--seed`` makes the schedule the same (the moments, kinds, targets and lengths;
not what the system does with them). ``--restarts N`` puts at least N broker
restarts in it, ``--cover`` every kind of ``--faults`` at least once.
``--rabbitmqctl`` (or ``BENCH_RABBITMQCTL``) is the command that reaches the
broker, ``rabbitmqctl`` on PATH by default (right under ``scripts/rabbitmq-release.sh
4.3 run``, whose wrappers come first there).

The output folder keeps ``calls.jsonl``, ``runs.jsonl``, ``faults.jsonl``, each
worker incarnation's log, ``soak.json`` (parameters, seed, schedule, the messages
left in the queues at the end) and
``check.json`` (the verdict); ``python -m bench.soak_check DIR`` checks it again.
Exits 0 when none was lost and none early.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import wait_until
from bench.soak_check import check, load_jsonl, report_text

ROOT = Path(__file__).resolve().parent.parent
BROKER_URL = os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
KINDS = ("kill", "term", "close", "restart", "pause")
#: How long each kind keeps the nemesis busy, about: the next fault is planned after it.
BUSY_S = {"kill": 4.0, "term": 3.0, "close": 1.0, "restart": 10.0, "pause": 0.0, "nodekill": 25.0}
#: Down time of a killed worker, and of a killed node.
KILL_DOWN_S = (1.0, 3.0)
NODE_DOWN_S = (5.0, 15.0)
RESTART_DOWN_S = 3.0
#: A worker that has not exited this long after SIGTERM is killed (and the record says so).
TERM_WAIT_S = 120.0
#: A restarted worker gets this long to say "Worker consuming" before faults may hit it.
START_WAIT_S = 60.0
CLUSTER = ROOT / "scripts" / "local-cluster.sh"
DJANGO = (sys.executable, "-m", "django")
#: The PREFIX's streams, whose message counts are records, not jobs.
BOOKKEEPING = ("results", "cancels", "topologies", "ledger", "keeper", "up")
CLUSTER_NODES = ("rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost")


def append(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, one ``os.write`` with ``O_APPEND``: writers never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def span(text: str) -> tuple[float, float]:
    """``"5-20"`` as ``(5.0, 20.0)``: an argparse type for the flags that take a range."""
    low, sep, high = text.partition("-")
    try:
        pair = (float(low), float(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range like 5-20") from None
    if pair[0] < 0 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: a range goes from low to high, from 0")
    return pair


# --------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Planned:
    """One fault of the schedule: when (seconds after the start), what, whom, how long."""

    at: float
    kind: str
    #: The worker slot (kill, term, pause) or node (nodekill, and close/restart on a
    #: cluster); a busy worker passes the fault to the next free one.
    target: int
    #: A pause's length, a killed worker's or node's down time.
    seconds: float


def plan(
    rng: random.Random,
    kinds: tuple[str, ...],
    seconds: float,
    every: tuple[float, float],
    pause: tuple[float, float],
    targets: int,
    *,
    restarts: int = 0,
    cover: bool = False,
) -> list[Planned]:
    """The faults of a run of ``seconds``: a gap drawn from ``every`` after each fault's
    expected busy time (``BUSY_S``). ``cover`` and ``restarts`` replace random faults
    of kinds there are enough of; ``ValueError`` when they do not fit."""
    slots = int(seconds / max(every[0], 0.1)) + 1
    chosen = [rng.choice(kinds) for _ in range(slots)]
    gaps = [rng.uniform(*every) for _ in range(slots)]
    aims = [rng.randrange(targets) for _ in range(slots)]
    spans = [rng.random() for _ in range(slots)]
    must = Counter(kinds if cover else ())
    must["restart"] = max(must["restart"], restarts)

    def fitting() -> int:
        at = 0.0
        for i, kind in enumerate(chosen):
            at += gaps[i]
            if at >= seconds:
                return i
            at += BUSY_S[kind]
        return len(chosen)

    drawn = list(gaps)
    # The faults that must happen may not fit with the gaps drawn: the gaps then
    # close in on the shortest allowed, step by step, before the plan gives up.
    for closer in (1.0, 0.75, 0.5, 0.25, 0.0):
        gaps = [every[0] + (gap - every[0]) * closer for gap in drawn]
        for _ in range(slots + 1):
            head = Counter(chosen[: fitting()])
            missing = [kind for kind, count in must.items() if head[kind] < count]
            if not missing:
                break
            spare = [i for i in range(fitting()) if head[chosen[i]] > must[chosen[i]]]
            if not spare:
                break
            chosen[rng.choice(spare)] = missing[0]
        if not missing:
            break
    else:
        raise ValueError(
            f"{dict(must)} faults do not fit in {seconds:g} s with gaps of "
            f"{every[0]:g}-{every[1]:g} s: run longer or closer"
        )
    out, at = [], 0.0
    for i in range(fitting()):
        at += gaps[i]
        low, high = {"pause": pause, "nodekill": NODE_DOWN_S}.get(chosen[i], KILL_DOWN_S)
        out.append(
            Planned(round(at, 3), chosen[i], aims[i], round(low + spans[i] * (high - low), 3))
        )
        at += BUSY_S[chosen[i]]
    return out


# ------------------------------------------------------------------------ the broker


class Broker:
    """``rabbitmqctl`` as configured; on a cluster, ``-n`` picks the node."""

    def __init__(self, command: list[str], url: str, nodes: tuple[str, ...] = ()) -> None:
        self.command, self.url, self.nodes = command, url, nodes
        #: A node that ``stop_app`` stopped and ``start_app`` has not started yet.
        self.stopped: list[str | None] = []

    def ctl(self, *args: str, node: int | None = None, timeout: float = 120) -> str:
        where = (
            ["-n", self.nodes[node % len(self.nodes)]] if node is not None and self.nodes else []
        )
        done = subprocess.run(
            [*self.command, *where, *args], capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)}: {(done.stderr or done.stdout)[-500:]}"
            )
        return done.stdout

    def close_all(self, node: int | None) -> None:
        self.ctl("close_all_connections", "soak", node=node)

    def restart(self, node: int | None) -> float:
        """stop_app, a pause, start_app; when it answered again."""
        which = None if node is None or not self.nodes else self.nodes[node % len(self.nodes)]
        self.stopped.append(which)
        self.ctl("stop_app", node=node)
        time.sleep(RESTART_DOWN_S)
        self.ctl("start_app", node=node)
        self.ctl("await_startup", node=node)
        self.stopped.remove(which)
        port = urllib.parse.urlsplit(self.url).port or 5672
        if node is not None and self.nodes:
            port += node % len(self.nodes)
        wait_until(lambda: _answers(port), 30)
        return time.time()

    def ensure_started(self) -> None:
        """Start again every node a restart left stopped (a run cut short)."""
        for which in list(self.stopped):
            where = ["-n", which] if which else []
            for args in (["start_app"], ["await_startup"]):
                subprocess.run([*self.command, *where, *args], capture_output=True, timeout=120)
            self.stopped.remove(which)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5):
            return True
    except OSError:
        return False


# ----------------------------------------------------------------------- the workers


class Slot:
    """One worker's place: the process now in it, and a lock held by the fault on it."""

    def __init__(self, index: int) -> None:
        self.index, self.incarnation = index, 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()

    @property
    def name(self) -> str:
        """The incarnation's name: ``w1.3`` is slot 1's third process. Runs and faults
        carry it, so a duplicate's cause can be matched to the worker that ran it."""
        return f"w{self.index}.{self.incarnation}"


class Workers:
    """The worker processes; a watchdog restarts one that ended with no fault on it."""

    def __init__(self, count: int, concurrency: int, env: dict[str, str], out: Path) -> None:
        self.slots = [Slot(i + 1) for i in range(count)]
        self.concurrency, self.env, self.out = concurrency, env, out
        self._watching = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self, slot: Slot) -> bool:
        """A new incarnation in ``slot``; whether it consumes within ``START_WAIT_S``."""
        slot.incarnation += 1
        log = self.out / f"worker-{slot.name}.log"
        with log.open("wb") as stream:
            slot.proc = subprocess.Popen(
                [*DJANGO, "run_deferred_worker", "--concurrency", str(self.concurrency)],
                cwd=ROOT,
                env={**self.env, "BENCH_SOAK_WORKER": slot.name},
                stdout=stream,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C of the soak is not a SIGINT fault of the workers.
                start_new_session=True,
            )
        proc = slot.proc
        wait_until(
            lambda: proc.poll() is not None or "Worker consuming" in log.read_text(), START_WAIT_S
        )
        return proc.poll() is None

    def start_all(self) -> None:
        for slot in self.slots:
            if not self.start(slot):
                raise RuntimeError(f"worker {slot.name} did not start: see its log in {self.out}")
        self._watching.set()
        self._watch = threading.Thread(target=self._restart_dead, name="watchdog", daemon=True)
        self._watch.start()

    def _restart_dead(self) -> None:
        while self._watching.is_set():
            time.sleep(0.5)
            for slot in self.slots:
                if not self._watching.is_set() or not slot.lock.acquire(blocking=False):
                    continue
                try:
                    assert slot.proc is not None
                    code = slot.proc.poll()
                    if code is not None:
                        now = time.time()
                        append(
                            self.out / "faults.jsonl",
                            {
                                "kind": "exit",
                                "target": slot.name,
                                "start": now,
                                "end": now,
                                "code": code,
                            },
                        )
                        print(
                            f"  worker {slot.name} exited by itself, code {code}: restarted",
                            flush=True,
                        )
                        self.start(slot)
                finally:
                    slot.lock.release()

    def take(self, preferred: int, stop: threading.Event) -> Slot | None:
        """The slot ``preferred``, or the next one free of faults; waits while all are busy."""
        while not stop.is_set():
            for k in range(len(self.slots)):
                slot = self.slots[(preferred + k) % len(self.slots)]
                if slot.lock.acquire(blocking=False):
                    return slot
            stop.wait(0.2)
        return None

    def stop_all(self) -> list[dict[str, Any]]:
        """SIGTERM every worker at once (no watchdog first); how long each took, its code."""
        self._watching.clear()
        if self._watch is not None:
            self._watch.join()
        started = time.time()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGCONT)
                slot.proc.terminate()
        stops = []
        for slot in self.slots:
            assert slot.proc is not None
            try:
                code = slot.proc.wait(TERM_WAIT_S)
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                code = slot.proc.wait()
            end = time.time()
            stops.append(
                {
                    "kind": "stop",
                    "target": slot.name,
                    "start": started,
                    "end": end,
                    "exit_s": round(end - started, 3),
                    "code": code,
                }
            )
        return stops

    def kill_all(self) -> None:
        self._watching.clear()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGCONT)
                slot.proc.kill()
                slot.proc.wait()


# ----------------------------------------------------------------------- the nemesis


class Nemesis:
    """Runs the schedule in a thread of its own: broker faults, kills and SIGTERMs one
    after the other, pauses in threads of their own (other faults go on meanwhile)."""

    def __init__(
        self,
        schedule: list[Planned],
        origin: float,
        workers: Workers,
        broker: Broker,
        faults: Path,
        cluster: bool = False,
    ) -> None:
        self.schedule, self.origin = schedule, origin
        self.workers, self.broker, self.faults, self.cluster = workers, broker, faults, cluster
        #: No new fault; ``_abort``: end the pauses under way too (the run failed).
        self._stop, self._abort = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self._pauses: list[threading.Thread] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self, abort: bool = False) -> None:
        """No more faults; wait for the ones under way (cut the pauses short if ``abort``)."""
        self._stop.set()
        if abort:
            self._abort.set()
        self._thread.join()
        for pause in self._pauses:
            pause.join()

    def _run(self) -> None:
        for planned in self.schedule:
            if self._stop.wait(max(0.0, self.origin + planned.at - time.time())):
                return
            began = time.time()
            try:
                self._do(planned)
            except Exception as exc:  # noqa: BLE001 - a fault that failed is written down
                failed = {"kind": planned.kind, "target": None, "start": began, "end": time.time()}
                self._record({**failed, "error": repr(exc)})

    def _record(self, record: dict[str, Any]) -> None:
        append(self.faults, record)
        extra = {k: v for k, v in record.items() if k not in ("kind", "target", "start", "end")}
        at, lasted = record["start"] - self.origin, record["end"] - record["start"]
        target = record["target"] or ""
        print(
            f"  +{at:6.1f} s {record['kind']:<8} {target:<6} {lasted:5.1f} s {extra or ''}",
            flush=True,
        )

    def _do(self, planned: Planned) -> None:
        kind = planned.kind
        node = planned.target if self.cluster else None
        if kind in ("close", "restart", "nodekill"):
            target = "broker" if node is None else self.broker.nodes[node % len(self.broker.nodes)]
            start = time.time()
            extra: dict[str, Any] = {}
            if kind == "close":
                self.broker.close_all(node)
            elif kind == "restart":
                extra["answered_s"] = round(self.broker.restart(node) - start, 3)
            else:
                number = str(planned.target % len(CLUSTER_NODES) + 1)
                subprocess.run([str(CLUSTER), "kill-node", number], check=True, capture_output=True)
                time.sleep(planned.seconds)
                subprocess.run(
                    [str(CLUSTER), "start-node", number], check=True, capture_output=True
                )
            self._record(
                {"kind": kind, "target": target, "start": start, "end": time.time(), **extra}
            )
            return
        slot = self.workers.take(planned.target, self._stop)
        if slot is None:
            return
        if kind == "pause":
            thread = threading.Thread(target=self._pause, args=(slot, planned.seconds), daemon=True)
            self._pauses.append(thread)
            thread.start()  # it releases the slot
            return
        try:
            assert slot.proc is not None
            target, start = slot.name, time.time()
            if kind == "kill":
                slot.proc.kill()
                slot.proc.wait()
                time.sleep(planned.seconds)
                extra = {"down_s": planned.seconds}
            else:
                slot.proc.terminate()
                try:
                    code = slot.proc.wait(TERM_WAIT_S)
                except subprocess.TimeoutExpired:
                    slot.proc.kill()
                    code = None  # not exited: killed, and reported as no code
                    slot.proc.wait()
                extra = {"exit_s": round(time.time() - start, 3), "code": code}
            consuming = self.workers.start(slot)
            self._record(
                {
                    "kind": kind,
                    "target": target,
                    "start": start,
                    "end": time.time(),
                    **extra,
                    "next": slot.name,
                    "consuming": consuming,
                }
            )
        finally:
            slot.lock.release()

    def _pause(self, slot: Slot, seconds: float) -> None:
        try:
            assert slot.proc is not None
            target, start = slot.name, time.time()
            slot.proc.send_signal(signal.SIGSTOP)
            self._abort.wait(seconds)
            slot.proc.send_signal(signal.SIGCONT)
            self._record({"kind": "pause", "target": target, "start": start, "end": time.time()})
        finally:
            slot.lock.release()


# -------------------------------------------------------------------------- the run


def _django(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DJANGO, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _delete_topology(env: dict[str, str]) -> None:
    """Every queue and exchange of the PREFIX, jobs included; tried for a minute, since
    the broker may be coming back from a restart."""
    deadline = time.monotonic() + 60
    while True:
        done = _django(env, "declare_delay_topology", "--delete", "--yes", "--force", "-v", "0")
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    if done.returncode != 0:
        print(f"the topology was not deleted: {done.stderr[-1000:]}", flush=True)


def _leftovers(broker: Broker, prefix: str) -> dict[str, int]:
    """Messages still in the PREFIX's job queues at the end, per queue: a job that never
    ran may wait there, stuck rather than gone. The bookkeeping (results, cancels,
    topologies, the ledger, the keeper's lease and its "up" marker) holds records, not
    jobs, and is left out."""
    try:
        listed = broker.ctl("-q", "list_queues", "name", "messages", "--no-table-headers")
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"the queues could not be listed: {exc}", flush=True)
        return {}
    found = {}
    for line in listed.splitlines():
        name, _, count = line.rpartition("\t")
        if name.rsplit(".", 1)[-1] in BOOKKEEPING:
            continue
        if name.startswith(f"{prefix}.") and count.isdigit() and int(count):
            found[name] = int(count)
    return found


def _drain(calls: Path, runs: Path, seconds: float) -> int:
    """Wait until every job whose call returned ok ran, at most ``seconds``; how many did not."""
    deadline = time.monotonic() + seconds
    while True:
        ok = {c["id"] for c in load_jsonl(calls) if c["outcome"] == "ok"}
        missing = len(ok - {r["id"] for r in load_jsonl(runs)})
        if missing == 0 or time.monotonic() > deadline:
            return missing
        time.sleep(2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One soak, start to verdict; whatever happens, the workers end, the broker runs
    again and the topology goes."""
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    out: Path = args.out or Path(tempfile.mkdtemp(prefix="deferred-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    prefix = f"deferred-soak-{os.getpid()}"
    kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = set(kinds) - {*KINDS, "nodekill"}
    if unknown or ("nodekill" in kinds and not args.cluster):
        raise SystemExit(f"--faults: unknown {sorted(unknown)} (nodekill needs --cluster)")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "PYTHONPATH": str(ROOT),
        "BENCH_PREFIX": prefix,
        "BENCH_RADIX": "16",
        "BENCH_QUEUE_TYPE": args.queue_type,
        "BENCH_DELAY_QUEUE_TYPE": args.delay_queue_type or "",
        "BENCH_SOAK_RUNS": str(out / "runs.jsonl"),
        "BENCH_DB": str(out / "soak.sqlite3"),
        "BENCH_LOG_LEVEL": "INFO",
    }
    url, nodes = BROKER_URL, tuple[str, ...]()
    if args.cluster:
        urls = subprocess.run([str(CLUSTER), "urls"], capture_output=True, text=True, check=True)
        env["BENCH_BROKER_URLS"] = ",".join(urls.stdout.split())
        env["BENCH_MANAGEMENT_URLS"] = ",".join(
            f"http://127.0.0.1:{(urllib.parse.urlsplit(u).port or 5672) + 10000}/"
            for u in urls.stdout.split()
        )
        url, nodes = urls.stdout.split()[0], CLUSTER_NODES
    broker = Broker(shlex.split(args.rabbitmqctl), url, nodes)
    targets = len(nodes) if args.cluster else args.workers
    try:
        schedule = plan(
            random.Random(seed),
            kinds,
            args.seconds,
            args.every,
            args.pause,
            max(targets, args.workers),
            restarts=args.restarts,
            cover=args.cover,
        )
    except ValueError as exc:
        raise SystemExit(f"python -m bench.soak: {exc}") from None
    print(
        f"soak {prefix}: seed {seed}, {args.workers} workers, {args.rate:g} jobs/s for "
        f"{args.seconds:g} s, {args.queue_type} queues "
        f"({args.delay_queue_type or args.queue_type} delay queues); "
        f"{len(schedule)} faults planned "
        f"{dict(Counter(p.kind for p in schedule))}; output in {out}",
        flush=True,
    )
    meta: dict[str, Any] = {
        "prefix": prefix,
        "seed": seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "schedule": [asdict(p) for p in schedule],
    }
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workers = Workers(args.workers, args.concurrency, env, out)
    nemesis: Nemesis | None = None
    producer: subprocess.Popen[bytes] | None = None
    try:
        declared = _django(env, "declare_delay_topology", "-v", "0")
        if declared.returncode != 0:
            raise RuntimeError(f"declare_delay_topology failed: {declared.stderr[-2000:]}")
        workers.start_all()
        origin = time.time()
        producer_args = [
            *("--calls", str(out / "calls.jsonl"), "--rate", str(args.rate)),
            *("--producers", str(args.producers), "--seconds", str(args.seconds)),
            *("--seed", str(seed), "--long-share", str(args.long_share)),
            *("--delays", "-".join(map(str, args.delays)), "--long", "-".join(map(str, args.long))),
        ]
        with (out / "producer.log").open("wb") as log:
            producer = subprocess.Popen(
                [sys.executable, "-m", "bench.soak_producer", *producer_args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        nemesis = Nemesis(schedule, origin, workers, broker, out / "faults.jsonl", args.cluster)
        nemesis.start()
        code = producer.wait()
        if code != 0:
            raise RuntimeError(f"the producer failed ({code}): see {out / 'producer.log'}")
        print(f"producers done at +{time.time() - origin:.1f} s; faults stopping", flush=True)
        nemesis.stop()
        missing = _drain(out / "calls.jsonl", out / "runs.jsonl", args.drain)
        print(f"drained at +{time.time() - origin:.1f} s ({missing} not run)", flush=True)
        end = time.time()
        for stop in workers.stop_all():
            append(out / "faults.jsonl", stop)
        meta.update(origin=origin, end=end, leftovers=_leftovers(broker, prefix))
        (out / "soak.json").write_text(json.dumps(meta, indent=1))
        result = check(
            load_jsonl(out / "calls.jsonl"),
            load_jsonl(out / "runs.jsonl"),
            load_jsonl(out / "faults.jsonl"),
            end,
            origin=origin,
            leftovers=meta["leftovers"],
        )
        (out / "check.json").write_text(json.dumps(result, indent=1))
        print(report_text(result), flush=True)
        return result
    except BaseException:
        print("the soak stopped before its end: cleaning up", file=sys.stderr, flush=True)
        raise
    finally:
        if nemesis is not None:
            nemesis.stop(abort=True)
        if producer is not None and producer.poll() is None:
            producer.kill()
            producer.wait()
        workers.kill_all()
        broker.ensure_started()
        _delete_topology(env)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__.split("\n\n")[2],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=180.0, help="of load and faults")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="of each worker")
    p.add_argument("--rate", type=float, default=150.0, help="jobs/s, all producers together")
    p.add_argument("--producers", type=int, default=4, help="threads of the producer")
    p.add_argument("--delays", type=span, default=(0.0, 10.0), help="s, uniform")
    p.add_argument("--long-share", type=float, default=0.05, help="of the jobs, delayed --long")
    p.add_argument("--long", type=span, default=(30.0, 90.0), help="s, uniform")
    p.add_argument("--faults", default=",".join(KINDS), help="kinds (nodekill: --cluster)")
    p.add_argument("--every", type=span, default=(5.0, 20.0), help="s between faults")
    p.add_argument("--pause", type=span, default=(5.0, 40.0), help="s a paused worker stops")
    p.add_argument("--restarts", type=int, default=0, help="at least this many broker restarts")
    p.add_argument("--cover", action="store_true", help="every kind of --faults at least once")
    p.add_argument("--seed", type=int, help="the schedule's (default: random, printed)")
    p.add_argument(
        "--queue-type",
        choices=("classic", "quorum"),
        default=os.environ.get("BENCH_QUEUE_TYPE", "classic"),
        help="the ready, hold and failed queues' (QUEUE_TYPE)",
    )
    p.add_argument(
        "--delay-queue-type",
        choices=("classic", "quorum"),
        default=os.environ.get("BENCH_DELAY_QUEUE_TYPE") or None,
        help="the delay queues' (DELAY_QUEUE_TYPE; default: --queue-type's)",
    )
    p.add_argument("--drain", type=float, default=120.0, help="s at most, after the load")
    p.add_argument(
        "--rabbitmqctl",
        default=os.environ.get("BENCH_RABBITMQCTL", "rabbitmqctl"),
        help="the command that reaches the broker",
    )
    p.add_argument("--cluster", action="store_true", help="on scripts/local-cluster.sh's nodes")
    p.add_argument("--out", type=Path, help="output folder (default: a new temporary one)")
    return p


def main(argv: list[str] | None = None) -> int:
    result = run(parser().parse_args(argv))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
