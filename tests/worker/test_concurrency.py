"""``--concurrency N`` against the real broker: N due jobs of one queue run at once,
whatever the number of queues the worker consumes, and never more than N.

Every combination of 1 to 4 queues and concurrency 1 to 4, with jobs due at once
(taken from the ready queue) and with jobs that come through the hold queue
(held by the worker until due). The busy queue is the last one the worker
consumes: the others sit idle, each with a consumer of its own while the
worker has a slot for it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.conf import settings
from django.test import override_settings

from deferred.core.topology import Plan
from tests.conftest import depth, topology_of_its_own, wait_for
from tests.testapp.tasks import read_records, record, sleepy

QUEUES = ["default", "other", "third", "fourth"]
#: How long each job sleeps: long enough for the ones that run together to overlap.
JOB_S = 0.5


@pytest.fixture(scope="module")
def four_queues(broker_url: str) -> Iterator[Plan]:
    """A topology of four ready queues, in force for the module, deleted after."""
    with override_settings(DEFERRED={**settings.DEFERRED, "QUEUES": QUEUES}):
        with topology_of_its_own(broker_url) as plan:
            yield plan


def most_at_once(records: str) -> int:
    """The most jobs whose runs overlapped, from their start and end records."""
    at = {(r["label"], r["event"]): r["at"] for r in read_records(records)}
    spans = [(at[(label, "start")], at[(label, "end")]) for label, event in at if event == "start"]
    return max(sum(1 for s, e in spans if s <= start < e) for start, _end in spans)


@pytest.mark.parametrize("via", ["ready", "hold"])
@pytest.mark.parametrize("queues", [1, 2, 3, 4])
@pytest.mark.parametrize("concurrency", [1, 2, 3, 4])
def test_n_due_jobs_of_one_queue_run_at_once_whatever_the_number_of_queues(
    four_queues, run_worker, records, raw_channel, concurrency, queues, via
):
    # Given a worker of --concurrency N over 1 to 4 queues
    consumed = QUEUES[:queues]
    busy = consumed[-1]
    run_worker(queues=consumed, concurrency=concurrency)

    # When N + 1 jobs of one queue come due together (now, or after the hold queue)
    delay = 0.4 if via == "hold" else 0
    for n in range(concurrency + 1):
        sleepy.using(queue=busy).defer(delay, records, f"j{n}", JOB_S)
    ended = concurrency + 1
    assert wait_for(lambda: sum(r["event"] == "end" for r in read_records(records)) == ended, 30), (
        read_records(records)
    )

    # Then N of them ran at once, never more
    assert most_at_once(records) == concurrency, read_records(records)
    assert depth(raw_channel, four_queues.ready_queues[busy].name) == 0


def test_a_job_of_an_idle_queue_gets_the_next_free_slot_while_another_queue_is_busy(
    four_queues, run_worker, records
):
    # Given a worker of concurrency 2 over two queues, both slots busy with one queue
    run_worker(queues=QUEUES[:2], concurrency=2)
    for n in range(4):
        sleepy.using(queue="default").defer(0, records, f"d{n}", 1.0)
    assert wait_for(lambda: sum(r["event"] == "start" for r in read_records(records)) == 2, 10)

    # When a job comes to the idle queue
    record.using(queue="other").defer(0, records, "other")

    # Then it runs as soon as the slots free, not after the busy queue is drained: the
    # slot the busy queue borrowed goes to it (the busy queue's own consumer may be
    # pushed its next job first, in the slot it always keeps)
    assert wait_for(lambda: sum(r["event"] == "end" for r in read_records(records)) == 4, 20)
    at = {(r["label"], r["event"]): r["at"] for r in read_records(records)}
    last = max(at[(f"d{n}", "start")] for n in range(4))
    assert at[("other", "ran")] < last, read_records(records)


def consumers(channel, plan: Plan, queue: str) -> int:
    return channel.queue_declare(plan.ready_queues[queue].name, passive=True).method.consumer_count


def test_an_idle_queue_lends_its_consumer_to_a_busy_one_and_gets_it_back_once_drained(
    four_queues, run_worker, records, raw_channel
):
    # Given a worker of concurrency 2 over two queues, idle: a consumer on each
    run_worker(queues=QUEUES[:2], concurrency=2)
    assert consumers(raw_channel, four_queues, "other") == 1

    # When one queue's jobs take both slots
    for n in range(3):
        sleepy.using(queue="default").defer(0, records, f"d{n}", 1.0)
    assert wait_for(lambda: sum(r["event"] == "start" for r in read_records(records)) == 2, 10)

    # Then the idle queue's consumer was cancelled for the second slot
    assert consumers(raw_channel, four_queues, "other") == 0
    # And once the busy queue is drained it is back, and jobs are pushed to it again
    assert wait_for(lambda: sum(r["event"] == "end" for r in read_records(records)) == 3, 10)
    assert wait_for(lambda: consumers(raw_channel, four_queues, "other") == 1, 5)
    record.using(queue="other").defer(0, records, "other")
    assert wait_for(lambda: any(r["label"] == "other" for r in read_records(records)), 5)
