"""Priorities as pure logic: the scale, its levels, the API and the topology; no broker."""

from __future__ import annotations

import dataclasses

import pytest

from deferred import task
from deferred.conf import get_settings
from deferred.core.jobs import BrokenMessage, Job, utcnow
from deferred.core.priorities import (
    DEFAULT_LEVEL,
    MAX_LEVEL,
    broker_levels,
    honoured,
    level,
    validate_priority,
)
from deferred.core.topology import plan_topology
from deferred.producer.tasks import unregister


def test_levels_keep_the_order_and_put_the_default_at_the_quorum_boundary():
    levels = [level(p) for p in range(-100, 101)]
    assert levels == sorted(levels)  # never inverts an order
    assert level(0) == DEFAULT_LEVEL == 4
    assert level(1) == 5 and level(100) == MAX_LEVEL == 9  # above the default: "high"
    assert level(-1) == 3 and level(-100) == 0
    assert set(levels) == set(range(10))
    # 4.0-4.2 quorum queues: 5 and above is "high", the rest "normal".
    assert all((level(p) >= 5) == (p > 0) for p in range(-100, 101))


@pytest.mark.parametrize("bad", [101, -101, 1.5, "5", True, None])
def test_a_priority_is_an_integer_from_minus_100_to_100(bad):
    with pytest.raises((TypeError, ValueError), match="priority must be"):
        validate_priority(bad)


def test_what_each_broker_honours():
    assert broker_levels("classic", (3, 10, 8)) == 10
    assert broker_levels("quorum", (3, 13, 7)) == 1
    assert broker_levels("quorum", (4, 0, 5)) == 2
    assert broker_levels("quorum", (4, 3, 6)) == 32
    assert honoured(0, 1) and not honoured(10, 1)
    assert honoured(10, 2) and not honoured(-10, 2)  # nothing runs after "normal"
    assert honoured(-10, 10) and honoured(-10, 32)


def test_a_jobs_priority_travels_in_its_body_only_when_set():
    job = Job(id="x", task="t", args=(), kwargs={}, due=utcnow(), queue="default")
    assert "priority" not in job.to_dict()
    assert Job.decode(job.encode()).priority == 0
    urgent = dataclasses.replace(job, priority=50)
    assert Job.decode(urgent.encode()).priority == 50
    for bad in (500, "high"):
        data = {**urgent.to_dict(), "priority": bad}
        with pytest.raises(BrokenMessage, match="priority"):
            Job.from_dict(data)


def test_task_priority_and_using_override_it():
    @task(name="tests.logic.urgent", priority=50)
    def urgent() -> None: ...

    try:
        assert urgent.target_priority == 50
        assert urgent.using(priority=-20).target_priority == -20
        assert urgent.using(queue="other").target_priority == 50
        assert urgent.target_priority == 50  # using() made a copy
        with pytest.raises(ValueError):
            urgent.using(priority=200)
        with pytest.raises(ValueError):
            task(name="tests.logic.bad", priority=101)(lambda: None)
    finally:
        unregister("tests.logic.urgent")


def test_classic_topologies_with_priorities_get_queues_and_an_id_of_their_own():
    settings = get_settings()
    plan = plan_topology(settings)
    assert plan.max_priority == 9 and ".P9.classic" in plan.topology_id
    ready = plan.ready_queues["default"]
    assert ready.name == f"{settings.prefix}.ready.p9.default"
    assert ready.arguments["x-max-priority"] == 9
    assert plan.hold_queues["default"].arguments["x-max-priority"] == 9
    assert all("x-max-priority" not in q.arguments for q in plan.delay_queues)
    legacy_ready, legacy_hold = plan.legacy_queues
    assert legacy_ready["default"] == f"{settings.prefix}.ready.default"
    assert legacy_hold["other"] == f"{settings.prefix}.hold.other"

    fifo = plan_topology(dataclasses.replace(settings, priorities=False))
    assert fifo.max_priority == 0 and ".P" not in fifo.topology_id
    assert fifo.ready_queues["default"].name == f"{settings.prefix}.ready.default"
    # Turned off: the queues with priorities are the ones the workers drain.
    assert fifo.legacy_queues == (
        {q: f"{settings.prefix}.ready.p9.{q}" for q in settings.queues},
        {q: f"{settings.prefix}.hold.p9.{q}" for q in settings.queues},
    )

    quorum = plan_topology(dataclasses.replace(settings, queue_type="quorum"))
    # Quorum queues order by priority with no argument: nothing changes for them.
    assert quorum.max_priority == 0 and ".P" not in quorum.topology_id
    assert "x-max-priority" not in quorum.ready_queues["default"].arguments
    assert quorum.legacy_queues == ({}, {})
