"""What differs between RabbitMQ releases (3.10, 4.0, 4.3), against the broker the suite runs on.

CI runs the suite on each release; these tests hold on all of them, and
where the broker's behaviour differs by release, each asserts its own.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from typing import Any

import pika
import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from deferred import defer
from deferred.broker import admin_channel
from deferred.cluster.nodes import management_api
from deferred.conf import get_settings
from deferred.core.topology import NO_DELIVERY_LIMIT, Plan, plan_topology
from tests.conftest import rabbitmqctl, remove_topologies, wait_for
from tests.testapp.tasks import read_records, record, sleepy

HOST = "amqp://guest:guest@127.0.0.1:5672/"


@contextmanager
def quorum_topology(broker_url: str, name: str, **values: Any) -> Iterator[Plan]:
    """A quorum topology under a PREFIX of its own, in force (settings) in the
    block, then deleted (with any older version of it)."""
    prefix = f"{name}-{uuid.uuid4().hex[:6]}"
    values = {
        **settings.DEFERRED,
        "BROKER_URL": broker_url,
        "PREFIX": prefix,
        "MAX_DELAY": 60,
        "QUEUE_TYPE": "quorum",
        **values,
    }
    with override_settings(DEFERRED=values):
        call_command("declare_delay_topology", stdout=StringIO())
        plan = plan_topology(get_settings())
        try:
            yield plan
        finally:
            remove_topologies(broker_url, plan)


def broker_version(url: str) -> tuple[int, ...]:
    """The release of the broker at ``url``, from what it says when connecting."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        version = connection._impl.server_properties["version"]
    finally:
        connection.close()
    text = version.decode() if isinstance(version, bytes) else str(version)
    return tuple(int(part) for part in text.split("-")[0].split(".")[:3])


@pytest.fixture
def quorum_vhost(broker_url: str) -> Iterator[str]:
    """A fresh vhost whose default queue type is quorum, as some hosted brokers make them."""
    name = f"deferred-dqt-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", name, "--default-queue-type", "quorum")
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


def listed_queues(vhost: str, prefix: str) -> dict[str, dict]:
    """``{name: {"type": ..., "arguments": {...}}}`` of ``vhost``'s queues under ``prefix``."""
    out = rabbitmqctl(
        "list_queues", "-p", vhost, "name", "type", "arguments", "--formatter", "json", "-q"
    )
    rows = json.loads(out)
    return {
        row["name"]: {"type": row["type"], "arguments": dict(_arguments(row["arguments"]))}
        for row in rows
        if row["name"].startswith(prefix + ".")
    }


def _arguments(raw: object) -> Iterator[tuple[str, object]]:
    # rabbitmqctl's JSON gives arguments as a map on 4.x, as [name, type, value]
    # triples (or pairs) on 3.10.
    if isinstance(raw, dict):
        yield from raw.items()
        return
    for item in raw or []:
        yield str(item[0]), item[-1]


def test_a_vhost_whose_default_queue_type_is_quorum_keeps_a_classic_topology_classic(
    quorum_vhost,
):
    prefix = f"dqt-{uuid.uuid4().hex[:6]}"
    values = {"BROKER_URL": HOST + quorum_vhost, "PREFIX": prefix, "MAX_DELAY": 60}
    with override_settings(DEFERRED=values):
        call_command("declare_delay_topology", stdout=StringIO())
        plan = plan_topology(get_settings())
    queues = listed_queues(quorum_vhost, prefix)
    assert set(queues) == {q.name for q in plan.all_queues}
    types = {name: q["type"] for name, q in queues.items()}
    for stream in plan.streams:
        assert types.pop(stream.name) == "stream"
    assert set(types.values()) == {"classic"}, types
    assert all(
        q["arguments"].get("x-queue-type") == "classic"
        for q in queues.values()
        if q["type"] == "classic"
    )


def test_every_quorum_queue_declares_its_delivery_limit(broker_url):
    with quorum_topology(broker_url, "limits") as plan:
        queues = listed_queues("/", plan.prefix)
        limits = {
            name: q["arguments"].get("x-delivery-limit")
            for name, q in queues.items()
            if q["type"] == "quorum"
        }
        # The queues workers consume: the ready queues and the hold queues.
        ready = {q.name for q in (*plan.ready_queues.values(), *plan.hold_queues.values())}
        classic = {plan.up_queue.name} if plan.up_queue else set()
        assert (
            set(limits)
            == {q.name for q in plan.all_queues} - {q.name for q in plan.streams} - classic
        )
        assert {limits[name] for name in ready} == {get_settings().delivery_limit}
        assert {limits[name] for name in set(limits) - ready} == {NO_DELIVERY_LIMIT}


def test_a_failed_job_read_more_often_than_rabbitmq_4s_default_limit_is_kept(broker_url):
    # RabbitMQ 4 drops a quorum queue's message handed back 20 times unless
    # the queue sets its own limit; the failed list is read by taking its
    # messages and handing them back.
    with quorum_topology(broker_url, "kept") as plan:
        connection = pika.BlockingConnection(pika.URLParameters(broker_url))
        try:
            read_back_26_times(connection, plan.failed_queue.name)
        finally:
            connection.close()


def read_back_26_times(connection: pika.BlockingConnection, queue: str) -> None:
    """Publish one message to ``queue``, then take it and hand it back 26 times."""
    channel = connection.channel()
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"{}")

    def take() -> Any:
        # (a quorum queue takes a hand-back in asynchronously: wait for it)
        taken: list = []
        wait_for(lambda: taken.append(channel.basic_get(queue)[0]) or taken[-1], 5)
        return taken[-1]

    for read in range(26):
        method = take()
        assert method is not None, f"the failed entry was dropped after {read} reads"
        channel.basic_nack(method.delivery_tag, requeue=True)


def test_a_ready_queue_declared_without_the_limits_is_used_with_a_policy_hint(broker_url):
    # A quorum topology of an earlier release: its ready queue has no
    # consumer timeout; declaring with CONSUMER_TIMEOUT set keeps it and says
    # how to apply the setting.
    with quorum_topology(broker_url, "older") as plan:
        err = StringIO()
        timed = {**settings.DEFERRED, "CONSUMER_TIMEOUT": 3600}
        with override_settings(DEFERRED=timed):
            call_command("declare_delay_topology", stdout=StringIO(), stderr=err)
        ready = plan.ready_queues["default"].name
        version = broker_version(broker_url)
        if version < (3, 12) or version[:2] == (4, 0):
            # 3.10 does not know the argument, and 4.0.5 does not compare it: the
            # declare is accepted, the queue keeps its own arguments, nothing to
            # report (the versions page says to apply a policy there)
            assert "exists with other limits" not in err.getvalue(), err.getvalue()
            return
        assert f"queue {ready} exists with other limits (x-consumer-timeout=None)" in err.getvalue()
        assert '"consumer-timeout": 3600000' in err.getvalue()
        # One for each queue the workers consume (ready and hold queues); the delay
        # queues are not worth a warning each.
        consumed = len(plan.ready_queues) + len(plan.hold_queues)
        assert err.getvalue().count("exists with other limits") == consumed


def starts(records: str) -> int:
    return sum(1 for r in read_records(records) if r["event"] == "start")


@pytest.mark.slow
def test_consumer_timeout_takes_back_a_job_held_longer_and_the_worker_says_so(
    broker_url, run_worker, records, caplog
):
    # Given a quorum topology whose ready queue times out its consumers after 1 s
    supported = broker_version(broker_url) >= (3, 12)
    with quorum_topology(broker_url, "timeout", CONSUMER_TIMEOUT=1):
        run_worker()
        # When a job runs for longer than that (RabbitMQ checks about once
        # a second: 4 s leaves it room)
        started = time.time()
        with caplog.at_level(logging.WARNING, logger="deferred"):
            defer(sleepy, 0, records, "long", 4.0)
            assert wait_for(lambda: starts(records) >= 1, 30)
            if supported:
                # Then (3.12+: the queue's x-consumer-timeout) the broker took it
                # back, and the worker warned with the fix; the copy it was handed
                # again joined the run still under way, so the job ran once
                assert wait_for(lambda: "CONSUMER_TIMEOUT" in caplog.text, 15), caplog.text
                time.sleep(max(0.0, started + 9 - time.time()))
                assert starts(records) == 1, read_records(records)
            else:
                # (3.10 knows no per-queue timeout: the broker-wide 30 minutes
                # apply, and the job ran once)
                time.sleep(max(0.0, started + 9 - time.time()))
                assert starts(records) == 1, read_records(records)


def test_a_message_over_the_brokers_size_limit_is_a_clear_error_and_the_next_defer_works(
    broker_url, own_topology, records
):
    # RabbitMQ 4.x refuses messages over 16 MiB by default (3.x: 128 MiB) and
    # closes the channel; MAX_MESSAGE_BYTES may allow more than the broker does.
    limit = 16 * 1024 * 1024 if broker_version(broker_url) >= (4,) else None
    big = {
        **settings.DEFERRED,
        "PREFIX": own_topology.prefix,
        "MAX_MESSAGE_BYTES": 128 * 1024 * 1024,
    }
    with override_settings(DEFERRED=big):
        if limit is None:
            # 3.x takes it (its default limit is 128 MiB)
            assert defer(record, 60, records, "x" * (17 * 1024 * 1024))
        else:
            with pytest.raises(ValueError, match=r"max_message_size.*MAX_MESSAGE_BYTES"):
                defer(record, 60, records, "x" * (17 * 1024 * 1024))
        # The connection is still good for the next call
        assert defer(record, 60, records, "small")
    with admin_channel(broker_url) as admin:
        waiting = sum(admin.message_count(q.name) or 0 for q in own_topology.delay_queues)
    assert waiting == (1 if limit else 2)


def test_the_management_api_tells_when_it_keeps_no_message_counts(broker_url):
    # RabbitMQ 4.3 can deny management_metrics_collection: the API then lists
    # queues without counts, and stuck dead-letters cannot be judged.
    api = management_api(get_settings())
    if api.nodes() is None:
        # No management plugin here (the 3.10 job): unknown reads as "not disabled"
        assert api.counts_disabled() is False
        return
    denied = False
    if broker_version(broker_url) >= (3, 13):
        features = json.loads(rabbitmqctl("list_deprecated_features", "--formatter", "json", "-q"))
        denied = any(
            f["name"] == "management_metrics_collection" and f.get("state") == "denied"
            for f in features
        )
    assert api.counts_disabled() is denied
