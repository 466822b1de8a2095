"""The worker's Prometheus metrics (``run_deferred_worker --metrics-port``).

Counted where the worker decides a job's outcome, served by
``prometheus_client`` from a registry of the worker's own, so a process
that also exports its own metrics (a web process importing the app) never
sees these, and tests can run several workers in one process.

Label values are bounded: a task label is the name of a task this worker
knows (else ``unknown``), a queue label a queue of ``DEFERRED['QUEUES']``
(else ``unknown``). A forged message can name anything; it cannot make the
series grow without end.
"""

from __future__ import annotations

import importlib
from typing import Any

from deferred.core.outcomes import Observer, Outcome

#: Lateness: from "on time" (a few ms) to a backlog of minutes.
LATENESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
#: Duration: from a trivial task to a long batch job.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800)
UNKNOWN = "unknown"


class MetricsError(Exception):
    """The metrics cannot be served (no prometheus_client, or the port is taken)."""


def prometheus_client() -> Any:
    """The ``prometheus_client`` module; ``MetricsError`` saying how to get it."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError:
        raise MetricsError(
            "Metrics need prometheus_client: install deferred with its prometheus extra "
            "(pip install 'path/to/deferred[prometheus]')."
        ) from None


class WorkerMetrics(Observer):
    """The worker's counters, histograms and gauges, and the HTTP server that shows them."""

    def __init__(self, queues: tuple[str, ...]) -> None:
        client = prometheus_client()
        self._client = client
        self.registry = client.CollectorRegistry(auto_describe=True)
        self._queues = frozenset(queues)
        self.jobs = client.Counter(
            "deferred_jobs",
            "Jobs handled by this worker, by task, target queue and outcome "
            f"({', '.join(Outcome)}).",
            ["task", "queue", "outcome"],
            registry=self.registry,
        )
        self.lateness = client.Histogram(
            "deferred_job_lateness_seconds",
            "How long after its due time a job started.",
            ["queue"],
            buckets=LATENESS_BUCKETS,
            registry=self.registry,
        )
        self.duration = client.Histogram(
            "deferred_job_duration_seconds",
            "How long a task function ran, by task.",
            ["task"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.timed_out_jobs = client.Counter(
            "deferred_jobs_timed_out",
            "Attempts that ran past their time limit, by task, target queue and limit "
            "(soft: TimeLimitExceeded was raised in the task; hard: the grace passed too, "
            "and the worker process was ended).",
            ["task", "queue", "limit"],
            registry=self.registry,
        )
        self.running = client.Gauge(
            "deferred_jobs_running", "Jobs running now in this worker.", registry=self.registry
        )
        self.up = client.Gauge(
            "deferred_worker_up",
            "1 while this worker is connected and consuming, else 0.",
            registry=self.registry,
        )
        self._server: Any = None

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``address:port`` from a daemon thread."""
        try:
            started = self._client.start_http_server(port, addr=address, registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"Cannot serve metrics on {address}:{port}: {exc}") from None
        self._server = started[0] if isinstance(started, tuple) else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def queue_label(self, queue: str) -> str:
        return queue if queue in self._queues else UNKNOWN

    def consuming(self, up: bool) -> None:
        self.up.set(1 if up else 0)

    def started(self) -> None:
        self.running.inc()

    def finished(self) -> None:
        self.running.dec()

    def timed_out(self, task: str, queue: str, *, hard: bool) -> None:
        limit = "hard" if hard else "soft"
        self.timed_out_jobs.labels(task=task, queue=self.queue_label(queue), limit=limit).inc()

    def outcome(
        self,
        task: str,
        queue: str,
        outcome: str,
        *,
        lateness_s: float | None = None,
        duration_s: float | None = None,
    ) -> None:
        """Count one job's outcome; ``lateness_s``/``duration_s`` when it started or ran."""
        queue = self.queue_label(queue)
        self.jobs.labels(task=task, queue=queue, outcome=outcome).inc()
        if lateness_s is not None:
            self.lateness.labels(queue=queue).observe(max(lateness_s, 0.0))
        if duration_s is not None:
            self.duration.labels(task=task).observe(duration_s)
