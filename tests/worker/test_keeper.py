"""The ledger and the keeper against the real broker: every job recorded, jobs a
restart dropped published again and run once, jobs it did not drop run once too.

A broker restart loses a job only at an unlucky instant, so the tests make the
loss happen: they purge the delay queues (every job waiting there is gone, as
if dropped between two queues) and then restart the broker with rabbitmqctl.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest

from deferred import defer
from deferred.broker import admin_channel
from deferred.conf import get_settings
from deferred.core import signing
from deferred.records.pending import find
from deferred.worker.keeper import Keeper, entry_of
from tests.conftest import rabbitmqctl, wait_for
from tests.testapp.tasks import read_records, record

pytestmark = pytest.mark.usefixtures("clean")


def ledger_entries(plan) -> list:
    """Every job record in the ledger, read to its end (a marker written first)."""
    keeper = Keeper(get_settings())
    keeper.link.connect()
    try:
        entries, _ = keeper.read(token=f"test-{time.monotonic_ns()}")
    finally:
        keeper.link.close()
    return entries


def purge_delays(plan) -> None:
    with admin_channel(get_settings().broker_urls) as admin:
        for queue in plan.delay_queues:
            admin.channel.queue_purge(queue.name)


def ran(records: str) -> Counter:
    return Counter(r["label"] for r in read_records(records))


def test_every_job_that_enters_a_delay_queue_is_in_the_ledger_as_it_was_published(clean, records):
    ids = [defer(record, 60 + i, records, f"j{i}") for i in range(3)]
    soon = defer(record, 0, records, "now")
    entries = {e.job_id: e for e in ledger_entries(clean)}
    for job_id in ids:
        assert job_id in entries
    # Due at once: in the ledger too (deferred.records.pending reads it while it waits for a
    # worker), but it makes no hop: the keeper skips it, nothing about it is repaired.
    assert soon not in entries
    assert find(get_settings(), soon).job is not None
    entry = entries[ids[1]]
    assert entry.exchange == clean.ingest_exchange
    assert entry.routing_key == clean.routing_key(61_000, "default")
    assert entry.queue == "default"
    assert abs(entry.due_ms - (entry.written_ms + 61_000)) < 50
    # What a copy is published with: the signature, not the stream's own headers.
    assert "x-stream-offset" not in entry.headers
    assert signing.HEADER in entry.headers


def test_markers_and_records_that_are_not_jobs_are_not_entries():
    assert entry_of(0, b"", {"x-deferred-alive": 1}) is None
    assert entry_of(0, b"not json", {"x-routing-key": "1.default", "x-exchange": "x"}) is None


def test_a_repair_publishes_again_the_jobs_lost_in_its_window_and_each_runs_once(
    own_topology, records, run_worker, caplog
):
    caplog.set_level(logging.INFO)
    run_worker(concurrency=4)
    before = time.time() * 1000
    lost = [defer(record, 1.5 + i * 0.1, records, f"lost{i}") for i in range(5)]
    purge_delays(own_topology)  # gone, as if dropped between two delay queues
    kept = [defer(record, 2.0 + i * 0.1, records, f"kept{i}") for i in range(5)]
    later = defer(record, 3600, records, "later")
    keeper = Keeper(get_settings())
    keeper.check_after_ms = 3_000
    keeper.link.connect()
    try:
        repair = keeper.begin_repair(int(before), int(time.time() * 1000 + 5_000))
        # Every job with a hop in the window is looked at: the lost and the kept ones,
        # not the one due in an hour (its only hop is an hour away).
        assert sorted(e.job_id for e in repair.near) == sorted(lost + kept)
        assert repair.published == 0
        while time.time() * 1000 < repair.check_at_ms:
            time.sleep(0.1)
        copies = keeper.finish_repair(repair)
    finally:
        keeper.link.close()
    # The kept ones ran from their own messages: only the lost ones are published again.
    assert copies == 5
    labels = [f"lost{i}" for i in range(5)] + [f"kept{i}" for i in range(5)]
    assert wait_for(lambda: set(ran(records)) == set(labels), 20), ran(records)
    time.sleep(3)  # a copy waits two seconds before it looks its job up
    assert ran(records) == Counter(dict.fromkeys(labels, 1))
    assert later


def test_a_job_due_later_is_published_again_at_once_and_runs_once(
    own_topology, records, run_worker, monkeypatch
):
    import deferred.worker.keeper

    monkeypatch.setattr(deferred.worker.keeper, "NEAR_MS", 0)
    run_worker(concurrency=4)
    before = time.time() * 1000
    lost = defer(record, 2, records, "lost")
    purge_delays(own_topology)
    kept = defer(record, 2.5, records, "kept")
    keeper = Keeper(get_settings())
    keeper.link.connect()
    try:
        repair = keeper.begin_repair(int(before), int(time.time() * 1000 + 5_000))
    finally:
        keeper.link.close()
    assert repair.published == 2 and not repair.near
    # Both copies travel the delay line again; the kept job's copy finds it started.
    assert wait_for(lambda: set(ran(records)) == {"lost", "kept"}, 20), ran(records)
    time.sleep(4)
    assert ran(records) == Counter(lost=1, kept=1)
    assert lost and kept


@pytest.mark.alone
def test_a_broker_restart_is_repaired_by_the_keeper(own_topology, records, run_worker):
    worker = run_worker(concurrency=4)
    assert wait_for(lambda: worker.keeper is not None and worker.keeper.leading.is_set(), 20)
    labels = [f"r{i}" for i in range(20)]
    for i, label in enumerate(labels):
        defer(record, 4 + i * 0.05, records, label)
    far = defer(record, 3600, records, "far")
    purge_delays(own_topology)  # the jobs were in the delay queues as the broker stopped
    # A repair when it started (of an earlier restart, or of the ledger's start on a
    # fresh topology) ends first: its end must not read as this restart's.
    assert wait_for(lambda: not worker.keeper._repairs, 30)
    worker.keeper.repaired.clear()
    rabbitmqctl("stop_app")
    try:
        time.sleep(1)
    finally:
        rabbitmqctl("start_app")
    assert worker.keeper is not None
    assert wait_for(worker.keeper.repaired.is_set, 60), "no repair after the restart"
    assert worker.keeper.last_repair >= len(labels)
    assert wait_for(lambda: set(ran(records)) >= set(labels), 60), ran(records)
    time.sleep(3)
    assert ran(records) == Counter(dict.fromkeys(labels, 1))
    assert far


def test_the_checks_wait_while_a_ready_queue_holds_a_backlog(clean, records):
    from deferred.worker.keeper import BACKLOG_LIMIT, Repair

    keeper = Keeper(get_settings())
    keeper.link.connect()
    try:
        now = int(time.time() * 1000)
        keeper._repairs = [Repair(now - 60_000, now, [], now)]
        for i in range(BACKLOG_LIMIT + 1):
            defer(record, 0, records, f"waiting{i}")  # no worker: they wait in the queue
        assert not keeper._may_check()
        keeper._next_backlog_look = 0.0
        with admin_channel(get_settings().broker_urls) as admin:
            admin.channel.queue_purge(clean.ready_queues["default"].name)
        assert keeper._may_check()
        # Looked at once a second, not every turn.
        assert not keeper._may_check()
    finally:
        keeper.link.close()
