"""defer() against the real broker: timing, order, and every way it refuses."""

from __future__ import annotations

import random
import statistics
import threading
import time
from datetime import timedelta

import pika
import pytest
from django.test import override_settings
from django.utils import timezone

from deferred import defer, defer_many
from deferred.broker import BrokerUnavailable, TopologyNotDeclared, admin_channel
from deferred.core.jobs import Job
from tests.conftest import depth, rabbitmqctl, total_waiting, wait_for
from tests.testapp.tasks import explode, on_other, read_records, record, timed

pytestmark = pytest.mark.usefixtures("clean")


def ran_at(path: str) -> dict[str, float]:
    return {r["label"]: r["at"] for r in read_records(path)}


def test_article_experiment_3_2_1_runs_in_order_1_2_3_each_at_its_time(records, run_worker):
    # Given a worker, when jobs are deferred by 3, 2 and 1 units of 150 ms...
    run_worker()
    unit = 0.15
    for n in (3, 2, 1):
        defer(timed, n * unit, records, str(n))
    # ...then they run in the order they fall due, each at its own due time. The
    # order is 1, 2, 3 unless a defer() call itself took longer than a unit (a
    # first one opening its connection on a loaded machine), so it is checked
    # against the due times the jobs carry, not assumed.
    assert wait_for(lambda: len(read_records(records)) == 3, 10)
    ran = {r["label"]: r for r in read_records(records)}
    assert sorted(ran, key=lambda label: ran[label]["at"]) == sorted(
        ran, key=lambda label: ran[label]["due"]
    )
    for label, r in ran.items():
        lateness = r["at"] - r["due"]
        assert lateness >= 0, f"job {label} ran {-lateness:.3f} s early"
        assert lateness < 1.0, f"job {label} ran {lateness:.3f} s late"


def test_naive_single_queue_with_per_message_ttl_delivers_late_and_out_of_order(raw_channel):
    # The design we avoid: one queue, per-message expiration, dead-lettered to a sink.
    ch = raw_channel
    sink = ch.queue_declare("", exclusive=True).method.queue
    waiting = ch.queue_declare(
        "",
        exclusive=True,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": sink},
    ).method.queue
    start = time.monotonic()
    for ms in (450, 300, 150):
        ch.basic_publish("", waiting, str(ms).encode(), pika.BasicProperties(expiration=str(ms)))
    arrived: list[tuple[str, float]] = []
    deadline = time.monotonic() + 5
    while len(arrived) < 3 and time.monotonic() < deadline:
        method, _, body = ch.basic_get(sink, auto_ack=True)
        if method:
            arrived.append((body.decode(), time.monotonic() - start))
        else:
            time.sleep(0.005)
    # The 450 ms message at the head blocks the others: same order as sent...
    assert [label for label, _ in arrived] == ["450", "300", "150"]
    # ...and the 150 ms message comes out about 300 ms late.
    assert dict(arrived)["150"] >= 0.44


def test_randomized_200_jobs_each_once_never_early(records, run_worker, capsys):
    run_worker(concurrency=4)
    rng = random.Random(2026)
    for n in range(200):
        defer(timed, rng.uniform(0, 3.0), records, str(n))
    assert wait_for(lambda: len(read_records(records)) >= 200, 30)
    time.sleep(0.5)  # anything that would run twice has had time to
    runs = read_records(records)
    labels = [r["label"] for r in runs]
    assert sorted(labels, key=int) == [str(n) for n in range(200)], "each job runs exactly once"
    # Lateness from the due time each job carries (fixed as defer() starts).
    lateness_ms = sorted((r["at"] - r["due"]) * 1000 for r in runs)
    assert lateness_ms[0] >= 0, f"a job ran {-lateness_ms[0]:.1f} ms early"
    p50 = statistics.median(lateness_ms)
    p99 = lateness_ms[int(len(lateness_ms) * 0.99) - 1]
    with capsys.disabled():
        print(
            f"\n200 random jobs 0-3000 ms: lateness p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
            f"max {lateness_ms[-1]:.1f} ms"
        )
    assert p99 < 2000, "grossly late"


def test_defer_returns_the_job_id_carried_by_the_message(clean, raw_channel):
    job_id = defer(record, 0, "/dev/null", "x")
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 1, 5)
    _method, props, body = raw_channel.basic_get(clean.ready_queues["default"].name, auto_ack=True)
    job = Job.decode(body)
    assert job.id == job_id == props.message_id
    assert props.delivery_mode == 2  # persistent
    assert props.expiration is None  # never a per-message TTL
    assert job.task == record.name and job.args == ("/dev/null", "x") and job.attempt == 1


def test_timedelta_and_aware_datetime(records, run_worker):
    run_worker()
    start = time.time()
    # "past" first: it is in the ready queue before the others' due times are
    # even taken, so it runs first however long a publish takes.
    defer(record, timezone.now() - timedelta(days=1), records, "past")
    defer(record, timedelta(milliseconds=200), records, "td")
    defer(record, timezone.now() + timedelta(milliseconds=300), records, "dt")
    assert wait_for(lambda: len(read_records(records)) == 3, 10)
    at = ran_at(records)
    assert at["td"] - start >= 0.2 and at["dt"] - start >= 0.3
    assert at["past"] < at["td"]


def test_queue_option_through_using_not_kwargs(clean, raw_channel, records):
    on_other.using(queue="default").defer(0, records, "a")
    on_other.defer(0, records, "b")
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["other"].name) == 1, 5)
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 1, 5)


BAD_CALLS = [
    ("negative", ValueError, lambda: defer(record, -1, "p", "l")),
    ("nan", ValueError, lambda: defer(record, float("nan"), "p", "l")),
    ("inf", ValueError, lambda: defer(record, float("inf"), "p", "l")),
    ("naive", ValueError, lambda: defer(record, timezone.now().replace(tzinfo=None), "p", "l")),
    ("too long", ValueError, lambda: defer(record, timedelta(days=3651), "p", "l")),
    ("delay type", TypeError, lambda: defer(record, "10", "p", "l")),
    ("unknown task", ValueError, lambda: defer("no.such.task", 1)),
    ("not a task", TypeError, lambda: defer(print, 1)),
    ("not json", TypeError, lambda: defer(record, 1, object(), "l")),
    ("bad arguments", TypeError, lambda: defer(record, 1, "only-one")),
    ("unexpected kwarg", TypeError, lambda: defer(explode, 1, "m", colour="red")),
    ("queue not configured", ValueError, lambda: record.using(queue="nowhere").defer(1, "p", "l")),
]


@pytest.mark.parametrize(("name", "error", "call"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_publishes_nothing(clean, raw_channel, name, error, call):
    with pytest.raises(error):
        call()
    time.sleep(0.05)
    assert total_waiting(raw_channel, clean) == 0


def test_task_kwargs_named_like_defer_parameters_go_to_the_task(clean, raw_channel):
    # defer's own parameters are positional-only: a task may take "task" or "delay".
    from deferred import task

    @task(name="tests.kw_named")
    def kw_named(task, delay):
        pass

    defer(kw_named, 0, task="t", delay="d")
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 1, 5)


def test_undeclared_topology_raises_a_clear_error(broker_url):
    with override_settings(DEFERRED={"BROKER_URL": broker_url, "PREFIX": "deferred-undeclared"}):
        with pytest.raises(TopologyNotDeclared, match="declare_delay_topology"):
            defer(record, 1, "p", "l")


def test_unroutable_message_raises_instead_of_vanishing(broker_url):
    # The delay exchanges exist but the ready queue is gone: mandatory + confirms catch it.
    # Without a ledger only: the ledger keeps a copy of every job, so a job for a ready
    # queue deleted by hand is routed there (test_a_job_for_a_deleted_ready_queue_...).
    prefix = "deferred-unroutable"
    with override_settings(
        DEFERRED={
            "BROKER_URL": broker_url,
            "PREFIX": prefix,
            "RADIX": 16,
            "MAX_DELAY": 60,
            "LEDGER": False,
        }
    ):
        from django.core.management import call_command

        from deferred.conf import get_settings
        from deferred.core.topology import plan_topology

        call_command("declare_delay_topology", verbosity=0)
        plan = plan_topology(get_settings())
        try:
            with admin_channel(broker_url) as admin:
                admin.channel.queue_delete(plan.ready_queues["default"].name)
            with pytest.raises(TopologyNotDeclared, match="declare_delay_topology"):
                defer(record, 0, "p", "l")
        finally:
            with admin_channel(broker_url) as admin:
                admin.delete_everything(plan)


def test_a_job_for_a_deleted_ready_queue_is_kept_by_the_ledger(broker_url):
    """With the ledger (the default), the job is not refused: the ledger has it, as
    published, and the worker says the topology is missing (deferred.core.notices)."""
    from deferred.records.pending import find

    prefix = "deferred-unroutable-ledger"
    with override_settings(
        DEFERRED={"BROKER_URL": broker_url, "PREFIX": prefix, "RADIX": 16, "MAX_DELAY": 60}
    ):
        from django.core.management import call_command

        from deferred.conf import get_settings
        from deferred.core.topology import plan_topology

        call_command("declare_delay_topology", verbosity=0)
        plan = plan_topology(get_settings())
        try:
            with admin_channel(broker_url) as admin:
                admin.channel.queue_delete(plan.ready_queues["default"].name)
            job_id = defer(record, 0, "p", "l")
            found = find(get_settings(), job_id)
            assert found.job is not None and found.job.args == ("p", "l")
        finally:
            with admin_channel(broker_url) as admin:
                admin.delete_everything(plan)


def test_broker_down_raises_broker_unavailable():
    with override_settings(DEFERRED={"BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}):
        with pytest.raises(BrokerUnavailable, match="Cannot connect"):
            defer(record, 1, "p", "l")


def test_threads_each_get_a_connection(clean, raw_channel, records, run_worker):
    errors = []

    def burst(n: int) -> None:
        try:
            for i in range(25):
                defer(record, 0.05, records, f"{n}-{i}")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=burst, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    run_worker(concurrency=4)
    assert wait_for(lambda: len(read_records(records)) == 200, 20)
    assert len({r["label"] for r in read_records(records)}) == 200


@pytest.mark.alone
def test_defer_reopens_a_connection_the_broker_dropped(clean, broker_url):
    # An idle web process finds its connection gone: the next defer() reconnects once.
    defer(record, 0, "/dev/null", "before")
    rabbitmqctl("close_all_connections", "test: an idle connection was dropped")
    time.sleep(0.5)
    defer(record, 0, "/dev/null", "after")
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    try:
        channel = connection.channel()
        assert wait_for(lambda: depth(channel, clean.ready_queues["default"].name) == 2, 5)
    finally:
        connection.close()


def test_a_job_for_an_undeclared_queue_is_kept_in_the_failed_queue(clean, broker_url, raw_channel):
    # "billing" was added to QUEUES but declare_delay_topology was not run again.
    # mandatory catches the first hop (a job due now, or within the hold window,
    # goes straight to a ready or hold queue); after a delay, the level exchanges'
    # alternate exchange keeps the job in the failed queue instead of dropping it.
    queues = ["default", "other", "billing"]
    with override_settings(
        DEFERRED={"BROKER_URL": broker_url, "PREFIX": clean.prefix, "QUEUES": queues}
    ):
        with pytest.raises(TopologyNotDeclared):
            record.using(queue="billing").defer(0, "p", "now")
        with pytest.raises(TopologyNotDeclared):
            record.using(queue="billing").defer(0.05, "p", "within the hold window")
        job_id = record.using(queue="billing").defer(0.3, "p", "later")
    assert wait_for(lambda: depth(raw_channel, clean.failed_queue.name) == 1, 5)
    _method, _props, body = raw_channel.basic_get(clean.failed_queue.name, auto_ack=True)
    assert Job.decode(body).id == job_id


@pytest.mark.alone
def test_defer_fails_instead_of_hanging_while_the_broker_blocks_publishers(
    clean, broker_url, raw_channel
):
    # A memory alarm makes RabbitMQ block publishing connections: defer() gives
    # up at its one deadline, PUBLISH_TIMEOUT, and names the job it was publishing.
    base = {"BROKER_URL": broker_url, "PREFIX": clean.prefix, "QUEUES": ["default", "other"]}
    with override_settings(DEFERRED={**base, "PUBLISH_TIMEOUT": 1.5}):
        first = defer(record, 0, "p", "connect first")  # the blocked connection is an open one
        rabbitmqctl("set_vm_memory_high_watermark", "0.0000001")
        try:
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable, match="PUBLISH_TIMEOUT") as raised:
                defer(record, 0, "p", "blocked")
            took = time.monotonic() - started
            # The deadline covers the retry: one deadline, not one per attempt.
            assert 1.5 <= took < 4, took
            assert raised.value.job_id and raised.value.job_ids == (raised.value.job_id,)
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable) as many:
                defer_many([(record, 0, ("p", "a")), (record, 0, ("p", "b"))])
            assert time.monotonic() - started < 4
            assert len(many.value.job_ids) == 2 and many.value.job_id == many.value.job_ids[0]
        finally:
            rabbitmqctl("set_vm_memory_high_watermark", "0.4")
    # The outcome is unknown, not "nothing published": once the alarm clears,
    # the broker may well have taken the job the call gave up on.
    time.sleep(1.5)
    ready = clean.ready_queues["default"].name
    bodies = []
    while (message := raw_channel.basic_get(ready, auto_ack=True))[0] is not None:
        bodies.append(Job.decode(message[2]).id)
    assert first in bodies
    assert set(bodies) <= {first, raised.value.job_id, *many.value.job_ids}
    assert total_waiting(raw_channel, clean) == 0


def test_defer_many_publishes_all_in_one_go(clean, records, run_worker):
    from deferred import defer_many

    calls = [(record, 0.05 * (n % 4), (records, str(n))) for n in range(300)]
    calls.append((explode.name, 0, ("via name",), {}))
    ids = defer_many(calls)
    assert len(ids) == 301 and len(set(ids)) == 301
    run_worker(concurrency=4)
    assert wait_for(lambda: len(read_records(records)) == 300, 20)
    assert sorted(int(r["label"]) for r in read_records(records)) == list(range(300))


def test_defer_many_is_all_or_nothing_on_bad_input(clean, raw_channel):
    from deferred import defer_many

    with pytest.raises(ValueError):
        defer_many([(record, 0, ("p", "ok")), (record, -1, ("p", "bad"))])
    with pytest.raises(TypeError):
        defer_many([(record, 0)])
    with pytest.raises(TypeError):
        defer_many([(record, 0, ("p", object()))])
    time.sleep(0.1)
    assert total_waiting(raw_channel, clean) == 0


def test_defer_many_raises_when_the_topology_is_missing(broker_url):
    from deferred import defer_many

    with override_settings(DEFERRED={"BROKER_URL": broker_url, "PREFIX": "deferred-undeclared"}):
        with pytest.raises(TopologyNotDeclared):
            defer_many([(record, 1, ("p", "a")), (record, 1, ("p", "b"))])


def test_every_batch_of_publish_many_reports_unroutable_messages(broker_url):
    # The return callback is registered once per channel: a later batch on the
    # same thread must still see its own returns.
    from deferred.broker import Outgoing, publisher

    nowhere = Outgoing("amq.direct", "no-queue-is-bound-to-this", b"{}", "lost")
    for _ in range(3):
        with pytest.raises(TopologyNotDeclared, match="could not be routed"):
            publisher(broker_url).publish_many([nowhere])
