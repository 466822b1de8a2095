"""Copies of a job that ran are not run again: lost acks, second publishes, paused workers.

Against the real broker: connections are closed with rabbitmqctl, a worker
process is paused with SIGSTOP, and copies are published by hand as the
library would send them.
"""

from __future__ import annotations

import logging
import signal
import time
from datetime import UTC, datetime

import pika
import pytest

from deferred import defer
from deferred.broker import COPY_HEADER, admin_channel
from deferred.conf import get_settings
from deferred.producer.publishing import encode
from deferred.worker.copies import DELIVERIES_HEADER
from tests.conftest import rabbitmqctl, record_job, signed, wait_for
from tests.testapp.tasks import cut_off, read_records, sleepy, timed

pytestmark = pytest.mark.usefixtures("clean")


def publish_copy(channel, queue: str, job, **headers) -> None:
    """Publish ``job`` straight into ``queue``, signed, with ``headers``, as the library
    sends a copy."""
    body = encode(job, get_settings())
    channel.basic_publish(
        "",
        queue,
        body,
        pika.BasicProperties(
            delivery_mode=2, message_id=job.id, headers={**signed(body), **headers}
        ),
    )


def duplicates(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "outcome=duplicate" in r.getMessage()]


@pytest.mark.alone
def test_a_job_running_when_its_connection_drops_runs_once(own_topology, run_worker, records):
    # A topology of its own: after a test that restarted the broker, the keeper of
    # the session's topology publishes copies of its jobs again, and one held at the
    # stop would be handed back into the queue this test finds empty at the end.
    worker = run_worker(concurrency=2)
    generation = worker.consumer.generation
    defer(sleepy, 0, records, "long", 2.0)
    assert wait_for(lambda: read_records(records), 10)
    rabbitmqctl("close_all_connections", "test: a running job's delivery goes back")
    assert wait_for(
        lambda: worker.consumer.generation > generation and worker.consuming.is_set(), 30
    )
    # RabbitMQ redelivers it to this worker while it still runs. The copy waits for
    # the run's record (copies.REDELIVERED_WAIT_S from its delivery, which comes as
    # late as the worker reconnects), then joins the run if it still runs, or finds
    # that it ran here (a duplicate): either way acked, not run.
    assert wait_for(lambda: any(r["event"] == "end" for r in read_records(records)), 10)
    time.sleep(0.5)  # reconnected: the copy is on its way, if not here already
    assert wait_for(lambda: worker.holder.count() == 0, 15), worker.outcomes
    assert [r["event"] for r in read_records(records)] == ["start", "end"]
    assert worker.outcomes["succeeded"] == 1
    # The copy was acked: once the worker stopped, nothing went back to the
    # queue (the test's own connection was closed too: a new one looks).
    worker.stop()
    assert wait_for(lambda: not worker.consuming.is_set(), 10)
    # The count may lag the queue by a moment (RabbitMQ 4.3 counted the copy for up to
    # a few seconds after it was acked, when a basic.get already found the queue empty).
    with admin_channel(get_settings().broker_urls) as admin:
        queue = own_topology.ready_queues["default"].name
        assert wait_for(lambda: admin.message_count(queue) == 0, 10), admin.message_count(queue)


@pytest.mark.alone  # its task closes every connection of the broker
def test_a_job_whose_ack_was_lost_is_not_run_again_by_its_worker(
    clean, run_worker, records, caplog
):
    caplog.set_level(logging.INFO, logger="deferred.worker")
    worker = run_worker(concurrency=2)
    job_id = defer(cut_off, 0, records, "once")
    assert wait_for(lambda: worker.outcomes["duplicate"] == 1, 30), caplog.text
    time.sleep(1)
    assert [r["job"] for r in read_records(records)] == [job_id]
    (line,) = duplicates(caplog)
    assert job_id in line and "ran=here" in line
    # The warning names the cause: a lost connection, and no advice about long jobs.
    text = caplog.text
    assert "connection that delivered it was lost" in text
    assert "consumer timeout" not in text and "run this long" not in text


def test_a_copy_of_a_job_another_worker_ran_is_acked_without_running(
    clean, raw_channel, run_worker, records, caplog
):
    caplog.set_level(logging.INFO, logger="deferred.worker")
    ready = clean.ready_queues["default"].name
    first = run_worker()
    job_id = defer(timed, 0, records, "ran")
    assert wait_for(lambda: len(read_records(records)) == 1, 10)
    first.stop()
    assert wait_for(lambda: not first.consuming.is_set(), 10)
    time.sleep(0.5)  # its result record is out (within the writer's linger)
    # Another worker gets a counted copy of it (as a classic queue's redelivery
    # sends it on), and a counted copy of a job that never ran.
    due = datetime.fromtimestamp(read_records(records)[0]["due"], UTC)
    ran = record_job(records, "ran", id=job_id, task="tests.timed", due=due)
    never = record_job(records, "never", task="tests.timed")
    publish_copy(raw_channel, ready, ran, **{DELIVERIES_HEADER: 1})
    publish_copy(raw_channel, ready, never, **{DELIVERIES_HEADER: 1})
    second = run_worker()
    assert wait_for(lambda: len(read_records(records)) == 2, 10)
    assert wait_for(lambda: second.outcomes["duplicate"] == 1, 10), caplog.text
    assert sorted(r["label"] for r in read_records(records)) == ["never", "ran"]
    (line,) = duplicates(caplog)
    assert job_id in line and "ran=elsewhere" in line


def test_a_second_copy_of_a_publish_runs_only_if_the_first_did_not(
    clean, raw_channel, run_worker, records, caplog
):
    caplog.set_level(logging.INFO, logger="deferred.worker")
    ready = clean.ready_queues["default"].name
    worker = run_worker(concurrency=2)
    # Both copies of one publish, as a lost connection before the confirm leaves them;
    # and a second copy whose first never reached the broker.
    both = record_job(records, "both", task="tests.timed")
    alone = record_job(records, "alone", task="tests.timed")
    sent = time.time()
    publish_copy(raw_channel, ready, both)
    publish_copy(raw_channel, ready, both, **{COPY_HEADER: 1})
    publish_copy(raw_channel, ready, alone, **{COPY_HEADER: 1})
    assert wait_for(lambda: len(read_records(records)) == 2, 15)
    assert wait_for(lambda: worker.outcomes["duplicate"] == 1, 10), caplog.text
    time.sleep(0.5)
    runs = {r["label"]: r["at"] for r in read_records(records)}
    assert sorted(runs) == ["alone", "both"] and len(read_records(records)) == 2
    # The first copy ran at once; the lone second copy waited for a run to be recorded.
    assert runs["both"] - sent < 1.5
    assert runs["alone"] - sent >= 2.0
    assert both.id in duplicates(caplog)[0]


@pytest.mark.alone
def test_an_idle_connection_the_broker_dropped_is_replaced_before_a_publish(clean, broker_url):
    from deferred.broker import publisher

    queue = f"{clean.prefix}.test-idle-publisher"
    with pika.BlockingConnection(pika.URLParameters(broker_url)) as connection:
        connection.channel().queue_declare(queue, durable=True)  # transient ones are deprecated
    send = publisher(get_settings().broker_urls)
    send.publish("", queue, b"one", message_id="one")
    rabbitmqctl("close_all_connections", "test: an idle publisher's connection goes")
    time.sleep(1.5)
    send.publish("", queue, b"two", message_id="two")
    with pika.BlockingConnection(pika.URLParameters(broker_url)) as connection:
        channel = connection.channel()
        got = []
        while (message := channel.basic_get(queue, auto_ack=True))[0] is not None:
            got.append((message[2], (message[1].headers or {}).get(COPY_HEADER)))
        channel.queue_delete(queue)
    # Sent once each, and neither as a possible copy: the dead connection was found
    # before anything was sent on it.
    assert got == [(b"one", None), (b"two", None)]


@pytest.mark.slow
def test_the_jobs_of_a_paused_worker_run_on_another_and_not_again_when_it_resumes(
    clean, worker_process, records
):
    env = {
        "DEFERRED_TEST_WORKER_HEARTBEAT": "1",
        # A wide hold window: each worker holds its share of the jobs from the start.
        "DEFERRED_TEST_HOLD_WINDOW": "10",
    }
    paused = worker_process("--concurrency", "2", env=env)
    other = worker_process("--concurrency", "2", env=env)
    ids = [defer(timed, 2.0 + n * 0.1, records, str(n)) for n in range(20)]
    time.sleep(0.5)  # both workers hold their share
    paused.signal(signal.SIGSTOP)
    try:
        # RabbitMQ closes the paused worker's connection after about three heartbeats
        # and gives its held jobs to the other worker.
        assert wait_for(lambda: len(read_records(records)) >= 20, 30), other.output()
        time.sleep(2)
    finally:
        paused.signal(signal.SIGCONT)
    # Resumed, the paused worker runs none of the jobs it held: they ran elsewhere.
    assert wait_for(
        lambda: "Worker consuming" in paused.output().split("RabbitMQ unavailable")[-1], 30
    )
    time.sleep(3)
    ran = read_records(records)
    assert sorted(r["job"] for r in ran) == sorted(ids), ran
    for r in ran:
        assert r["at"] >= r["due"]  # never early
        assert r["at"] - r["due"] < 10, r  # the bound: about three heartbeats, not the pause
    other.signal(signal.SIGTERM)
    paused.signal(signal.SIGTERM)
    assert other.wait() == 0 and paused.wait() == 0
