"""What waits where: the snapshot behind ``deferred_status`` and the status page.

AMQP has no call for queue statistics, but a passive ``queue_declare`` answers
with a queue's ready messages and consumers, and needs no plugin. That is
enough to count the jobs at each level of the delay topology and, from the
level and digit of each queue, to bound how long they can still wait: the
remaining delay of a job in ``L{i}.d{d}`` had ``d`` as its level-``i`` digit
and zeros above, so it waits at most ``d * r**i`` units there and
``r**i - 1`` units in the levels below.

What AMQP cannot say is how many messages are delivered and not yet acked
(jobs running, or prefetched by a worker). Those figures come from the
management plugin's HTTP API when it answers, and are ``None`` otherwise.

Everything here but :func:`collect` is pure: the counts come in, a
:class:`Snapshot` comes out, and tests check the arithmetic without a broker.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from deferred import broker
from deferred.cluster import nodes as cluster
from deferred.cluster.nodes import ClusterView
from deferred.cluster.stuck import NO_COUNTS
from deferred.conf import DeferredSettings
from deferred.core.topology import Plan, Queue, plan_topology, recorded_plan
from deferred.records.cancels import read_cancels
from deferred.records.failures import FailedJob, parse_failed
from deferred.records.schedules import Overview, read_overview, scheduled_tasks

#: The chart's buckets: (label, the longest wait that falls in it, in ms).
#: ``None`` is "longer than all of the above".
BUCKETS: tuple[tuple[str, int | None], ...] = (
    ("≤ 1 s", 1_000),
    ("≤ 1 min", 60_000),
    ("≤ 1 h", 3_600_000),
    ("≤ 1 day", 86_400_000),
    ("≤ 30 days", 30 * 86_400_000),
    ("longer", None),
)

#: Failed entries are read one by one to count them per queue and to list
#: them; above this many, only the total (one passive declare) is given.
FAILED_READ_LIMIT = 1000


def longest_wait_ms(plan: Plan, queue: Queue) -> int:
    """The longest a job in delay queue ``queue`` can still wait before it is due."""
    if queue.level is None or queue.digit is None:
        raise ValueError(f"{queue.name} is not a delay queue")
    units: int = (queue.digit + 1) * plan.radix**queue.level - 1
    return units * plan.resolution_ms


def bucket_of(wait_ms: int) -> int:
    """The index in :data:`BUCKETS` of a job that can still wait ``wait_ms``."""
    for index, (_label, limit) in enumerate(BUCKETS):
        if limit is None or wait_ms <= limit:
            return index
    raise AssertionError("the last bucket has no limit")


@dataclass(frozen=True)
class DelayQueueStatus:
    name: str
    level: int
    digit: int
    ttl_ms: int
    #: ``None`` when the queue does not exist on the broker.
    jobs: int | None
    longest_wait_ms: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue": self.name,
            "level": self.level,
            "digit": self.digit,
            "ttl_ms": self.ttl_ms,
            "jobs": self.jobs,
            "longest_wait_ms": self.longest_wait_ms,
        }


@dataclass(frozen=True)
class LevelStatus:
    level: int
    jobs: int
    #: The most any job at this level can still wait; ``None`` when none waits.
    longest_wait_ms: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "jobs": self.jobs, "longest_wait_ms": self.longest_wait_ms}


@dataclass(frozen=True)
class TopologyStatus:
    """One topology version: the current one, or an older one still draining."""

    topology: str
    current: bool
    radix: int
    resolution_ms: int
    queue_type: str
    #: Jobs in its delay queues; ``None`` when none of them exists (not declared, or removed).
    pending: int | None
    levels: tuple[LevelStatus, ...]
    queues: tuple[DelayQueueStatus, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "current": self.current,
            "radix": self.radix,
            "resolution_ms": self.resolution_ms,
            "queue_type": self.queue_type,
            "pending": self.pending,
            "levels": [level.to_dict() for level in self.levels],
            # Only where jobs wait: a radix-16 topology has over a hundred queues.
            "waiting_in": [q.to_dict() for q in self.queues if q.jobs],
        }


@dataclass(frozen=True)
class ReadyQueueStatus:
    """A target queue (``DEFERRED['QUEUES']``) and the ready queue the workers consume."""

    name: str
    queue: str
    #: Due jobs no worker has taken yet; ``None`` when the queue does not exist.
    ready: int | None
    #: Jobs taken by a worker and not acked yet (running or prefetched); ``None``
    #: unless the management API answered: AMQP does not report them.
    unacked: int | None
    consumers: int | None
    #: Failed jobs that were bound for this queue; ``None`` when not counted.
    failed: int | None
    #: The last mile: jobs held by a worker until they are due (the hold
    #: queue's unacked); ``None`` unless the management API answered.
    held: int | None = None
    #: Jobs due within the hold window that no worker has taken yet (the hold
    #: queue's messages); ``None`` when the hold queue does not exist.
    hold_waiting: int | None = None
    hold_queue: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queue": self.queue,
            "ready": self.ready,
            "unacked": self.unacked,
            "consumers": self.consumers,
            "failed": self.failed,
            "hold_queue": self.hold_queue,
            "held": self.held,
            "hold_waiting": self.hold_waiting,
        }


@dataclass(frozen=True)
class Bucket:
    label: str
    max_ms: int | None
    jobs: int

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "max_ms": self.max_ms, "jobs": self.jobs}


@dataclass(frozen=True)
class Snapshot:
    taken_at: datetime
    prefix: str
    current_topology: str
    queues: tuple[ReadyQueueStatus, ...]
    #: The current topology first, then the older ones recorded in the registry.
    topologies: tuple[TopologyStatus, ...]
    #: Entries of the failed queue; ``None`` when it does not exist.
    failed: int | None
    #: Failed entries bound for no queue listed here (an unreadable body, or a
    #: queue since removed from QUEUES); ``None`` when not counted per queue.
    failed_elsewhere: int | None
    #: Pending jobs (not due yet) by how long they can still wait at most.
    chart: tuple[Bucket, ...]
    #: Where the unacked figures come from: ``"management"`` or ``None`` (unknown).
    unacked_source: str | None
    #: The nodes, the node read from, leaders and stuck queues; ``None`` when not read.
    cluster: ClusterView | None = None
    #: The recurring jobs; ``None`` when there are none (or their queue is missing).
    schedules: Overview | None = None
    #: Cancels in force (jobs that will be dropped when due); ``None`` when not read.
    cancels: int | None = None
    #: Debounce keys in force (``deferred.core.keys``), and the superseded jobs still
    #: remembered (each dropped when it comes due); ``None`` when not read.
    keys: int | None = None
    superseded: int | None = None
    #: Why the cancels stream could not be read, when it exists and could not.
    cancels_error: str | None = None
    #: Whether workers write results (``RESULTS``), and for how long the stream keeps them.
    results: bool = True
    result_ttl_ms: int = 0
    #: Messages in the results stream (each holds the records of one write, of one or
    #: more jobs); ``None`` when the stream does not exist or was not read.
    result_messages: int | None = None

    @property
    def pending(self) -> int:
        """Jobs not due yet and not held: in the delay queues of every topology, and
        in the hold queues waiting for a worker."""
        return sum(t.pending or 0 for t in self.topologies) + sum(
            q.hold_waiting or 0 for q in self.queues
        )

    @property
    def held(self) -> int | None:
        """Jobs held by the workers until they are due; ``None`` when not known."""
        if any(q.held is None for q in self.queues):
            return None
        return sum(q.held or 0 for q in self.queues)

    @property
    def ready(self) -> int:
        return sum(q.ready or 0 for q in self.queues)

    @property
    def unacked(self) -> int | None:
        if any(q.unacked is None for q in self.queues):
            return None
        return sum(q.unacked or 0 for q in self.queues)

    @property
    def declared(self) -> bool:
        """Whether the current topology exists on the broker (any of its delay queues)."""
        return self.topologies[0].pending is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at.isoformat(),
            "prefix": self.prefix,
            "current_topology": self.current_topology,
            "pending": self.pending,
            "ready": self.ready,
            "unacked": self.unacked,
            "held": self.held,
            "unacked_source": self.unacked_source,
            "failed": self.failed,
            "failed_elsewhere": self.failed_elsewhere,
            "queues": [q.to_dict() for q in self.queues],
            "topologies": [t.to_dict() for t in self.topologies],
            "chart": [b.to_dict() for b in self.chart],
            "cluster": None if self.cluster is None else self.cluster.to_dict(),
            "schedules": None if self.schedules is None else self.schedules.to_dict(),
            "cancels_in_force": self.cancels,
            "keys_in_force": self.keys,
            "superseded_pending": self.superseded,
            "cancels_error": self.cancels_error,
            "results": {
                "enabled": self.results,
                "ttl_s": self.result_ttl_ms // 1000,
                "stream_messages": self.result_messages,
            },
        }


def _topology_status(
    plan: Plan, stats: Mapping[str, broker.QueueStats | None], *, current: bool
) -> TopologyStatus:
    queues = []
    for queue in plan.delay_queues:
        found = stats.get(queue.name)
        assert queue.level is not None and queue.digit is not None and queue.ttl_ms is not None
        queues.append(
            DelayQueueStatus(
                name=queue.name,
                level=queue.level,
                digit=queue.digit,
                ttl_ms=queue.ttl_ms,
                jobs=None if found is None else found.messages,
                longest_wait_ms=longest_wait_ms(plan, queue),
            )
        )
    levels = []
    for level in range(plan.levels - 1, -1, -1):
        busy = [q for q in queues if q.level == level and q.jobs]
        levels.append(
            LevelStatus(
                level=level,
                jobs=sum(q.jobs or 0 for q in busy),
                longest_wait_ms=max((q.longest_wait_ms for q in busy), default=None),
            )
        )
    present = [q.jobs for q in queues if q.jobs is not None]
    return TopologyStatus(
        topology=plan.topology_id,
        current=current,
        radix=plan.radix,
        resolution_ms=plan.resolution_ms,
        queue_type=plan.queue_type,
        pending=sum(present) if present else None,
        levels=tuple(levels),
        queues=tuple(queues),
    )


def build_snapshot(
    *,
    current: Plan,
    others: Sequence[Plan],
    stats: Mapping[str, broker.QueueStats | None],
    failed_by_queue: Mapping[str | None, int] | None,
    unacked: Mapping[str, int] | None,
    taken_at: datetime,
    cluster: ClusterView | None = None,
) -> Snapshot:
    """The snapshot, from every queue's figures (``None``: the queue does not exist).

    ``failed_by_queue`` counts failed entries by the target queue of their job
    (``None`` for an entry without a readable job); ``unacked`` maps ready
    queue names (the broker's) to their unacked messages.
    """
    topologies = (
        _topology_status(current, stats, current=True),
        *(_topology_status(plan, stats, current=False) for plan in others),
    )
    chart = [0] * len(BUCKETS)
    for topology in topologies:
        for queue in topology.queues:
            if queue.jobs:
                chart[bucket_of(queue.longest_wait_ms)] += queue.jobs
    queues = []
    for name, ready_queue in current.ready_queues.items():
        found = stats.get(ready_queue.name)
        hold_queue = current.hold_queues[name].name
        hold = stats.get(hold_queue)
        queues.append(
            ReadyQueueStatus(
                name=name,
                queue=ready_queue.name,
                ready=None if found is None else found.messages,
                unacked=None if unacked is None else unacked.get(ready_queue.name),
                consumers=None if found is None else found.consumers,
                failed=None if failed_by_queue is None else failed_by_queue.get(name, 0),
                held=None if unacked is None or hold is None else unacked.get(hold_queue, 0),
                hold_waiting=None if hold is None else hold.messages,
                hold_queue=hold_queue,
            )
        )
    failed_stats = stats.get(current.failed_queue.name)
    failed = None if failed_stats is None else failed_stats.messages
    elsewhere = None
    if failed_by_queue is not None:
        elsewhere = sum(
            n for name, n in failed_by_queue.items() if name not in current.ready_queues
        )
    return Snapshot(
        taken_at=taken_at,
        prefix=current.prefix,
        current_topology=current.topology_id,
        queues=tuple(queues),
        topologies=topologies,
        failed=failed,
        failed_elsewhere=elsewhere,
        chart=tuple(
            Bucket(label, limit, jobs) for (label, limit), jobs in zip(BUCKETS, chart, strict=True)
        ),
        unacked_source=None if unacked is None else "management",
        cluster=cluster,
    )


# --------------------------------------------------------------------------- reading the broker


@dataclass(frozen=True)
class Status:
    snapshot: Snapshot
    #: The failed entries, oldest first; ``None`` above :data:`FAILED_READ_LIMIT`
    #: or when the failed queue does not exist.
    failed_jobs: list[FailedJob] | None
    #: The ids of the failed entries that are cancelled (a retry would be dropped).
    cancelled_failed: frozenset[str] = frozenset()


def collect(settings: DeferredSettings, *, read_failed: bool = True) -> Status:
    """Read every queue of every live topology: passive declares, one connection.

    ``read_failed=False`` leaves the failed entries unread (only counted):
    what a metrics scrape every few seconds needs.

    ``BrokerError`` (or ``BrokerUnavailable``) when RabbitMQ cannot be asked.
    """
    plan = plan_topology(settings)
    failed_jobs = None
    with broker.admin_channel(settings.broker_urls) as admin:
        others = [
            recorded_plan(record, prefix=plan.prefix, queues=settings.queues)
            for record in admin.topology_records(plan)
            if record["topology"] != plan.topology_id
        ]
        names = [
            *(q.name for q in plan.ready_queues.values()),
            *(q.name for q in plan.hold_queues.values()),
            plan.failed_queue.name,
            *(q.name for p in (plan, *others) for q in p.delay_queues),
        ]
        stats = {name: admin.queue_stats(name) for name in names}
        failed = stats[plan.failed_queue.name]
        if read_failed and failed is not None and failed.messages <= FAILED_READ_LIMIT:
            with admin.take_all(plan.failed_queue.name) as (_channel, taken):
                failed_jobs = [parse_failed(t.body, t.headers, t.message_id) for t in taken]
        has_cancels = admin.queue_exists(plan.cancels_queue.name)
        kept = admin.stream_span(plan.results_queue.name)
        schedules = None
        if scheduled_tasks(settings) and admin.queue_exists(plan.schedules_queue.name):

            def peek() -> list[tuple[bytes, dict[str, Any]]]:
                with admin.take_all(plan.schedules_queue.name) as (_channel, taken):
                    return [(t.body, t.headers) for t in taken]

            schedules = read_overview(peek, settings, datetime.now(UTC))
    view, api_queues = cluster.observe(
        settings,
        prefix=plan.prefix,
        queue_names=[q.name for q in plan.all_queues if q is not plan.registry_queue],
        delay_queue_names=[q.name for p in (plan, *others) for q in p.delay_queues],
        read_from=admin.node,
    )
    unacked = None
    # Without message counts (RabbitMQ 4.3's management_metrics_collection denied)
    # the API lists every queue at 0 unacked: unknown, not zero.
    if api_queues is not None and view.stuck_unknown != NO_COUNTS:
        unacked = {
            q.name: api_queues[q.name].unacked
            for q in (*plan.ready_queues.values(), *plan.hold_queues.values())
            if q.name in api_queues
        }
    by_queue = None
    if failed_jobs is not None:
        by_queue = Counter(entry.job.queue if entry.job else None for entry in failed_jobs)
    snapshot = build_snapshot(
        current=plan,
        others=others,
        stats=stats,
        failed_by_queue=by_queue,
        unacked=unacked,
        taken_at=datetime.now(UTC),
        cluster=view,
    )
    cancels = None
    cancels_error = None
    if has_cancels:
        try:
            cancels = read_cancels(settings)
        except broker.BrokerError as exc:
            # Everything else is known: say so, rather than fail the whole status
            # (a cluster's stream coordinator may be unavailable for a while
            # after nodes restarted; the workers wait for it too).
            cancels_error = str(exc)
    return Status(
        dataclasses.replace(
            snapshot,
            schedules=schedules,
            cancels=None if cancels is None else len(cancels),
            keys=None if cancels is None else len(cancels.keys),
            superseded=None if cancels is None else cancels.keys.superseded,
            cancels_error=cancels_error,
            results=settings.results,
            result_ttl_ms=settings.result_ttl_ms,
            result_messages=kept,
        ),
        failed_jobs,
        frozenset(
            entry.id for entry in failed_jobs or () if cancels is not None and entry.id in cancels
        ),
    )
