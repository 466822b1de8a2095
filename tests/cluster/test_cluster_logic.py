"""The cluster logic that needs no broker: settings, failover order, stuck rule, repair plan."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from deferred.broker import Failover, as_urls
from deferred.broker.http_api import QueueInfo
from deferred.cluster.repair import commands, refusal, replicas_of
from deferred.cluster.stuck import Episodes, StuckQueue, find_stuck, stuck_queue
from deferred.conf import _build
from deferred.core.topology import build_plan

A, B, C = (f"amqp://u:p@127.0.0.1:{port}/%2F" for port in (5681, 5682, 5683))


# --------------------------------------------------------------------------- settings


def test_broker_url_may_be_one_url_or_a_list() -> None:
    assert _build({"BROKER_URL": A}).broker_urls == (A,)
    assert _build({"BROKER_URL": [A, B, C]}).broker_urls == (A, B, C)
    assert _build({"BROKER_URL": (A, B)}).broker_urls == (A, B)


@pytest.mark.parametrize(
    "value",
    [
        [],
        "",
        "http://rabbit:5672/",
        [A, "rabbit:5672"],
        [A, A],
        [A, "amqp://u:p@127.0.0.1:5682/other"],
        5672,
    ],
)
def test_bad_broker_urls_are_configuration_errors(value: object) -> None:
    with pytest.raises(ImproperlyConfigured, match="BROKER_URL"):
        _build({"BROKER_URL": value})


def test_publish_timeout_group_size_and_stuck_settings() -> None:
    built = _build({})
    assert built.publish_timeout_s == 10.0
    assert built.quorum_group_size == 3
    assert built.stuck_after_s == 30.0 and built.repair_stuck is True
    built = _build({"PUBLISH_TIMEOUT": timedelta(milliseconds=2500), "QUORUM_GROUP_SIZE": 5})
    assert built.publish_timeout_s == 2.5 and built.quorum_group_size == 5
    for key, bad in [
        ("PUBLISH_TIMEOUT", 0),
        ("PUBLISH_TIMEOUT", -1),
        ("PUBLISH_TIMEOUT", 3600),
        ("QUORUM_GROUP_SIZE", 0),
        ("QUORUM_GROUP_SIZE", True),
        ("STUCK_AFTER", 0.5),
        ("REPAIR_STUCK", "yes"),
    ]:
        with pytest.raises(ImproperlyConfigured, match=key):
            _build({key: bad})


def test_quorum_queues_are_replicated_with_balanced_leaders_and_confirmed_hops() -> None:
    plan = build_plan(
        prefix="p",
        radix=16,
        resolution_ms=1,
        max_delay_ms=60_000,
        queue_type="quorum",
        queues=["default"],
        group_size=3,
    )
    for queue in plan.all_queues:
        if queue in plan.streams or queue == plan.up_queue:
            continue  # (the "up" marker's queue is classic: its message must die with a restart)
        assert queue.arguments["x-queue-type"] == "quorum"
        assert queue.arguments["x-quorum-initial-group-size"] == 3
        assert queue.arguments["x-queue-leader-locator"] == "balanced"
    # The cancels and the results are streams, replicated on as many nodes.
    for stream in plan.streams:
        assert stream.arguments["x-queue-type"] == "stream"
        assert stream.arguments["x-initial-cluster-size"] == 3
    for queue in (*plan.delay_queues, *plan.ready_queues.values()):
        assert queue.arguments["x-dead-letter-strategy"] == "at-least-once"
    classic = build_plan(
        prefix="p", radix=16, resolution_ms=1, max_delay_ms=60_000, queue_type="classic",
        queues=["default"],
    )  # fmt: skip
    assert not any("x-queue-leader-locator" in q.arguments for q in classic.all_queues)


# --------------------------------------------------------------------------- failover order


def test_failover_starts_at_the_first_node_and_moves_on_when_one_is_lost() -> None:
    failover = Failover()
    urls = as_urls([A, B, C])
    assert failover.order(urls) == [0, 1, 2]
    failover.connected(urls, 0)
    failover.lost(urls, 0)
    assert failover.order(urls) == [1, 2, 0]
    # A connection already on the next node stays there; losing a node that is
    # not first changes nothing.
    failover.connected(urls, 1)
    failover.lost(urls, 2)
    assert failover.order(urls) == [1, 2, 0]
    failover.lost(urls, 1)
    failover.lost(urls, 2)
    assert failover.order(urls) == [0, 1, 2]
    assert failover.order(as_urls(A)) == [0]


# --------------------------------------------------------------------------- stuck rule


def info(dead_lettered: int, history: list[int], *, every: float = 5.0) -> QueueInfo:
    return QueueInfo(
        name="p.delay.q",
        type="quorum",
        messages=dead_lettered + 3,
        ready=3,
        unacked=0,
        dead_lettered=dead_lettered,
        leader="rabbit-a@localhost",
        members=("rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost"),
        online=("rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost"),
        dead_lettered_history=tuple((1000 + i * every, n) for i, n in enumerate(history)),
    )


def test_dead_letters_that_stay_for_the_whole_window_are_stuck() -> None:
    stuck = stuck_queue(info(6, [9, 7, 6, 6, 6, 6, 6]), stuck_after_s=30)
    assert stuck is not None
    assert stuck.jobs == 6 and stuck.for_s == 30 and stuck.leader == "rabbit-a@localhost"


@pytest.mark.parametrize(
    ("now", "history"),
    [
        (6, [6, 6, 0, 6, 6, 6, 6]),  # a zero in the window: they moved
        (6, [6, 6, 6, 6]),  # the samples cover 15 s only
        (0, [6, 6, 6, 6, 6, 6, 6]),  # none left now
        (6, []),  # no history
    ],
)
def test_moving_or_young_dead_letters_are_not_stuck(now: int, history: list[int]) -> None:
    assert stuck_queue(info(now, history), stuck_after_s=30) is None


def test_only_the_named_queues_are_judged() -> None:
    queues = {"p.delay.q": info(6, [6] * 8)}
    assert [s.queue for s in find_stuck(queues, ["p.delay.q", "gone"], 30)] == ["p.delay.q"]
    assert find_stuck(queues, ["p.ready.default"], 30) == []


def test_each_episode_is_reported_once() -> None:
    episodes = Episodes()
    one = StuckQueue("q1", 3, 40, "a", ("a", "b"), ("a", "b"))
    two = StuckQueue("q2", 1, 40, "b", ("a", "b"), ("a", "b"))
    assert episodes.new([one]) == [one]
    assert episodes.new([one, two]) == [two]
    assert episodes.new([two]) == []
    assert episodes.new([one, two]) == [one]  # q1's episode had ended


# --------------------------------------------------------------------------- repair plan


def test_repair_commands_move_the_leadership_and_add_the_replica_back() -> None:
    stuck = StuckQueue("p.delay.q", 4, 40, "rabbit-a@localhost", ("rabbit-a@localhost",
        "rabbit-b@localhost"), ("rabbit-a@localhost", "rabbit-b@localhost"))  # fmt: skip
    assert commands(stuck, "/") == (
        "rabbitmq-queues -n rabbit-b@localhost delete_member -p / p.delay.q rabbit-a@localhost",
        "rabbitmq-queues -n rabbit-b@localhost add_member -p / p.delay.q rabbit-a@localhost",
    )
    assert refusal(stuck) is None


def test_repair_is_refused_when_it_could_cost_the_majority() -> None:
    nodes = ("a", "b", "c")
    assert "offline" in (refusal(StuckQueue("q", 1, 40, "a", nodes, ("a", "b"))) or "")
    assert "single replica" in (refusal(StuckQueue("q", 1, 40, "a", ("a",), ("a",))) or "")
    assert "no leader" in (refusal(StuckQueue("q", 1, 40, None, nodes, nodes)) or "")


# --------------------------------------------------------------------------- management API


def samples(*points: tuple[int, int]) -> dict:
    """The management API's ``*_details`` of a figure: newest sample first."""
    return {"samples": [{"timestamp": at, "sample": n} for at, n in points]}


def test_queue_info_derives_the_dead_lettered_history_from_the_sampled_figures() -> None:
    row = {
        "name": "p.delay.q",
        "type": "quorum",
        "leader": "rabbit-b@localhost",
        "node": "rabbit-a@localhost",  # stale after a leader change: leader wins
        "members": ["rabbit-a@localhost", "rabbit-b@localhost"],
        "online": ["rabbit-b@localhost"],
        "messages": 9,
        "messages_ready": 2,
        "messages_unacknowledged": 1,
        "messages_dlx": 6,
        "messages_details": samples((10_000, 9), (5_000, 8)),
        "messages_ready_details": samples((10_000, 2), (5_000, 1)),
        "messages_unacknowledged_details": samples((10_000, 1)),
    }
    info = QueueInfo.from_api(row)
    assert info.leader == "rabbit-b@localhost" and info.dead_lettered == 6
    assert info.online == ("rabbit-b@localhost",)
    assert info.dead_lettered_history == ((5.0, 7), (10.0, 6))
    # A queue read before its first statistics, or a classic one, is calm.
    fresh = QueueInfo.from_api({"name": "q", "type": "quorum", "leader": "a"})
    assert fresh.dead_lettered == 0 and fresh.messages == 0
    classic = QueueInfo.from_api({"name": "q", "messages": 5, "messages_ready": 1, "node": "a"})
    assert classic.dead_lettered == 0 and classic.leader == "a" and classic.type == "classic"
    # Without messages_dlx (older brokers), what is neither ready nor unacked counts.
    old = QueueInfo.from_api({**row, "messages_dlx": None})
    assert old.dead_lettered == 6


def test_leaders_per_node_busiest_first() -> None:
    from deferred.cluster.nodes import leaders_per_node

    def q(name: str, leader: str | None) -> QueueInfo:
        return QueueInfo(name, "quorum", 0, 0, 0, 0, leader, (), ())

    queues = {"a": q("a", "n2"), "b": q("b", "n1"), "c": q("c", "n2"), "d": q("d", None)}
    assert leaders_per_node(queues, ["a", "b", "c", "d", "gone"]) == {"n2": 2, "?": 1, "n1": 1}


def test_the_status_text_shows_nodes_leaders_and_stuck_queues() -> None:
    from deferred.cluster.nodes import ClusterView, NodeState
    from deferred.operate.status_text import render_cluster

    stuck = StuckQueue("p.delay.q", 14, 30, "rabbit-a@h", ("rabbit-a@h",), ("rabbit-a@h",))
    view = ClusterView(
        read_from="10.0.0.2:5672/",
        api="http://10.0.0.2:15672/",
        nodes=(NodeState("rabbit-a@h", "running"), NodeState("rabbit-b@h", "down", ("disk",))),
        nodes_source="management",
        leaders={"rabbit-a@h": 40, "rabbit-b@h": 19},
        stuck=(stuck,),
    )
    text = "\n".join(render_cluster(view))
    assert "read from 10.0.0.2:5672/" in text
    assert "rabbit-b@h" in text and "down  alarms: disk" in text
    assert "queue leaders per node: rabbit-a@h 40, rabbit-b@h 19" in text
    assert "STUCK: 14 dead-lettered jobs in p.delay.q" in text and "deferred_repair" in text
    single = ClusterView("h:5672/", None, (NodeState("h:5672/", "answers"),), "amqp", None, None)
    assert render_cluster(single) == ["read from h:5672/"]


# quorum_status --formatter json, as RabbitMQ 3.10.8 and 4.3.6 print it.
STATUS_3_10 = [
    {"Node Name": "rabbit-a@localhost", "Raft State": "leader", "Log Index": 2,
     "Commit Index": 2, "Snapshot Index": "undefined", "Term": 1, "Machine Version": 2},
    {"Node Name": "rabbit-b@localhost", "Raft State": "follower", "Log Index": 2,
     "Commit Index": 2, "Snapshot Index": "undefined", "Term": 1, "Machine Version": 2},
    {"Node Name": "rabbit-c@localhost", "Raft State": "noproc", "Log Index": "",
     "Commit Index": "", "Snapshot Index": "", "Term": "", "Machine Version": ""},
]  # fmt: skip
STATUS_4_3 = [
    {"Node Name": "rabbit-a@localhost", "Raft State": "follower", "Membership": "voter",
     "Last Log Index": 9, "Last Written": 9, "Last Applied": 9, "Commit Index": 9,
     "Snapshot Index": -1, "Term": 2, "Machine Version": 8},
    {"Node Name": "rabbit-b@localhost", "Raft State": "leader", "Membership": "voter",
     "Last Log Index": 9, "Last Written": 9, "Last Applied": 9, "Commit Index": 9,
     "Snapshot Index": -1, "Term": 2, "Machine Version": 8},
    {"Node Name": "rabbit-c@localhost", "Raft State": "follower", "Membership": "promotable",
     "Last Log Index": 3, "Last Written": 3, "Last Applied": 3, "Commit Index": 3,
     "Snapshot Index": -1, "Term": 2, "Machine Version": 8},
]  # fmt: skip


def test_quorum_status_is_read_in_the_3x_and_the_4x_shape():
    assert replicas_of(STATUS_3_10) == (
        "rabbit-a@localhost",
        ("rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost"),
        ("rabbit-a@localhost", "rabbit-b@localhost"),
    )
    # A member still catching up (promotable) does not vote: not counted online.
    assert replicas_of(STATUS_4_3) == (
        "rabbit-b@localhost",
        ("rabbit-a@localhost", "rabbit-b@localhost", "rabbit-c@localhost"),
        ("rabbit-a@localhost", "rabbit-b@localhost"),
    )


@pytest.mark.parametrize("rows", [None, {}, [{"Node": "x"}], ["text"], [{"Node Name": "a"}]])
def test_quorum_status_in_another_shape_is_not_read(rows):
    assert replicas_of(rows) is None
