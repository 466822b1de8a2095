"""Reading the schedules' record from the broker while the leader holds it for its tick."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from io import StringIO

import pika
import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings

from deferred.conf import get_settings
from deferred.core import signing
from deferred.core.jobs import utcnow
from deferred.core.schedule import every
from deferred.records.schedules import Entry, Records, overview
from tests.conftest import total_waiting, wait_for


def _write_paused_record(channel, plan) -> None:
    """What a leader writes after applying ``pause tests.tick``."""
    now = utcnow()
    record = Records(
        seq=7,
        entries={"tests.tick": Entry(planned=now, key=every(seconds=1).key, paused=True)},
        leader="worker-a",
        written=now,
    )
    body = record.encode()
    channel.basic_publish(
        "",
        plan.schedules_queue.name,
        body,
        pika.BasicProperties(
            delivery_mode=2,
            content_type="application/json",
            headers=signing.sign(body, get_settings().signing_keys) or None,
        ),
    )


def _held_for(broker_url: str, queue: str, seconds: float) -> threading.Thread:
    """Take every message of ``queue`` unacked, as the leader's tick does, and hand
    them back ``seconds`` later; returns once they are taken."""
    taken = threading.Event()

    def hold() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(broker_url))
        try:
            channel = connection.channel()
            while channel.basic_get(queue)[0] is not None:
                pass
            taken.set()
            connection.sleep(seconds)
        finally:
            connection.close()  # unacked: back in the queue

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(10)
    return thread


@pytest.fixture
def paused_record(own_topology, raw_channel) -> Iterator[str]:
    """Settings scheduling ``tests.tick`` under ``own_topology``, whose record says
    "paused"; yields the record queue's name."""
    here = {**settings.DEFERRED, "PREFIX": own_topology.prefix}
    here["SCHEDULES"] = {"tests.tick": every(seconds=1)}
    with override_settings(DEFERRED=here):
        _write_paused_record(raw_channel, own_topology)
        yield own_topology.schedules_queue.name


def test_a_record_held_by_the_leaders_tick_is_read_once_it_is_back(paused_record, broker_url):
    # Given the record says "paused"
    queue = paused_record
    # When the leader holds it for a tick (100 ms) while the command reads it,
    holder = _held_for(broker_url, queue, 0.1)
    seen = overview(get_settings())
    holder.join()
    # and again while the status reads it,
    holder = _held_for(broker_url, queue, 0.1)
    out = StringIO()
    call_command("deferred_status", "--json", stdout=out)
    holder.join()
    status = json.loads(out.getvalue())["schedules"]
    # Then both show the record, not an empty queue's "never planned, not paused"
    (info,) = seen.schedules
    assert info.paused and seen.leader == "worker-a"
    (shown,) = status["schedules"]
    assert shown["paused"] and shown["leader"] == "worker-a"


def test_a_new_leader_whose_first_read_meets_a_reader_keeps_the_pause_and_plans_nothing(
    paused_record, own_topology, broker_url, raw_channel
):
    from deferred.records.schedules import read
    from deferred.worker.scheduler import Scheduler

    # Given the record says "paused" and a worker just took the lease
    queue = paused_record
    scheduler = Scheduler(get_settings(), "worker-b")
    scheduler.lease.connect()
    try:
        assert wait_for(lambda: scheduler.lease.poll(0.1), 10)
        # When its first tick comes while a reader holds the record (100 ms)
        holder = _held_for(broker_url, queue, 0.1)
        scheduler.tick()
        holder.join()
    finally:
        scheduler.lease.close()
    # Then it planned nothing, and its record still says "paused"
    assert total_waiting(raw_channel, own_topology) == 0
    bodies = []
    while (message := raw_channel.basic_get(queue, auto_ack=True))[0] is not None:
        bodies.append(message[2])
    records, _commands = read(bodies)
    assert records.entries["tests.tick"].paused
