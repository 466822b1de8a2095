"""The cluster behind ``BROKER_URL``: its nodes, where queue leaders sit, stuck dead-letters.

What ``deferred_status``, the status page and ``declare_delay_topology --list``
show of a cluster. The management API tells the most (every node and its
state, each queue's leader, dead-lettered messages); when it does not answer,
AMQP can only tell which of the configured URLs accept a connection.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deferred import broker
from deferred.broker.http_api import ManagementAPI, QueueInfo
from deferred.cluster.stuck import NO_COUNTS, StuckQueue, find_stuck
from deferred.conf import DeferredSettings


@dataclass(frozen=True)
class NodeState:
    """One node: a node name and running/down (management API), or a URL and
    answers/does not answer (AMQP)."""

    name: str
    state: str
    alarms: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "alarms": list(self.alarms)}


@dataclass(frozen=True)
class ClusterView:
    #: The node (``host:port/vhost``) the AMQP figures were read from.
    read_from: str
    #: The management API base URL that answered, or ``None``.
    api: str | None
    nodes: tuple[NodeState, ...]
    #: Where the node states come from: ``"management"`` or ``"amqp"``.
    nodes_source: str
    #: Leaders (or, for classic queues, homes) of the topology's queues per
    #: node; ``None`` without the management API.
    leaders: dict[str, int] | None
    #: Stuck delay queues; ``None`` without the management API (unknown).
    stuck: tuple[StuckQueue, ...] | None
    #: Why ``stuck`` is unknown although the API answered, if it is.
    stuck_unknown: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "read_from": self.read_from,
            "management_api": self.api,
            "nodes": [n.to_dict() for n in self.nodes],
            "nodes_source": self.nodes_source,
            "leaders": self.leaders,
            "stuck": None if self.stuck is None else [s.to_dict() for s in self.stuck],
            "stuck_unknown": self.stuck_unknown,
        }


def management_api(settings: DeferredSettings) -> ManagementAPI:
    return ManagementAPI(settings.management_urls, settings.broker_urls)


def leaders_per_node(queues: Mapping[str, QueueInfo], names: Iterable[str]) -> dict[str, int]:
    """How many of the queues ``names`` each node leads, busiest first."""
    counts = Counter(queues[n].leader or "?" for n in names if n in queues)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def observe(
    settings: DeferredSettings,
    *,
    prefix: str,
    queue_names: Iterable[str],
    delay_queue_names: Iterable[str],
    read_from: broker.Node,
    api: ManagementAPI | None = None,
) -> tuple[ClusterView, dict[str, QueueInfo] | None]:
    """The cluster as seen now, and the management API's queues under ``prefix`` (if it answered).

    ``queue_names``: the queues whose leaders are counted; ``delay_queue_names``:
    the ones checked for stuck dead-letters.
    """
    api = api or management_api(settings)
    queues = api.queues(prefix, history_s=settings.stuck_after_s) if api.enabled else None
    nodes = api.nodes() if queues is not None else None
    if nodes is not None:
        states = tuple(
            NodeState(n.name, "running" if n.running else "down", n.alarms) for n in nodes
        )
        source = "management"
    else:
        states = tuple(
            NodeState(
                broker.safe_url(url),
                "answers" if url == read_from.url or broker.answers(url) else "does not answer",
            )
            for url in settings.broker_urls
        )
        source = "amqp"
    uncounted = queues is not None and api.counts_disabled()
    view = ClusterView(
        read_from=read_from.address,
        api=api.answered if queues is not None else None,
        nodes=states,
        nodes_source=source,
        leaders=None if queues is None else leaders_per_node(queues, queue_names),
        stuck=None
        if queues is None or uncounted
        else tuple(find_stuck(queues, delay_queue_names, settings.stuck_after_s)),
        stuck_unknown=NO_COUNTS if uncounted else None,
    )
    return view, queues
