"""Repairing stuck dead-letters: a new leader election of the stuck queue.

What releases them (:mod:`deferred.stuck`) is a leader election of that one
queue. The least invasive way to force one that every supported RabbitMQ
offers is to remove the leader's replica and add it back: the other replicas
elect a new leader at once, which forwards the dead-letters, and the node
that led gets a fresh replica copied from the new leader. No message is
lost, because a majority of replicas keeps every message throughout; for the
same reason the repair refuses a queue with a replica offline or fewer than
two replicas online.

Three ways to do it, in order:

1. the management API (``DELETE/POST /api/queues/quorum/VHOST/QUEUE/replicas/...``,
   RabbitMQ 3.13 and later), which needs a user with the ``administrator`` tag;
2. ``rabbitmq-queues delete_member`` / ``add_member`` on this host, which needs
   the cluster's Erlang cookie (root or the ``rabbitmq`` user on a host of the
   cluster);
3. neither: the exact commands are given for an operator to run.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deferred.http_api import SAMPLE_EVERY_S, ManagementAPI, ManagementError, QueueInfo
from deferred.stuck import StuckQueue

logger = logging.getLogger("deferred.repair")

#: How long one ``rabbitmq-queues`` call may take.
CLI_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Repair:
    """What was done (or is to be done) about one stuck queue."""

    queue: str
    leader: str | None
    #: ``"api"``, ``"cli"``, or ``"manual"`` when nothing could be run here.
    method: str
    done: bool
    #: The commands that force the election, for the record or for an operator.
    commands: tuple[str, ...]
    #: Why it was not done, or what went wrong.
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "leader": self.leader,
            "method": self.method,
            "done": self.done,
            "commands": list(self.commands),
            "problem": self.problem,
        }


def cli_path() -> str | None:
    """``rabbitmq-queues`` on this host, if any (Debian puts it in /usr/sbin)."""
    return shutil.which("rabbitmq-queues") or shutil.which(
        "rabbitmq-queues", path=os.pathsep.join(["/usr/sbin", "/usr/local/sbin"])
    )


def _cli_node(stuck: StuckQueue) -> str | None:
    """A running replica other than the leader: the node the CLI talks to."""
    return next((n for n in stuck.online if n != stuck.leader), None)


def commands(stuck: StuckQueue, vhost: str, cli: str = "rabbitmq-queues") -> tuple[str, ...]:
    """The commands that move ``stuck``'s leadership away and give its node a replica back."""
    node = _cli_node(stuck)
    target = f" -n {shlex.quote(node)}" if node else ""
    args = f"-p {shlex.quote(vhost)} {shlex.quote(stuck.queue)} {shlex.quote(stuck.leader or '?')}"
    return (
        f"{cli}{target} delete_member {args}",
        f"{cli}{target} add_member {args}",
    )


def refusal(stuck: StuckQueue) -> str | None:
    """Why forcing an election of ``stuck`` would be unsafe now, or ``None``."""
    if not stuck.leader:
        return "the queue has no leader now (an election is already under way)"
    if set(stuck.members) - set(stuck.online):
        offline = ", ".join(sorted(set(stuck.members) - set(stuck.online)))
        return f"replica(s) on {offline} are offline: removing the leader could lose the majority"
    if len(stuck.online) < 2:
        return "it has a single replica, which cannot hand its leadership over"
    return None


def repair(
    stuck: StuckQueue, api: ManagementAPI, *, use_api: bool = True, use_cli: bool = True
) -> Repair:
    """Force a leader election of ``stuck``'s queue by the first way that works here."""
    manual = commands(stuck, api.vhost)
    why_not = refusal(stuck)
    if why_not:
        return Repair(stuck.queue, stuck.leader, "manual", False, manual, why_not)
    assert stuck.leader is not None
    problems = []
    if use_api and api.enabled:
        try:
            api.delete_member(stuck.queue, stuck.leader)
        except LookupError:
            problems.append("the management API has no quorum replica endpoints (RabbitMQ < 3.13)")
        except ManagementError as exc:
            problems.append(f"the management API refused (administrator tag needed?): {exc}")
        else:
            try:
                api.add_member(stuck.queue, stuck.leader)
            except (LookupError, ManagementError) as exc:
                return Repair(
                    stuck.queue,
                    stuck.leader,
                    "api",
                    True,
                    manual,
                    f"the leader was moved, but adding {stuck.leader}'s replica back failed "
                    f"({exc}): run `{manual[1]}`",
                )
            return Repair(stuck.queue, stuck.leader, "api", True, manual)
    cli = cli_path() if use_cli else None
    if cli:
        steps = commands(stuck, api.vhost, cli)
        for number, step in enumerate(steps):
            problem = _run(step)
            if problem is None:
                continue
            if number == 0:
                problems.append(f"`{step}` failed: {problem}")
                break
            return Repair(
                stuck.queue,
                stuck.leader,
                "cli",
                True,
                manual,
                f"the leader was moved, but `{step}` failed ({problem}): run it again",
            )
        else:
            return Repair(stuck.queue, stuck.leader, "cli", True, manual)
    elif use_cli:
        problems.append("rabbitmq-queues is not installed on this host")
    return Repair(stuck.queue, stuck.leader, "manual", False, manual, "; ".join(problems))


def _run(command: str) -> str | None:
    """Run one CLI command; ``None`` when it succeeded, else what went wrong."""
    argv: Sequence[str] = shlex.split(command)
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return repr(exc)
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip()
        return output.splitlines()[-1] if output else f"exit status {result.returncode}"
    return None


@dataclass(frozen=True)
class Outcome:
    """A repair, and what moved after it."""

    repair: Repair
    #: Dead-lettered messages before the repair, and at the last reading after it.
    before: int
    after: int | None

    @property
    def released(self) -> int | None:
        return None if self.after is None else max(0, self.before - self.after)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.repair.to_dict(),
            "dead_lettered_before": self.before,
            "dead_lettered_after": self.after,
            "released": self.released,
        }


def delay_queues(queues: Mapping[str, QueueInfo], prefix: str) -> list[str]:
    """The quorum delay queues (of every topology version) under ``prefix``."""
    return [
        name
        for name, info in queues.items()
        if name.startswith(f"{prefix}.delay.") and info.type == "quorum"
    ]


def forced(info: QueueInfo) -> StuckQueue:
    """``info``'s queue treated as stuck, whatever its history (an operator's choice)."""
    return StuckQueue(
        queue=info.name,
        jobs=info.dead_lettered,
        for_s=0.0,
        leader=info.leader,
        members=info.members,
        online=info.online,
    )


def cli_dead_lettered(vhost: str, node: str) -> dict[str, int] | None:
    """Each queue's messages neither ready nor unacked, read by ``rabbitmqctl`` from the
    queues themselves; ``None`` when the CLI is not here or cannot reach the cluster.

    After a leader change the management API may go on reporting the old
    leader's figures for a minute, so what moved is read here when possible.
    """
    ctl = shutil.which("rabbitmqctl") or shutil.which(
        "rabbitmqctl", path=os.pathsep.join(["/usr/sbin", "/usr/local/sbin"])
    )
    if ctl is None:
        return None
    argv = [ctl, "-q", "-n", node, "list_queues", "-p", vhost]
    argv += ["name", "messages", "messages_ready", "messages_unacknowledged"]
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    counts = {}
    for line in result.stdout.splitlines():
        fields = line.split("\t")
        if len(fields) == 4 and all(f.isdigit() for f in fields[1:]):
            messages, ready, unacked = (int(f) for f in fields[1:])
            counts[fields[0]] = max(0, messages - ready - unacked)
    return counts


def watch_release(
    api: ManagementAPI,
    prefix: str,
    repairs: Sequence[tuple[Repair, int]],
    wait_s: float,
    *,
    cli_node: str | None = None,
    sleep: Any = time.sleep,
) -> list[Outcome]:
    """Read the repaired queues until their dead-letters are gone or ``wait_s`` passed.

    From ``rabbitmqctl -n cli_node`` when it answers here, else from
    the management API, whose figures lag: its first reading waits for a refresh.
    """
    done = {r.queue for r, _before in repairs if r.done}
    deadline = time.monotonic() + wait_s
    after: dict[str, int] = {}
    first = True
    while done:
        counts = None if cli_node is None else cli_dead_lettered(api.vhost, cli_node)
        if counts is None:
            if first:
                sleep(min(SAMPLE_EVERY_S + 1, max(0.0, deadline - time.monotonic())))
            counts = {name: q.dead_lettered for name, q in (api.queues(prefix) or {}).items()}
        first = False
        after = {name: counts[name] for name in done if name in counts}
        if all(count == 0 for count in after.values()) or time.monotonic() >= deadline:
            break
        sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    return [
        Outcome(repair, before, after.get(repair.queue) if repair.done else None)
        for repair, before in repairs
    ]
