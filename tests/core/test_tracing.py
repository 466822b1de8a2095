"""OpenTelemetry: one trace from defer() to the worker, through retries, with the
SDK's in-memory exporter; and nothing at all without opentelemetry-api."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from deferred import adefer, defer
from deferred.conf import get_settings
from deferred.records.failures import list_failed
from tests.conftest import run_python, wait_for
from tests.testapp.tasks import explode_async, read_records, record

pytestmark = pytest.mark.django_db(transaction=True)

_exporter = InMemorySpanExporter()
_installed: list[bool] = []


@pytest.fixture
def spans():
    """The SDK with an in-memory exporter, installed once: the global provider and its
    processors stay for the whole process (OpenTelemetry allows setting it once)."""
    if not _installed:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, TracerProvider):
            provider = TracerProvider()
            trace.set_tracer_provider(provider)
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        _installed.append(True)
    _exporter.clear()
    yield _exporter
    _exporter.clear()


def named(exporter, name):
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_one_trace_goes_from_the_request_through_defer_to_the_worker(
    own_topology, records, run_worker, spans
):
    # A topology of its own: the spans are counted by task, and a job an earlier test
    # left in the session's topology (published again by its keeper) would add one.
    run_worker()
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("request") as request:
        job_id = defer(record, 0.05, records, "traced")
    assert wait_for(lambda: read_records(records), 10)
    task = "tests.testapp.tasks.record"
    assert wait_for(lambda: named(spans, task), 5)
    (producer,) = named(spans, f"defer {task}")
    (consumer,) = named(spans, task)
    trace_id = request.get_span_context().trace_id
    assert producer.context.trace_id == consumer.context.trace_id == trace_id
    assert producer.kind == SpanKind.PRODUCER
    assert producer.parent.span_id == request.get_span_context().span_id
    assert consumer.kind == SpanKind.CONSUMER
    assert consumer.parent.span_id == producer.context.span_id  # child of the defer span
    attributes = consumer.attributes
    assert attributes["deferred.job.id"] == job_id
    assert attributes["deferred.job.attempt"] == 1
    assert attributes["deferred.job.queue"] == "default"
    assert attributes["deferred.job.lateness_ms"] >= 0
    assert producer.attributes["messaging.message.id"] == job_id


def test_retries_stay_in_the_trace_and_errors_are_recorded(
    own_topology, records, run_worker, spans
):
    run_worker()

    async def main():
        with trace.get_tracer("tests").start_as_current_span("async request"):
            return await adefer(explode_async, 0, records, "traced boom")

    job_id = asyncio.run(main())
    assert wait_for(lambda: list_failed(get_settings()), 15)
    assert wait_for(lambda: len(named(spans, "tests.explode_async")) == 2, 5)
    (producer,) = named(spans, "defer tests.explode_async")
    attempts = sorted(
        named(spans, "tests.explode_async"), key=lambda s: s.attributes["deferred.job.attempt"]
    )
    assert [s.attributes["deferred.job.attempt"] for s in attempts] == [1, 2]
    for span in attempts:
        assert span.attributes["deferred.job.id"] == job_id
        assert span.context.trace_id == producer.context.trace_id
        assert span.parent.span_id == producer.context.span_id
        assert span.status.status_code == StatusCode.ERROR
        assert any(event.name == "exception" for event in span.events)


def test_without_opentelemetry_nothing_is_imported_and_defer_works(clean, records):
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if opentelemetry-api were not installed
import django
django.setup()
from deferred import defer
from deferred.core import tracing
from deferred.core.jobs import Job, new_job_id, utcnow
from tests.testapp.tasks import record
job = Job(id=new_job_id(), task="t", args=(), kwargs={}, due=utcnow(), queue="default")
assert tracing.producer_headers(job, 0) == {}
assert tracing.carried({"traceparent": "00-x"}) == {}
with tracing.consumer_span(job, {}, "default", 0.0):
    pass
defer(record, 0, sys.argv[1], "no otel")
loaded = [m for m in sys.modules if m.startswith("opentelemetry.")]
assert not loaded, loaded
print("ok")
"""
    assert run_python(script, records).strip() == "ok"
