"""Signed jobs against the real broker: forged, altered and oversized messages never run."""

from __future__ import annotations

import json
import random
from io import StringIO

import pika
import pytest
from django.conf import settings as django_settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from deferred import cancel, defer
from deferred.conf import get_settings
from deferred.core import signing
from deferred.core.jobs import utcnow
from deferred.records import failures
from tests.conftest import depth, record_job, signed, wait_for
from tests.testapp.tasks import read_records, record

pytestmark = pytest.mark.usefixtures("clean")


@pytest.fixture
def clean(own_topology):
    """Here, a topology of the test's own (a spare costs 0.5 s): these tests count a
    worker's outcomes and the failed queue, and a job an earlier test deferred into
    the session's topology may come due meanwhile."""
    return own_topology


SECRET_ARG = "arg-that-must-not-be-logged-7f3a"


a_job = record_job


def publish(channel, queue: str, body: bytes, headers: dict | None, message_id: str | None = None):
    channel.basic_publish(
        "",
        queue,
        body,
        pika.BasicProperties(delivery_mode=2, headers=headers, message_id=message_id),
    )


def failed(settings=None) -> list[failures.FailedJob]:
    return failures.list_failed(settings or get_settings())


def labels(path: str) -> list[str]:
    return [r["label"] for r in read_records(path)]


def test_unsigned_forged_and_altered_jobs_never_run(
    clean, raw_channel, run_worker, records, caplog
):
    ready = clean.ready_queues["default"].name
    unsigned = a_job(records, SECRET_ARG)
    forged = a_job(records, SECRET_ARG)
    altered = a_job(records, "harmless")
    altered_body = altered.encode().replace(b"harmless", SECRET_ARG.encode())
    # Given three jobs published straight into the ready queue by someone with
    # the vhost's rights: one unsigned, one signed with another key, one altered,
    publish(raw_channel, ready, unsigned.encode(), None, unsigned.id)
    forged_body = forged.encode()
    publish(raw_channel, ready, forged_body, signing.sign(forged_body, ("a guess",)), forged.id)
    publish(raw_channel, ready, altered_body, signed(altered.encode()), altered.id)
    # and one real job,
    defer(record, 0, records, "real")
    run_worker()
    # none of the three runs: each is in the failed queue as bad_signature,
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 3, 10)
    assert wait_for(lambda: labels(records) == ["real"], 5)
    entries = {e.id: e for e in failed()}
    assert set(entries) == {unsigned.id, forged.id, altered.id}
    assert {e.reason for e in entries.values()} == {"bad_signature"}
    assert entries[unsigned.id].task is None and entries[unsigned.id].job is None
    assert "not signed" in entries[unsigned.id].error
    assert "does not match" in entries[forged.id].error
    # logged at ERROR with its id, never its arguments.
    errors = [r for r in caplog.records if "bad_signature" in r.getMessage()]
    assert {r.levelname for r in errors} == {"ERROR"}
    assert all(any(i in r.getMessage() for i in entries) for r in errors)
    assert not any(SECRET_ARG in r.getMessage() for r in caplog.records)
    assert labels(records) == ["real"]


def test_a_bad_signature_is_retried_only_with_resign(clean, raw_channel, run_worker, records):
    job = a_job(records, "resigned")
    publish(raw_channel, clean.ready_queues["default"].name, job.encode(), None, job.id)
    worker = run_worker()
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 10)
    # `retry` refuses it,
    err = StringIO()
    call_command("deferred_failed", "retry", job.id, stdout=StringIO(), stderr=err)
    assert "--resign" in err.getvalue() and "not signed with a key" in err.getvalue()
    assert [e.id for e in failed()] == [job.id]
    # as does `retry --all`;
    err = StringIO()
    call_command("deferred_failed", "retry", "--all", stdout=StringIO(), stderr=err)
    assert "--resign" in err.getvalue()
    # `list --json` shows what it holds, to read before vouching for it;
    out = StringIO()
    call_command("deferred_failed", "list", "--json", stdout=out)
    (shown,) = json.loads(out.getvalue())
    assert shown["reason"] == "bad_signature" and '"resigned"' in shown["raw_body"]
    # with --resign it is signed anew and runs.
    out = StringIO()
    call_command("deferred_failed", "retry", job.id, "--resign", stdout=out)
    assert "1 job re-queued" in out.getvalue()
    assert wait_for(lambda: labels(records) == ["resigned"], 10)
    # (the outcome is counted once the task has returned: a moment after its record)
    assert wait_for(lambda: worker.outcomes["succeeded"] == 1, 5), worker.outcomes


def test_a_forged_failed_record_is_not_redriven_without_resign(clean, raw_channel, records):
    # A record written into the failed queue by hand, holding a job to run:
    job = a_job(records, "smuggled")
    record_body = json.dumps(
        failures.failure_record(reason="task_error", job=job, body=job.encode())
    ).encode()
    publish(raw_channel, clean.failed_queue.name, record_body, None, job.id)
    err = StringIO()
    call_command("deferred_failed", "retry", "--all", stdout=StringIO(), stderr=err)
    assert "--resign" in err.getvalue()
    assert depth(raw_channel, clean.failed_queue.name) == 1
    assert depth(raw_channel, clean.ready_queues["default"].name) == 0


def test_a_key_rotation_drains_the_jobs_signed_with_the_old_key(run_worker, records):
    with override_settings(SECRET_KEY="old-secret"):
        defer(record, 0.5, records, "old key")
    with override_settings(SECRET_KEY="new-secret", SECRET_KEY_FALLBACKS=["old-secret"]):
        defer(record, 0.5, records, "new key")
        run_worker()
        assert wait_for(lambda: sorted(labels(records)) == ["new key", "old key"], 10)


def test_a_worker_with_its_own_signing_key_refuses_jobs_signed_with_secret_key(
    clean, raw_channel, run_worker, records
):
    defer(record, 0.3, records, "secret key")
    keyed = {**django_settings.DEFERRED, "SIGNING_KEY": "fleet-key"}
    with override_settings(DEFERRED=keyed):
        defer(record, 0.3, records, "fleet key")
        run_worker()
        assert wait_for(lambda: labels(records) == ["fleet key"], 10)
        assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 10)


def test_with_signing_off_an_unsigned_job_runs(clean, raw_channel, run_worker, records):
    job = a_job(records, "unsigned")
    with override_settings(DEFERRED={**django_settings.DEFERRED, "SIGNING": False}):
        run_worker()
        publish(raw_channel, clean.ready_queues["default"].name, job.encode(), None, job.id)
        assert wait_for(lambda: labels(records) == ["unsigned"], 10)


def test_a_message_over_the_limit_goes_to_failed_unread(
    clean, raw_channel, run_worker, records, caplog
):
    limited = {**django_settings.DEFERRED, "MAX_MESSAGE_BYTES": 4096}
    with override_settings(DEFERRED=limited):
        big = a_job(records, SECRET_ARG + "x" * 10_000)
        body = big.encode()
        publish(raw_channel, clean.ready_queues["default"].name, body, signed(body), big.id)
        with pytest.raises(ValueError, match="MAX_MESSAGE_BYTES"):
            defer(record, 0, records, "y" * 5000)
        run_worker()
        assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 10)
        (entry,) = failed()
    assert entry.reason == "too_large" and entry.id == big.id
    assert "not read" in entry.error and f"{len(body):,} bytes" in entry.error
    # The record keeps the size and the first bytes, not the whole body.
    _method, _props, raw = raw_channel.basic_get(clean.failed_queue.name, auto_ack=True)
    stored = json.loads(raw)
    assert stored["raw_body_bytes"] == len(body) and len(raw) < 2048
    assert not any(SECRET_ARG in r.getMessage() for r in caplog.records)
    assert labels(records) == []


def test_an_unsigned_cancel_is_ignored(clean, raw_channel, run_worker, records, caplog):
    from deferred.records.cancels import encode

    job_id = defer(record, 1.0, records, "kept")
    body = encode([job_id], utcnow())
    publish(raw_channel, clean.cancels_queue.name, body, None)
    signed_off = defer(record, 1.0, records, "cancelled")
    cancel(signed_off)
    worker = run_worker()
    assert wait_for(lambda: labels(records) == ["kept"], 10)
    assert wait_for(lambda: worker.outcomes["cancelled"] == 1, 5)
    assert any("Ignoring 1 cancel " in m for m in caplog.messages)


def random_body(rng: random.Random) -> bytes:
    """Something a broken or hostile publisher could send."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 300))
    if kind == 1:
        return json.dumps(rng.choice([None, 1, "x", [1, 2], {"version": 1}])).encode()
    if kind == 2:
        # A job with one field of the wrong type (never a job that could run).
        job = a_job("/nonexistent/dir/file", "fuzz").to_dict()
        field = rng.choice(list(job))
        job[field] = rng.choice([[], "x"]) if field == "kwargs" else {"wrong": field}
        return json.dumps(job).encode()
    if kind == 3:
        return a_job("/nonexistent/dir/file", "fuzz").encode()[: rng.randrange(1, 100)]
    if kind == 4:
        depth_ = rng.randrange(500, 3000)
        return b"[" * depth_ + b"]" * depth_
    return b"{" + rng.randbytes(50) + b"}"


def test_five_thousand_random_bodies_among_five_hundred_jobs(
    own_topology, raw_channel, run_worker, records
):
    rng = random.Random(12)
    ready = own_topology.ready_queues["default"].name
    jobs = [a_job(records, f"job-{n}") for n in range(500)]
    bodies = [random_body(rng) for _ in range(5000)]
    mixed = [(j.encode(), True) for j in jobs] + [(b, rng.random() < 0.5) for b in bodies]
    rng.shuffle(mixed)
    for body, sign in mixed:
        # Half the random bodies are even signed: they must fail on their format.
        publish(raw_channel, ready, body, signed(body) if sign else None)
    worker = run_worker(concurrency=4)
    assert wait_for(lambda: len(read_records(records)) == 500, 120), len(read_records(records))
    assert wait_for(lambda: depth(raw_channel, own_topology.failed_queue.name) == 5000, 120)
    assert sorted(labels(records)) == sorted(f"job-{n}" for n in range(500))
    reasons = {e.reason for e in failed()}
    assert reasons == {"bad_signature", "undecodable", "invalid"}
    assert wait_for(lambda: worker.outcomes["failed"] == 5000, 10), worker.outcomes["failed"]
    assert worker.consuming.is_set()


def test_a_redelivered_job_with_a_bad_count_header_still_runs_once(
    own_topology, raw_channel, run_worker, records, broker_url
):
    # The deliveries count is a header anyone may set: a value that is no count
    # must not make the worker hand the job back for ever. (A topology of its own:
    # the worker's outcomes count every job, and one an earlier test deferred into the
    # session's topology may come due meanwhile.)
    job = a_job(records, "counted")
    body = job.encode()
    ready = own_topology.ready_queues["default"].name
    publish(raw_channel, ready, body, {**signed(body), "x-deferred-deliveries": "many"}, job.id)
    # Taken and dropped without an ack: RabbitMQ redelivers it, flagged.
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    method, _props, _body = connection.channel().basic_get(ready)
    assert method is not None
    connection.close()
    worker = run_worker()
    assert wait_for(lambda: labels(records) == ["counted"], 10)
    counted = {"requeued": 1, "succeeded": 1}
    assert wait_for(lambda: {k: worker.outcomes[k] for k in counted} == counted, 5), worker.outcomes


def test_an_older_topology_without_the_cancel_binding_is_named_and_jobs_still_run(
    own_topology, raw_channel, run_worker, records, caplog
):
    from deferred.broker import TopologyNotDeclared

    # Given a topology declared before cancels went through the ingest exchange,
    raw_channel.queue_unbind(
        own_topology.cancels_queue.name, own_topology.ingest_exchange, "cancel"
    )
    off = {**django_settings.DEFERRED, "PREFIX": own_topology.prefix, "DECLARE": False}
    with override_settings(DEFERRED=off):
        # the check names the missing binding,
        with pytest.raises(CommandError, match="routing key 'cancel'"):
            call_command("declare_delay_topology", "--check", stdout=StringIO())
        # cancel() raises rather than lose the cancel,
        job_id = defer(record, 0.3, records, "runs")
        with pytest.raises(TopologyNotDeclared):
            cancel(job_id)
        # and a worker says so, and runs jobs all the same.
        run_worker()
        assert wait_for(lambda: labels(records) == ["runs"], 10)
        assert any("lacks the binding" in m for m in caplog.messages)
    # Declaring again adds the binding.
    call_command("declare_delay_topology", stdout=StringIO())
    cancel(job_id)
