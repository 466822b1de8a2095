"""``deferred_status`` in Prometheus' text format, for the ``metrics/`` URL.

The figures are read from the broker at each scrape (as the status page
does), turned into gauges here and written by ``prometheus_client``, so the
format is the one Prometheus parses. A broker that cannot be asked gives
``deferred_broker_up 0`` and nothing else, not an error page: an alert on
that gauge is clearer than a failed scrape.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from deferred.operate.status import Snapshot
from deferred.worker.metrics import prometheus_client


def render(snapshot: Snapshot | None) -> tuple[bytes, str]:
    """The text of the metrics and its content type; ``None``: the broker did not answer."""
    client = prometheus_client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))
    return client.generate_latest(registry), client.CONTENT_TYPE_LATEST


class _Collector:
    """A one-shot collector over one snapshot."""

    def __init__(self, snapshot: Snapshot | None) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        gauge = importlib.import_module("prometheus_client.core").GaugeMetricFamily
        up = gauge("deferred_broker_up", "1 if RabbitMQ answered this scrape, else 0.")
        up.add_metric([], 0 if self.snapshot is None else 1)
        yield up
        snapshot = self.snapshot
        if snapshot is None:
            return
        pending = gauge(
            "deferred_jobs_pending",
            "Jobs waiting in the delay queues (not due yet), by topology and level.",
            labels=["topology", "level", "current"],
        )
        for topology in snapshot.topologies:
            current = "true" if topology.current else "false"
            for level in topology.levels:
                pending.add_metric([topology.topology, str(level.level), current], level.jobs)
        yield pending
        ready = gauge(
            "deferred_jobs_ready", "Due jobs no worker has taken yet, by queue.", labels=["queue"]
        )
        consumers = gauge(
            "deferred_consumers", "Workers consuming each ready queue.", labels=["queue"]
        )
        unacked = gauge(
            "deferred_jobs_unacked",
            "Jobs taken by a worker and not acked yet (running or prefetched), by queue; "
            "only when the management API answers.",
            labels=["queue"],
        )
        held = gauge(
            "deferred_jobs_held",
            "Jobs a worker holds until they are due (the last mile, HOLD_WINDOW), by queue; "
            "only when the management API answers.",
            labels=["queue"],
        )
        for queue in snapshot.queues:
            if queue.held is not None:
                held.add_metric([queue.name], queue.held)
            if queue.ready is not None:
                ready.add_metric([queue.name], queue.ready)
            if queue.consumers is not None:
                consumers.add_metric([queue.name], queue.consumers)
            if queue.unacked is not None:
                unacked.add_metric([queue.name], queue.unacked)
        yield ready
        yield consumers
        yield unacked
        yield held
        if snapshot.failed is not None:
            failed = gauge("deferred_jobs_failed", "Entries in the failed queue.")
            failed.add_metric([], snapshot.failed)
            yield failed
        if snapshot.cancels is not None:
            cancels = gauge(
                "deferred_cancels_in_force", "Cancelled jobs the workers will drop when due."
            )
            cancels.add_metric([], snapshot.cancels)
            yield cancels
        if snapshot.keys is not None and snapshot.superseded is not None:
            keys = gauge(
                "deferred_keys_in_force", "Debounce keys whose latest job can still come due."
            )
            keys.add_metric([], snapshot.keys)
            yield keys
            superseded = gauge(
                "deferred_superseded_pending",
                "Superseded debounced jobs still remembered (each dropped when it comes due).",
            )
            superseded.add_metric([], snapshot.superseded)
            yield superseded
        if snapshot.result_messages is not None:
            kept = gauge(
                "deferred_result_messages",
                "Messages of result records in the results stream (each one write, "
                "of one or more jobs), kept for RESULT_TTL.",
            )
            kept.add_metric([], snapshot.result_messages)
            yield kept
        if snapshot.schedules is not None:
            yield from _schedules(gauge, snapshot)


def _schedules(gauge: Any, snapshot: Snapshot) -> Iterator[Any]:
    assert snapshot.schedules is not None
    paused = gauge(
        "deferred_schedule_paused", "1 if the schedule is paused, else 0.", labels=["schedule"]
    )
    next_run = gauge(
        "deferred_schedule_next_run_timestamp_seconds",
        "When the schedule's next occurrence is due (Unix time).",
        labels=["schedule"],
    )
    last_run = gauge(
        "deferred_schedule_last_run_timestamp_seconds",
        "When the schedule's latest occurrence was due (Unix time).",
        labels=["schedule"],
    )
    for entry in snapshot.schedules.schedules:
        paused.add_metric([entry.name], 1 if entry.paused else 0)
        if entry.next_run is not None:
            next_run.add_metric([entry.name], entry.next_run.timestamp())
        if entry.last_run is not None:
            last_run.add_metric([entry.name], entry.last_run.timestamp())
    yield paused
    yield next_run
    yield last_run
