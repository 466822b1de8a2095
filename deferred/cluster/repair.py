"""Repairing stuck dead-letters: a new leader election of the stuck queue.

What releases them (:mod:`deferred.cluster.stuck`) is a leader election of that one
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

import json
import logging
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from deferred.broker.http_api import SAMPLE_EVERY_S, ManagementAPI, ManagementError, QueueInfo
from deferred.cluster.stuck import StuckQueue

logger = logging.getLogger("deferred.repair")

#: How long one ``rabbitmq-queues`` call may take.
CLI_TIMEOUT_S = 60.0
#: How long reading one replica's view of a queue may take.
STATUS_TIMEOUT_S = 10.0
#: Adding the replica back is tried this many times, this far apart, before
#: the operator is given the command: until it is back the queue has one
#: replica fewer.
ADD_ATTEMPTS = 3
ADD_PAUSE_S = 2.0


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


def cli_quorum_status(stuck: StuckQueue, vhost: str) -> StuckQueue | None:
    """``stuck`` with its leader and replicas as they are now, read by ``rabbitmq-queues
    quorum_status`` from the replicas themselves; ``None`` when that cannot be read here.

    The management API's figures lag a leader change by up to a minute: the
    repair must not act on a leader or a replica set that changed since.
    """
    cli = cli_path()
    asked = [n for n in (*stuck.online, *stuck.members) if n != stuck.leader] + [
        n for n in (stuck.leader,) if n
    ]
    if cli is None or not asked:
        return None
    # Two replicas at most, briefly each: a node whose host does not answer
    # holds the CLI for nearly a minute.
    for node in list(dict.fromkeys(asked))[:2]:
        argv = [cli, "-q", "-n", node, "quorum_status", "-p", vhost, stuck.queue]
        try:
            result = subprocess.run(
                [*argv, "--formatter", "json"],
                capture_output=True,
                text=True,
                timeout=STATUS_TIMEOUT_S,
                check=False,
            )
            rows = json.loads(result.stdout) if result.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            rows = None
        read = replicas_of(rows)
        if read is None:
            continue
        leader, members, online = read
        return replace(stuck, leader=leader, members=members, online=online)
    return None


def replicas_of(rows: object) -> tuple[str | None, tuple[str, ...], tuple[str, ...]] | None:
    """``(leader, members, online voters)`` from ``quorum_status --formatter json``.

    Both shapes: 3.x rows carry Node Name, Raft State, Log Index...; 4.x
    rows add Membership (voter, non_voter, promotable), Last Log Index and
    friends, and drop Log Index. A replica that does not vote yet (a new
    member catching up) cannot keep the majority: it is not counted online.
    ``None`` when ``rows`` is neither shape.
    """
    if not isinstance(rows, list):
        return None
    try:
        states = {str(row["Node Name"]): str(row["Raft State"]) for row in rows}
        voting = {
            str(row["Node Name"]): str(row.get("Membership", "voter")) == "voter" for row in rows
        }
    except (KeyError, TypeError, AttributeError):
        return None
    leaders = [n for n, state in states.items() if state == "leader"]
    online = tuple(
        n for n, state in states.items() if state in ("leader", "follower") and voting[n]
    )
    return (leaders[0] if len(leaders) == 1 else None, tuple(states), online)


def repair(
    stuck: StuckQueue,
    api: ManagementAPI,
    *,
    use_api: bool = True,
    use_cli: bool = True,
    sleep: Any = time.sleep,
) -> Repair:
    """Force a leader election of ``stuck``'s queue by the first way that works here.

    The leader and replicas are read again first, from the replicas when the
    CLI is here: the figures ``stuck`` was found with may be a minute old.
    """
    if use_cli:
        fresh = cli_quorum_status(stuck, api.vhost)
        if fresh is not None and fresh.leader != stuck.leader and stuck.leader is not None:
            return Repair(
                stuck.queue,
                stuck.leader,
                "manual",
                False,
                commands(fresh, api.vhost),
                f"the leadership moved to {fresh.leader or 'no node yet'} since the queue was "
                "read: an election happened, which releases stuck dead-letters; check again",
            )
        stuck = fresh or stuck
    manual = commands(stuck, api.vhost)
    why_not = refusal(stuck)
    if why_not:
        return Repair(stuck.queue, stuck.leader, "manual", False, manual, why_not)
    assert stuck.leader is not None
    leader = stuck.leader
    problems = []
    if use_api and api.enabled:
        try:
            api.delete_member(stuck.queue, leader)
        except LookupError:
            problems.append("the management API has no quorum replica endpoints (RabbitMQ < 3.13)")
        except ManagementError as exc:
            if "not sent to another node" in str(exc):
                # It may have been done: never try a second way on top of it.
                return Repair(stuck.queue, leader, "api", False, manual, str(exc))
            problems.append(f"the management API refused (administrator tag needed?): {exc}")
        else:
            problem = _again(lambda: _api_add(api, stuck.queue, leader), sleep)
            if problem:
                return Repair(
                    stuck.queue,
                    leader,
                    "api",
                    True,
                    manual,
                    f"the leader was moved, but adding {leader}'s replica back failed "
                    f"{ADD_ATTEMPTS} times ({problem}): run `{manual[1]}`",
                )
            return Repair(stuck.queue, leader, "api", True, manual)
    cli = cli_path() if use_cli else None
    if cli:
        remove, add = commands(stuck, api.vhost, cli)
        problem = _run(remove)
        if problem is not None:
            problems.append(f"`{remove}` failed: {problem}")
        else:
            problem = _again(lambda: _run(add), sleep)
            if problem is None:
                return Repair(stuck.queue, leader, "cli", True, manual)
            return Repair(
                stuck.queue,
                leader,
                "cli",
                True,
                manual,
                f"the leader was moved, but `{add}` failed {ADD_ATTEMPTS} times ({problem}): "
                "run it again",
            )
    elif use_cli:
        problems.append("rabbitmq-queues is not installed on this host")
    return Repair(stuck.queue, leader, "manual", False, manual, "; ".join(problems))


def _api_add(api: ManagementAPI, queue: str, node: str) -> str | None:
    try:
        api.add_member(queue, node)
    except (LookupError, ManagementError) as exc:
        return str(exc)
    return None


def _again(attempt: Any, sleep: Any) -> str | None:
    """Run ``attempt`` (``None`` on success, else the problem) up to ADD_ATTEMPTS times."""
    problem = None
    for number in range(ADD_ATTEMPTS):
        if number:
            sleep(ADD_PAUSE_S)
        problem = attempt()
        if problem is None:
            return None
    return problem


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
