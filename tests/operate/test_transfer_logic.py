"""The pure parts of ``deferred_transfer``: keys, routing, the staging plan, the order of
the queues, which cancels are worth copying, progress, and the command's arguments."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta

import pytest

from deferred.core.jobs import Job, new_job_id
from deferred.core.topology import build_plan
from deferred.management.commands.deferred_transfer import _amqp_url, _batch
from deferred.operate.transfer_plan import (
    FAILED,
    FAILED_ROUTE,
    JOB,
    Progress,
    carried,
    flow_order,
    in_force,
    route,
    source_queues,
    staging_plan,
    transfer_key,
)
from deferred.records import cancels

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def plan(**changes):
    values = {
        "prefix": "app",
        "radix": 16,
        "resolution_ms": 1,
        "max_delay_ms": 30 * 24 * 3600 * 1000,
        "queue_type": "classic",
        "queues": ["default", "mail"],
        **changes,
    }
    return build_plan(**values)


def body(due: datetime, queue: str = "default") -> bytes:
    return Job(new_job_id(due), "app.tasks.send", (1,), {}, due, queue, created=NOW).encode()


def test_a_key_names_one_message_of_one_kind() -> None:
    job = body(NOW)
    assert transfer_key(JOB, job) == transfer_key(JOB, bytes(job))
    assert transfer_key(JOB, job) != transfer_key(FAILED, job)
    assert transfer_key(JOB, job) != transfer_key(JOB, body(NOW + timedelta(seconds=1)))
    assert len(transfer_key(JOB, job)) == 32


def test_a_moved_message_keeps_its_headers_but_those_its_old_broker_wrote() -> None:
    headers = {
        "x-deferred-signature": "hmac-sha256:abc",
        "traceparent": "00-1-2-01",
        "x-death": [{"reason": "expired"}],
        "x-first-death-queue": "q",
        "x-last-death-reason": "expired",
        "x-delivery-count": 3,
        "x-stream-offset": 7,
    }
    assert carried(headers) == {
        "x-deferred-signature": "hmac-sha256:abc",
        "traceparent": "00-1-2-01",
    }


def test_a_job_waits_what_is_left_of_its_delay_rounded_up() -> None:
    p = plan(resolution_ms=10)
    due = NOW + timedelta(seconds=5, microseconds=1)
    assert route(JOB, body(due), None, "", p, NOW) == p.routing_key(5010, "default")
    # A job due already goes straight to its ready queue.
    assert route(JOB, body(NOW - timedelta(hours=1)), None, "", p, NOW) == p.routing_key(
        0, "default"
    )


def test_a_job_due_beyond_the_maximum_waits_the_maximum_and_then_again() -> None:
    p = plan(max_delay_ms=60_000)
    far = NOW + timedelta(days=2)
    assert route(JOB, body(far), None, "", p, NOW) == p.routing_key(60_000, "default")


def test_a_job_for_a_queue_these_settings_lack_goes_to_the_failed_queue() -> None:
    assert route(JOB, body(NOW, queue="gone"), None, "", plan(), NOW) == FAILED_ROUTE


def test_a_body_that_is_not_a_job_waits_for_the_time_its_id_carries_in_its_queue() -> None:
    p = plan()
    due = NOW + timedelta(seconds=30)
    key = p.routing_key(1234, "mail")
    assert route(JOB, b"not json", new_job_id(due), key, p, NOW) == p.routing_key(30_000, "mail")
    assert route(JOB, b"{}", "not-an-id", key, p, NOW) == p.routing_key(0, "mail")
    assert route(JOB, b"{}", None, p.routing_key(0, "gone"), p, NOW) == FAILED_ROUTE


def test_a_failed_entry_goes_to_the_failed_queue_whatever_it_holds() -> None:
    assert route(FAILED, body(NOW + timedelta(days=1)), None, "", plan(), NOW) == FAILED_ROUTE


def test_the_staging_queue_dead_letters_into_its_own_exchange() -> None:
    p = plan()
    staging = staging_plan(p)
    assert staging.queue.name == "app.transfer" == staging.exchange
    assert staging.queue.arguments == {
        "x-queue-type": "classic",
        "x-dead-letter-exchange": "app.transfer.out",
    }
    routes = {b.destination: b.routing_key for b in staging.bindings}
    assert routes == {p.ingest_exchange: ".".join(["*"] * (p.levels + 1)), "app.failed": "failed"}
    assert all(b.source == "app.transfer.out" for b in staging.bindings)
    assert all(b.destination_type == "exchange" for b in staging.bindings)
    # Every job's key has one word per level and one for the queue: it matches.
    assert len(p.routing_key(123_456, "mail").split(".")) == p.levels + 1


def test_a_quorum_staging_queue_dead_letters_with_confirms_and_no_delivery_limit() -> None:
    arguments = staging_plan(plan(queue_type="quorum")).queue.arguments
    assert arguments["x-queue-type"] == "quorum"
    assert arguments["x-dead-letter-strategy"] == "at-least-once"
    assert arguments["x-overflow"] == "reject-publish"
    assert arguments["x-delivery-limit"] >= 1_000_000


def test_queues_are_drained_soonest_due_first_old_topologies_included() -> None:
    current = plan()
    old = plan(radix=2, resolution_ms=1000, max_delay_ms=3_600_000)
    record = json.loads(old.record())
    order = source_queues(current, [record])
    names = [q.name for q in order]
    # Due now, then due within the hold window (each with the queues of the other
    # PRIORITIES setting, which older topologies may still fill), then the delay
    # queues by TTL.
    assert names[:8] == [
        "app.ready.default",
        "app.ready.mail",
        "app.ready.p9.default",
        "app.ready.p9.mail",
        "app.hold.default",
        "app.hold.mail",
        "app.hold.p9.default",
        "app.hold.p9.mail",
    ]
    assert all(q.ready for q in order[:8]) and not any(q.ready for q in order[8:])
    assert names[-1] == "app.failed" and order[-1].kind == FAILED
    delay = {q.name: q.ttl_ms for q in (*current.delay_queues, *old.delay_queues)}
    assert set(names[8:-1]) == set(delay)
    assert [delay[n] for n in names[8:-1]] == sorted(delay.values())


def test_a_sweep_counts_the_queues_in_the_order_messages_flow_through_them() -> None:
    # A message only moves to a lower level, then to its ready queue: counted
    # upstream first, one that moves during the sweep is counted, never missed.
    p = plan()
    swept = flow_order(source_queues(p, []))
    ttls = [q.ttl_ms for q in p.delay_queues]
    delay = {q.name: q.ttl_ms for q in p.delay_queues}
    assert [delay[q.name] for q in swept[: len(ttls)]] == sorted(ttls, reverse=True)
    assert [q.name for q in swept[len(ttls) :]] == [
        "app.hold.default",
        "app.hold.mail",
        "app.hold.p9.default",
        "app.hold.p9.mail",
        "app.ready.default",
        "app.ready.mail",
        "app.ready.p9.default",
        "app.ready.p9.mail",
        "app.failed",
    ]
    levels = [q.level for q in p.delay_queues]
    by_name = {q.name: q.level for q in p.delay_queues}
    assert [by_name[q.name] for q in swept[: len(levels)]] == sorted(levels, reverse=True)


def test_a_cancel_record_is_worth_copying_while_one_of_its_cancels_is_in_force() -> None:
    margin_s = 3600.0
    now = NOW.timestamp()
    soon = new_job_id(NOW + timedelta(minutes=5))
    long_ago = new_job_id(NOW - timedelta(days=2))
    assert in_force(cancels.encode([long_ago, soon], NOW), margin_s, now)
    assert not in_force(cancels.encode([long_ago], NOW - timedelta(days=1)), margin_s, now)
    assert not in_force(b"not a record", margin_s, now)
    assert not in_force(cancels.encode_marker("token"), margin_s, now)


def test_progress_says_what_moved_how_fast_and_what_is_left() -> None:
    progress = Progress(jobs=4000, failed=10, unroutable=2, remaining=6000, moving_s=2.0)
    assert progress.moved == 4012
    assert progress.rate == 2006
    assert progress.line() == (
        "moved 4,000 job(s), 12 to the failed queue (2,006/s); "
        "about 6,000 left on the old broker (~3 s)"
    )
    assert Progress().rate == 0


@pytest.mark.parametrize(
    "value", ["http://127.0.0.1:5672/", "127.0.0.1:5672", "amqp://h:notaport/"]
)
def test_the_command_takes_only_broker_urls(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _amqp_url(value)
    assert _amqp_url("amqps://u:p@rabbit.example:5671/%2F") == "amqps://u:p@rabbit.example:5671/%2F"


@pytest.mark.parametrize("value", ["0", "10001", "ten"])
def test_a_batch_is_a_sensible_number(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _batch(value)
    assert _batch("200") == 200


def test_a_bare_failed_job_moved_keeps_its_reason_in_our_header():
    # On the new broker its x-death says it was dead-lettered by the move
    # (RabbitMQ 4.3 also drops the client's copy): the reason travels in
    # x-deferred-reason.
    from deferred.records import failures

    message = body(NOW - timedelta(seconds=5))
    moved = {"x-death": [{"reason": "rejected", "queue": "p.transfer", "count": 1}]}
    carried = {**moved, failures.REASON_HEADER: failures.DELIVERY_LIMIT}
    assert failures.parse_failed(message, carried, None).reason == failures.DELIVERY_LIMIT
    assert failures.parse_failed(message, moved, None).reason == failures.UNROUTABLE
