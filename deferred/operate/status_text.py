"""The status as text: what ``deferred_status`` prints, and the durations the
status page shows. The snapshot itself is :mod:`deferred.operate.status`.
"""

from __future__ import annotations

import math
from datetime import datetime

from django.template.defaultfilters import pluralize

from deferred.cluster.nodes import ClusterView
from deferred.operate.status import Snapshot
from deferred.records.schedules import Overview

_UNITS = (
    ("y", 365 * 86_400_000),
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("min", 60_000),
    ("s", 1_000),
    ("ms", 1),
)


def format_duration(ms: int) -> str:
    """``ms`` in its two largest units, rounded *up*: it is used for upper bounds."""
    if ms < 1_000:
        return f"{ms} ms"

    def unit(value: int) -> int:
        return next(i for i, (_name, size) in enumerate(_UNITS) if value >= size)

    step = _UNITS[unit(ms) + 1][1]
    ms = math.ceil(ms / step) * step  # may carry into the next unit: 59 min 59.9 s is 1 h
    index = unit(ms)
    (name, size), (small_name, small_size) = _UNITS[index], _UNITS[index + 1]
    big, rest = divmod(ms, size)
    small = math.ceil(rest / small_size)
    return f"{big} {name}" + (f" {small} {small_name}" if small else "")


#: What to do about a topology that is not on the broker, whoever declares it.
NOT_DECLARED_HINT = (
    "run declare_delay_topology, or with DECLARE off apply what its "
    "--format definitions or --format terraform prints"
)


def render_text(snapshot: Snapshot) -> str:
    """The snapshot as ``deferred_status`` prints it."""

    def number(value: int | None, missing: str = "-") -> str:
        return missing if value is None else str(value)

    lines = [
        f"deferred status  prefix {snapshot.prefix}  "
        f"{snapshot.taken_at.strftime('%Y-%m-%d %H:%M:%S')} UTC",
        "",
        f"{'queue':<16} {'ready':>7} {'unacked':>8} {'held':>7} {'consumers':>10} {'failed':>7}",
    ]
    for queue in snapshot.queues:
        lines.append(
            f"{queue.name:<16} {number(queue.ready):>7} {number(queue.unacked, 'n/a'):>8} "
            f"{number(queue.held, 'n/a'):>7} {number(queue.consumers):>10} "
            f"{number(queue.failed, '?'):>7}"
        )
    failed = number(snapshot.failed, "no failed queue")
    if snapshot.failed_elsewhere:
        failed += f" ({snapshot.failed_elsewhere} bound for no queue above)"
    lines.append(f"failed, all queues: {failed}")
    for topology in snapshot.topologies:
        state = "current" if topology.current else "old, draining"
        lines += ["", f"topology {topology.topology} ({state}): "]
        if topology.pending is None:
            lines[-1] += f"not on the broker ({NOT_DECLARED_HINT})"
            continue
        lines[-1] += f"{topology.pending} job{pluralize(topology.pending)} pending"
        for level in topology.levels:
            if level.jobs and level.longest_wait_ms is not None:
                lines.append(
                    f"  L{level.level:02d}  {level.jobs:>7} job{pluralize(level.jobs)}, "
                    f"due within {format_duration(level.longest_wait_ms)}"
                )
    lines += ["", "pending jobs by how long they can still wait:"]
    widest = max((b.jobs for b in snapshot.chart), default=0)
    for bucket in snapshot.chart:
        bar = "#" * (math.ceil(30 * bucket.jobs / widest) if widest else 0)
        lines.append(f"  {bucket.label:<10} {bucket.jobs:>7}  {bar}".rstrip())
    lines += [
        "",
        f"total: {snapshot.pending} pending, {snapshot.ready} ready, "
        f"{number(snapshot.held, 'n/a')} held, {number(snapshot.unacked, 'n/a')} unacked, "
        f"{number(snapshot.failed, '-')} failed",
    ]
    if snapshot.unacked_source is None:
        lines.append(
            "(unacked and held: n/a: AMQP does not report messages a worker holds; they show "
            "when RabbitMQ's management API answers)"
        )
    if snapshot.cluster is not None:
        quorum = snapshot.topologies[0].queue_type == "quorum"
        lines += ["", *render_cluster(snapshot.cluster, quorum=quorum)]
    if snapshot.schedules is not None:
        lines += ["", *render_schedules(snapshot.schedules)]
    if snapshot.cancels is not None:
        lines += ["", f"cancels in force: {snapshot.cancels}"]
    elif snapshot.cancels_error is not None:
        lines += ["", f"cancels in force: unknown ({snapshot.cancels_error})"]
    if snapshot.keys is not None:
        lines += [
            f"debounce keys in force: {snapshot.keys} "
            f"({snapshot.superseded} superseded job{pluralize(snapshot.superseded)} remembered, "
            "each dropped when it comes due)"
        ]
    lines += ["", render_results(snapshot)]
    return "\n".join(lines)


def render_results(snapshot: Snapshot) -> str:
    """One line: whether results are written, how long they are kept, how many."""
    if not snapshot.results:
        return "results: off (DEFERRED['RESULTS'] is False)"
    ttl = format_duration(snapshot.result_ttl_ms)
    if snapshot.result_messages is None:
        return f"results: kept for {ttl}; the results stream is not declared yet"
    return (
        f"results: kept for {ttl}; about {snapshot.result_messages} "
        f"message{pluralize(snapshot.result_messages)} of result records "
        "in the stream"
    )


def render_schedules(seen: Overview) -> list[str]:
    """The recurring jobs part of ``deferred_status``."""
    lines = [f"recurring jobs (scheduling worker: {seen.leader or 'none yet'}):"]
    for s in seen.schedules:
        state = "paused" if s.paused else f"next {_moment(s.next_run)}"
        lines.append(f"  {s.name}: {s.rule}; {state}; last {_moment(s.last_run)}")
    return lines


def _moment(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def render_cluster(view: ClusterView, *, quorum: bool = True) -> list[str]:
    """The cluster part of ``deferred_status``: nodes, leaders, stuck dead-letters.

    One line for a single broker with no management API: there is nothing
    more to tell.
    """
    if view.nodes_source == "amqp" and len(view.nodes) == 1:
        return [f"read from {view.read_from}"]
    source = "management API" if view.nodes_source == "management" else "AMQP"
    lines = [f"read from {view.read_from}; nodes (from the {source}):"]
    for node in view.nodes:
        alarms = f"  alarms: {', '.join(node.alarms)}" if node.alarms else ""
        lines.append(f"  {node.name:<40} {node.state}{alarms}")
    if view.leaders is not None:
        lines.append(
            "queue leaders per node: "
            + (", ".join(f"{node} {count}" for node, count in view.leaders.items()) or "none")
        )
    if view.stuck_unknown and quorum:
        lines.append(f"stuck dead-letters: unknown ({view.stuck_unknown})")
    elif view.stuck is None:
        if quorum:
            lines.append("stuck dead-letters: unknown (needs RabbitMQ's management API)")
    elif not view.stuck:
        lines.append("stuck dead-letters: none")
    for stuck in view.stuck or ():
        lines.append(
            f"STUCK: {stuck.jobs} dead-lettered job{pluralize(stuck.jobs)} in {stuck.queue} "
            f"{pluralize(stuck.jobs, 'has,have')} not moved for "
            f"{stuck.for_s:.0f} s (leader {stuck.leader}): run `python manage.py deferred_repair`"
        )
    return lines
