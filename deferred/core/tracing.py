"""OpenTelemetry: one trace from ``defer()`` to the worker that runs the job.

Only when ``opentelemetry-api`` is installed (the ``otel`` extra);
without it every function here does nothing, and nothing is imported but
the failed attempt, once. The application picks the SDK and exporter, as
OpenTelemetry intends for libraries.

- ``defer()`` (and ``adefer()``, ``defer_many()``, django.tasks' enqueue)
  starts a PRODUCER span ``defer TASK`` and injects its context into the
  message headers with the global propagator (W3C ``traceparent`` by default).
- The worker runs each job inside a CONSUMER span named after the task,
  child of that producer span, with the job id, attempt, queue and
  lateness as attributes; an exception is recorded on it.
- A retry, a reschedule or a requeue carries the same headers, so every
  attempt of a job belongs to the trace of the request that deferred it.

The headers are not signed (the signature covers the body): a forged one
can only mislead a trace, never change what runs.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from deferred.core.jobs import Job

_UNSET: Any = object()
_modules: Any = _UNSET


def _otel() -> Any:
    """``(trace, propagate)`` from opentelemetry-api, or ``None`` when it is not installed."""
    global _modules
    if _modules is _UNSET:
        try:
            _modules = (
                importlib.import_module("opentelemetry.trace"),
                importlib.import_module("opentelemetry.propagate"),
            )
        except ImportError:
            _modules = None
    return _modules


def _tracer(trace: Any) -> Any:
    return trace.get_tracer("deferred")


def producer_headers(job: Job, wait_ms: int) -> dict[str, str]:
    """Start and end the ``defer TASK`` span; the headers that carry its context.

    Empty without opentelemetry-api, or when no propagator writes anything.
    """
    otel = _otel()
    if otel is None:
        return {}
    trace, propagate = otel
    attributes = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "publish",
        "messaging.destination.name": job.queue,
        "messaging.message.id": job.id,
        "deferred.task": job.task,
        "deferred.delay_ms": wait_ms,
    }
    with _tracer(trace).start_as_current_span(
        f"defer {job.task}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    return carrier


def carried(headers: Mapping[str, Any]) -> dict[str, str]:
    """The trace headers of a message, for the next message of the same job (a retry)."""
    otel = _otel()
    if otel is None:
        return {}
    fields = otel[1].get_global_textmap().fields
    return {k: v for k, v in headers.items() if k in fields and isinstance(v, str)}


@contextlib.contextmanager
def consumer_span(
    job: Job, headers: Mapping[str, Any], queue: str, lateness_ms: float
) -> Iterator[None]:
    """Run the block in a CONSUMER span named after the task, child of the producer's."""
    otel = _otel()
    if otel is None:
        yield
        return
    trace, propagate = otel
    parent = propagate.extract({k: v for k, v in headers.items() if isinstance(v, str)})
    attributes = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "process",
        "messaging.destination.name": queue,
        "messaging.message.id": job.id,
        "deferred.job.id": job.id,
        "deferred.job.attempt": job.attempt,
        "deferred.job.queue": queue,
        "deferred.job.lateness_ms": round(lateness_ms, 3),
    }
    with _tracer(trace).start_as_current_span(
        job.task,
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=True,
        set_status_on_exception=True,
    ):
        yield
