"""The local three-node cluster (``scripts/local-cluster.sh``) as the tests drive it.

The session starts it once (or reuses one already running, which it then
leaves running) and stops it and removes its folder at the end, even when
tests fail. Every test that kills or stops a node starts it again in a
``finally``.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from deferred.broker import admin_channel
from deferred.broker.http_api import ManagementAPI
from deferred.conf import get_settings
from deferred.core.topology import Plan, plan_topology

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "local-cluster.sh"
PORT = int(os.environ.get("DEFERRED_CLUSTER_PORT", "5681"))
NODES = ("rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost")
URLS = tuple(f"amqp://guest:guest@127.0.0.1:{PORT + i}/%2F" for i in range(3))
MANAGEMENT = tuple(f"http://127.0.0.1:{PORT + 10000 + i}/" for i in range(3))


def script(*args: str, timeout: float = 180) -> str:
    result = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"local-cluster.sh {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return result.stdout


@dataclass
class Cluster:
    started_here: bool
    down: set[int] = field(default_factory=set)

    def api(self) -> ManagementAPI:
        return ManagementAPI(MANAGEMENT, URLS, timeout=5)

    def kill(self, node: int) -> None:
        """SIGKILL node ``node`` (1-3)."""
        self.down.add(node)
        script("kill-node", str(node))

    def stop(self, node: int) -> None:
        """Stop node ``node`` politely (``rabbitmqctl stop``)."""
        self.down.add(node)
        subprocess.run(
            ["rabbitmqctl", "-q", "-n", NODES[node - 1], "stop"],
            capture_output=True,
            timeout=120,
            check=True,
        )

    def start(self, node: int) -> None:
        script("start-node", str(node))
        self.down.discard(node)

    def heal(self) -> None:
        """Start every node a test left down."""
        for node in sorted(self.down):
            self.start(node)

    def leader_counts(self, prefix: str, queues: list[str]) -> dict[str, int]:
        found = self.api().queues(prefix) or {}
        counts: dict[str, int] = {}
        for name in queues:
            info = found.get(name)
            if info and info.leader:
                counts[info.leader] = counts.get(info.leader, 0) + 1
        return counts

    def wait_all_online(self, prefix: str, queues: list[str], timeout: float = 90) -> None:
        """Until every replica of ``queues`` is online (a restarted node caught up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.api().queues(prefix) or {}
            if all(
                q in found and found[q].leader and set(found[q].members) == set(found[q].online)
                for q in queues
            ):
                return
            time.sleep(1)
        raise AssertionError(f"replicas still offline after {timeout} s")


def node_number(name: str) -> int:
    return NODES.index(name) + 1


@contextmanager
def cluster_session() -> Iterator[Cluster]:
    running = subprocess.run(
        ["bash", str(SCRIPT), "status"], capture_output=True, text=True, timeout=60
    )
    cluster = Cluster(started_here=running.returncode != 0)
    try:
        if cluster.started_here:
            script("start", timeout=300)
        yield cluster
    finally:
        try:
            cluster.heal()
        finally:
            if cluster.started_here:
                script("stop", timeout=300)


def cluster_settings(prefix: str, **extra: Any) -> dict[str, Any]:
    """DEFERRED for a quorum topology on the local cluster, under ``prefix``."""
    return {
        **settings.DEFERRED,
        "BROKER_URL": list(URLS),
        "MANAGEMENT_URL": list(MANAGEMENT),
        "PREFIX": prefix,
        "QUEUE_TYPE": "quorum",
        "QUEUES": ["default", "other"],
        "MAX_DELAY": 60,
        "STUCK_AFTER": 10,
        "REPAIR_STUCK": False,
        **extra,
    }


def worker_env(prefix: str, urls: tuple[str, ...] | list[str], **extra: str) -> dict[str, str]:
    """The environment of a worker subprocess on the cluster (see tests/settings.py)."""
    return {
        "DEFERRED_TEST_BROKER_URLS": ",".join(urls),
        "DEFERRED_TEST_MANAGEMENT_URLS": ",".join(MANAGEMENT),
        "DEFERRED_TEST_PREFIX": prefix,
        "DEFERRED_TEST_QUEUE_TYPE": "quorum",
        "DEFERRED_TEST_MAX_DELAY": "60",
        "DEFERRED_TEST_STUCK_AFTER": "10",
        "DEFERRED_TEST_REPAIR_STUCK": "false",
        **extra,
    }


@contextmanager
def quorum_topology(**extra: Any) -> Iterator[Plan]:
    """A quorum topology of the test's own on the cluster, deleted afterwards."""
    prefix = f"deferred-cluster-{uuid.uuid4().hex[:6]}"
    with override_settings(DEFERRED=cluster_settings(prefix, **extra)):
        call_command("declare_delay_topology", verbosity=0)
        plan = plan_topology(get_settings())
        try:
            yield plan
        finally:
            with admin_channel(URLS) as admin:
                admin.delete_everything(plan)
