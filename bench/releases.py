"""Scenario: RabbitMQ 4.3 beside the system broker (3.10), classic and quorum queues.

Sustained offered rate against lateness, the machinery of scenario 4
(:mod:`bench.sustained`: a fresh topology, one worker subprocess, producers
at a fixed rate, warm-up jobs left out), on two brokers in the same run: the
system broker (``BROKER_URL``, 127.0.0.1:5672) and a 4.3 node started beside
it by ``scripts/rabbitmq-release.sh 4.3 start`` (127.0.0.1:5643). The
library's defaults otherwise (radix 16, 1 ms).

The brokers take turns: for each offered rate and queue type, one point on
each, the order flipped at every step, so that whatever else the machine does
weighs on both alike. Each point measures the CPU of both Erlang VMs over the
same window: the broker under test, and the other one, idle but for the
machine's other work. Each round starts with pika's raw limits (scenario 1)
on each broker.

The 4.3 node is started if it does not run, and stopped at the end only then.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pika
import pika.exceptions

from bench import raw, sustained
from bench.common import (
    BROKER_URL,
    ROOT,
    Config,
    Worker,
    broker_pids,
    cpu_meter,
    summary,
    topology,
)
from deferred.broker import BrokerError
from deferred.core.parsers import MANAGEMENT_PORT

SCRIPT = ROOT / "scripts" / "rabbitmq-release.sh"
#: As scenario 4: one worker process with this concurrency, this many producer threads.
CONCURRENCY = 4
PRODUCERS = 4


class ReleaseUnavailable(RuntimeError):
    """The 4.3 node cannot be started: the scenario fails (it never skips)."""


@dataclass(frozen=True)
class Broker:
    """One broker measured; ``nodename`` picks its Erlang VM out of the machine's."""

    name: str
    url: str
    #: Its management API; ``None``: the library's default (the plugin's port on its host).
    management_url: str | None = None
    #: ``RABBITMQ_NODENAME`` in its VM's environment; ``None``: found by its port alone.
    nodename: str | None = None
    #: The release to start beside the system broker (``rabbitmq-release.sh``), if any.
    release: str | None = None


SYSTEM = Broker("system", BROKER_URL)
RELEASE_43 = Broker(
    "4.3",
    "amqp://guest:guest@127.0.0.1:5643/%2F",
    management_url="http://127.0.0.1:15643/",
    nodename="rabbit-43@localhost",
    release="4.3",
)
BROKERS = {b.name: b for b in (SYSTEM, RELEASE_43)}


@dataclass(frozen=True)
class ReleaseConfig(Config):
    """A :class:`Config` on one broker named by its URL, the library's defaults otherwise.

    Unlike a cluster's (``broker_urls``), it keeps the default stuck-watch settings.
    """

    url: str = BROKER_URL
    management_url: str | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        return (self.url,)

    def env(self, prefix: str) -> dict[str, str]:
        env = {**super().env(prefix), "DEFERRED_BROKER_URL": self.url}
        if self.management_url:
            env["BENCH_MANAGEMENT_URLS"] = self.management_url
        return env

    def deferred_settings(self, prefix: str) -> dict[str, Any]:
        settings = {**super().deferred_settings(prefix), "BROKER_URL": self.url}
        if self.management_url:
            settings["MANAGEMENT_URL"] = [self.management_url]
        return settings


def config_for(broker: Broker, queue_type: str) -> ReleaseConfig:
    return ReleaseConfig(
        queue_type=queue_type, url=broker.url, management_url=broker.management_url
    )


# --------------------------------------------------------------------------- the 4.3 node


def _script(release: str, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["bash", str(SCRIPT), release, command],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        msg = f"scripts/rabbitmq-release.sh {release} {command}: no end in {timeout} s"
        raise ReleaseUnavailable(msg) from exc


@contextlib.contextmanager
def running(broker: Broker) -> Iterator[bool]:
    """``broker`` running; yields whether it was started here (then it is stopped after)."""
    if broker.release is None:
        yield False
        return
    started = _script(broker.release, "status", 120).returncode != 0
    if started:
        print(f"  starting RabbitMQ {broker.release} (rabbitmq-release.sh start)...", flush=True)
        done = _script(broker.release, "start", 600)
        if done.returncode != 0:
            raise ReleaseUnavailable(
                f"The releases scenario needs RabbitMQ {broker.release} beside the system "
                f"broker, which did not start ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
    try:
        yield started
    finally:
        if started:
            print(f"  stopping RabbitMQ {broker.release} (it was started here)...", flush=True)
            _script(broker.release, "stop", 300)


def _netns(pid: int | str) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/net")
    return None


def vm_pid(broker: Broker) -> int | None:
    """The OS pid of ``broker``'s Erlang VM: listening on its port (:func:`broker_pids`),
    in this network namespace (``rabbitmq-release.sh run`` starts nodes on 5672 in
    namespaces of their own), and with its ``RABBITMQ_NODENAME`` when it has one."""
    own = _netns("self")
    for pid in broker_pids([broker.url]):
        if own is not None and _netns(pid) not in (own, None):
            continue
        if broker.nodename is not None:
            want = f"RABBITMQ_NODENAME={broker.nodename}".encode()
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if want not in environ:
                continue
        return pid
    return None


def describe(broker: Broker) -> dict[str, Any]:
    """What the broker says it is (AMQP server properties), and its VM."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        props = connection._impl.server_properties
    finally:
        connection.close()

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    host = urllib.parse.urlsplit(broker.url).hostname or "127.0.0.1"
    port = urllib.parse.urlsplit(broker.management_url or "").port or MANAGEMENT_PORT
    return {
        "url": broker.url,
        "version": text(props.get("version", "?")),
        "erlang": text(props.get("platform", "?")),
        "node": text(props.get("cluster_name", "?")),
        "pid": vm_pid(broker),
        # Its management plugin runs (and collects statistics, which costs some CPU).
        "management": _answers(host, port),
    }


def _answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), 1.0):
        return True
    return False


# --------------------------------------------------------------------------- points


def raw_limits(broker: Broker, messages: int) -> dict[str, Any]:
    """Scenario 1 (pika alone, a classic queue) against ``broker``."""
    with mock.patch.object(raw, "BROKER_URL", broker.url):
        return raw.run(messages)


def point(
    broker: Broker,
    other: Broker | None,
    queue_type: str,
    mix: str,
    rate: float,
    seconds: float,
    warm_up: bool = True,
) -> dict[str, Any]:
    """One point of scenario 4 on ``broker``; both brokers' CPU over the same window.

    ``warm_up=False`` leaves out scenario 4's warm-up jobs (the smoke run, which
    only checks that the scenario runs).
    """
    config = config_for(broker, queue_type)
    delay_of = sustained.mixes()[mix]
    pid = vm_pid(broker)
    other_pid = vm_pid(other) if other else None
    with topology(config) as (prefix, plan):
        worker = Worker(config, prefix, CONCURRENCY)
        warm = sustained._warm_up(delay_of) if warm_up else set()
        delays: list[float] = []
        with (
            cpu_meter([pid] if pid else []) as cpu,
            cpu_meter([other_pid] if other_pid else []) as idle,
            machine_meter() as machine,
        ):
            achieved = sustained._produce(rate, seconds, delay_of, PRODUCERS, delays)
            worker.wait_for_runs(len(warm) + len(delays), max(delays, default=0))
        # Each connection the worker opened: more than one, something closed it.
        connections = worker.log().count("Worker consuming")
        rows = [row for row in worker.stop() if row[0] not in warm]
    first: dict[str, float] = {}
    for job_id, _at, late in rows:
        first.setdefault(job_id, late)
    lateness = list(first.values())
    return {
        "broker": broker.name,
        "queue_type": queue_type,
        "config": config.label,
        "mix": mix,
        "offered_per_s": rate,
        "achieved_per_s": achieved,
        "jobs": len(delays),
        "ran": len(first),
        "lost": max(0, len(delays) - len(first)),
        "duplicates": len(rows) - len(first),
        "early": sum(1 for late in lateness if late < 0),
        "hops_mean": sum(plan.hops(int(d * 1000)) for d in delays) / max(1, len(delays)),
        "lateness_ms": summary(lateness),
        "worker_reconnects": max(0, connections - 1),
        "broker_cpu_pct": cpu["broker_cpu_pct"],
        "other_broker_cpu_pct": idle["broker_cpu_pct"] if other else None,
        **machine,
    }


@contextlib.contextmanager
def machine_meter() -> Iterator[dict[str, float]]:
    """How busy the whole machine was over the block, in percent of all its cores
    (``/proc/stat``): the bench, both brokers and whatever else runs."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    out: dict[str, float] = {}
    yield out
    busy1, total1 = sample()
    out["machine_busy_pct"] = 100 * (busy1 - busy0) / max(1, total1 - total0)


def _saturated(p: dict[str, Any]) -> bool:
    """Past this point, higher rates only take longer to say the same (as scenario 4)."""
    slow = p["achieved_per_s"] < 0.9 * p["offered_per_s"]
    return bool(slow or p["lateness_ms"]["p99"] > 2000 or p["lost"] > 0)


def run(p: dict[str, Any]) -> dict[str, Any]:
    brokers = [BROKERS[name] for name in p["brokers"]]
    with contextlib.ExitStack() as stack:
        started = {b.name: stack.enter_context(running(b)) for b in brokers}
        out: dict[str, Any] = {
            "brokers": {b.name: describe(b) for b in brokers},
            "started": started,
            "mix": p["mix"],
            "seconds": p["seconds"],
            "concurrency": CONCURRENCY,
            "producers": PRODUCERS,
            "rounds": p["rounds"],
            "warm_up": p["warm_up"],
            "raw": [],
            "points": [],
        }
        try:
            _measure(p, brokers, out)
        except (BrokerError, RuntimeError, pika.exceptions.AMQPError) as exc:
            # A broker that stops answering ends the run: what was measured until
            # then is kept, and the report says where and why it stopped.
            out["stopped"] = f"{out.pop('at', '?')}: {type(exc).__name__}: {str(exc)[:300]}"
            print(f"  stopped at {out['stopped']}", flush=True)
        out.pop("at", None)
    return out


def _measure(p: dict[str, Any], brokers: list[Broker], out: dict[str, Any]) -> None:
    """The rounds, brokers taking turns; ``out['at']`` says what is being measured."""
    step = 0
    for round_ in range(1, p["rounds"] + 1):
        for broker in brokers if round_ % 2 else brokers[::-1]:
            out["at"] = f"round {round_}, raw limits of {broker.name}"
            limits = raw_limits(broker, p["raw"])
            out["raw"].append({"broker": broker.name, "round": round_, **limits})
            print(
                f"  raw {broker.name:6} publish+confirm "
                f"{limits['publish_confirm_each_per_s']:6.0f}/s consume+ack "
                f"{limits['consume_ack_prefetch100_per_s']:6.0f}/s",
                flush=True,
            )
        saturated: set[tuple[str, str]] = set()
        for rate in p["rates"]:
            for queue_type in p["queue_types"]:
                order = brokers if step % 2 == 0 else brokers[::-1]
                step += 1
                for broker in order:
                    if (broker.name, queue_type) in saturated:
                        continue
                    other = next((b for b in brokers if b is not broker), None)
                    out["at"] = f"round {round_}, {broker.name} {queue_type} {rate:g}/s"
                    started_at = time.monotonic()
                    result = point(
                        broker,
                        other,
                        queue_type,
                        p["mix"],
                        rate,
                        p["seconds"],
                        warm_up=p["warm_up"],
                    )
                    result["round"] = round_
                    out["points"].append(result)
                    _print(result, time.monotonic() - started_at)
                    if _saturated(result):
                        saturated.add((broker.name, queue_type))


def _print(result: dict[str, Any], seconds: float) -> None:
    lat, idle = result["lateness_ms"], result["other_broker_cpu_pct"]
    print(
        f"  {result['broker']:6} {result['queue_type']:7} offered "
        f"{result['offered_per_s']:5.0f}/s achieved {result['achieved_per_s']:5.0f}/s "
        f"p50 {lat['p50']:6.1f} p99 {lat['p99']:7.1f} max {lat['max']:7.1f} ms "
        f"lost {result['lost']} early {result['early']} cpu {result['broker_cpu_pct']:4.0f}% "
        f"(other {float('nan') if idle is None else idle:3.0f}%) machine "
        f"{result['machine_busy_pct']:3.0f}% [{seconds:4.1f} s]",
        flush=True,
    )
