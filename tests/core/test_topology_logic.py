"""The topology plan, without a broker: names, TTLs, bindings and limits.

A small simulator follows the plan's bindings with RabbitMQ's topic-matching
rules, so the routing of every delay is checked end to end in pure Python.
"""

import json
import random
import re

import pytest

from deferred.core.topology import (
    MAX_ROUTING_KEY_BYTES,
    MAX_TTL_MS,
    NO_DELIVERY_LIMIT,
    Plan,
    TopologyError,
    build_plan,
    levels_for,
    widest_plan,
)

YEAR_MS = 365 * 24 * 3600 * 1000


def make(radix=2, resolution_ms=1, max_delay_ms=YEAR_MS, queue_type="classic", queues=("default",)):
    return build_plan(
        prefix="p",
        radix=radix,
        resolution_ms=resolution_ms,
        max_delay_ms=max_delay_ms,
        queue_type=queue_type,
        queues=queues,
    )


def topic_matches(pattern: str, key: str) -> bool:
    """RabbitMQ topic semantics: '*' is one word, '#' zero or more."""
    regex = []
    for word in pattern.split("."):
        if word == "*":
            regex.append(r"[^.]+")
        elif word == "#":
            regex.append(r".*")
        else:
            regex.append(re.escape(word))
    return re.fullmatch(r"\.".join(regex), key) is not None


def route(plan: Plan, delay_ms: int, queue: str = "default") -> tuple[list[int], str]:
    """Follow a message through the plan: the TTLs it waits and the queue it ends in."""
    key = plan.routing_key(delay_ms, queue)
    by_name = {q.name: q for q in plan.delay_queues}
    ready = {q.name for q in plan.ready_queues.values()}
    dead_letter = {q.name: q.arguments["x-dead-letter-exchange"] for q in plan.delay_queues}
    exchanges = [plan.ingest_exchange]
    waited: list[int] = []
    for _ in range(plan.levels + 2):
        destinations: set[str] = set()
        while exchanges:  # expand exchange-to-exchange bindings
            source = exchanges.pop()
            for b in plan.bindings:
                if b.source == source and topic_matches(b.routing_key, key):
                    if b.destination_type == "exchange":
                        exchanges.append(b.destination)
                    else:
                        destinations.add(b.destination)
        if plan.ledger_queue is not None and not waited:
            # The ledger gets a copy of every job as it comes in (a job due at once
            # too: it is pending until a worker takes it), and of no hop after that.
            assert plan.ledger_queue.name in destinations, f"{key}: {destinations}"
            destinations.discard(plan.ledger_queue.name)
        elif plan.ledger_queue is not None:
            assert plan.ledger_queue.name not in destinations, f"{key}: {destinations}"
        assert len(destinations) == 1, f"{key} routed to {destinations}"
        (dest,) = destinations
        if dest in ready:
            return waited, dest
        waited.append(by_name[dest].ttl_ms)
        exchanges = [dead_letter[dest]]
    raise AssertionError(f"{key} never reached a ready queue")


@pytest.mark.parametrize(
    ("radix", "levels"),
    [(2, 35), (4, 18), (10, 11), (16, 9)],
)
def test_levels_cover_a_year_in_milliseconds(radix, levels):
    plan = make(radix=radix)
    assert plan.levels == levels
    assert radix**plan.levels - 1 >= YEAR_MS > radix ** (plan.levels - 1) - 1


@pytest.mark.parametrize("radix", [2, 4, 10, 16])
def test_one_queue_per_level_and_digit_with_its_ttl(radix):
    plan = make(radix=radix, max_delay_ms=radix**6 - 1)
    assert plan.levels == 6
    ttls = {(q.level, q.digit): q.ttl_ms for q in plan.delay_queues}
    assert ttls == {(i, d): d * radix**i for i in range(6) for d in range(1, radix)}
    for q in plan.delay_queues:
        assert q.arguments["x-message-ttl"] == q.ttl_ms
        assert q.arguments["x-dead-letter-exchange"].endswith(f".after.L{q.level:02d}")
        assert q.name.startswith("p.delay.")


@pytest.mark.parametrize("radix", [2, 4, 10, 16])
def test_binding_patterns(radix):
    plan = make(radix=radix, max_delay_ms=radix**3 - 1)
    patterns = {
        (
            b.source.rsplit(".", 1)[-1],
            b.destination.rsplit(".", 2)[-2:][0] + "." + b.destination.rsplit(".", 1)[-1],
            b.routing_key,
        )
        for b in plan.bindings
    }
    d = radix - 1
    # From the ingest exchange to the top level's queue of digit d: "d.*.*.*".
    assert ("ingest", f"L02.d{d:02d}", f"{d}.*.*.*") in patterns
    # ... to level 0: every higher digit is zero.
    assert ("ingest", "L00.d01", "0.0.1.*") in patterns
    # After level 2, on to level 0 when level 1 is zero.
    assert ("L02", "L00.d01", "*.0.1.*") in patterns
    # No digit left: straight to the ready queue named by the last word.
    ready = {
        (b.source.rsplit(".", 1)[-1], b.routing_key)
        for b in plan.bindings
        if b.destination == "p.ready.default"
    }
    assert ready == {
        ("ingest", "0.0.0.default"),
        ("L02", "*.0.0.default"),
        ("L01", "*.*.0.default"),
        ("L00", "*.*.*.default"),
    }


def test_jobs_that_find_no_route_after_the_first_hop_go_to_the_failed_queue():
    # mandatory only covers the first hop: later hops need an alternate exchange.
    plan = make(radix=4)
    assert plan.failed_exchange.name == "p.failed" and plan.failed_exchange.type == "fanout"
    assert plan.shared_bindings[0].destination == plan.failed_queue.name
    levels = [e for e in plan.exchanges if ".after." in e.name]
    assert len(levels) == plan.levels
    assert all(e.arguments == {"alternate-exchange": "p.failed"} for e in levels)
    ingest = next(e for e in plan.exchanges if e.name == plan.ingest_exchange)
    assert ingest.arguments == {}  # mandatory reports the first hop to the publisher
    assert plan.ready_queues["default"].arguments["x-dead-letter-exchange"] == "p.failed"


@pytest.mark.parametrize("radix", [2, 4, 10, 16])
def test_every_delay_waits_exactly_its_rounded_value(radix):
    rng = random.Random(radix)
    plan = make(radix=radix, resolution_ms=1, max_delay_ms=10**7)
    for delay in [0, 1, radix - 1, radix, radix**2 + 1, 10**7, *rng.sample(range(10**7), 200)]:
        waited, ready = route(plan, delay)
        assert sum(waited) == delay
        assert ready == "p.ready.default"
        assert waited == sorted(waited, reverse=True)  # highest level first
        assert len(waited) == plan.hops(delay)


def test_routing_to_the_named_queue():
    plan = make(queues=("default", "billing"))
    assert route(plan, 1234, "billing")[1] == "p.ready.billing"
    assert plan.routing_key(5, "billing").endswith(".1.0.1.billing")


def test_rounds_up_to_the_resolution_never_down():
    plan = make(resolution_ms=100, max_delay_ms=10**6)
    assert plan.units(0) == 0
    assert plan.units(1) == 1
    assert plan.units(100) == 1
    assert plan.units(101) == 2
    waited, _ = route(plan, 250)
    assert sum(waited) == 300


def test_ttls_never_exceed_rabbitmqs_ten_year_cap():
    for radix in (2, 3, 4, 10, 16, 36, 64):
        plan = make(radix=radix, max_delay_ms=MAX_TTL_MS)
        assert max(q.ttl_ms for q in plan.delay_queues) <= MAX_TTL_MS
        # The whole range is still reachable.
        assert sum(route(plan, MAX_TTL_MS)[0]) == MAX_TTL_MS


def test_ttl_above_the_cap_is_refused():
    with pytest.raises(TopologyError, match="10 years"):
        make(radix=16, max_delay_ms=16 * MAX_TTL_MS)


def test_routing_key_limit_of_255_bytes():
    plan = make(radix=2, max_delay_ms=MAX_TTL_MS, queues=("q" * 100,))
    key = plan.routing_key(MAX_TTL_MS, "q" * 100)
    assert len(key.encode()) <= MAX_ROUTING_KEY_BYTES
    with pytest.raises(TopologyError, match="255"):
        build_plan(
            prefix="p",
            radix=2,
            resolution_ms=1,
            max_delay_ms=MAX_TTL_MS,
            queue_type="classic",
            queues=("q" * 100,),
            levels=80,
        )


def test_quorum_queues_dead_letter_at_least_once():
    plan = make(queue_type="quorum")
    for q in plan.delay_queues:
        assert q.arguments["x-queue-type"] == "quorum"
        assert q.arguments["x-dead-letter-strategy"] == "at-least-once"
        assert q.arguments["x-overflow"] == "reject-publish"
    assert plan.ready_queues["default"].arguments["x-queue-type"] == "quorum"


def test_names_carry_what_defines_the_topology():
    a, b = make(radix=2), make(radix=4)
    assert a.topology_id != b.topology_id
    assert {q.name for q in a.delay_queues}.isdisjoint({q.name for q in b.delay_queues})
    # ... but both feed the same ready queues.
    assert a.ready_queues["default"].name == b.ready_queues["default"].name
    assert make(resolution_ms=10).topology_id == "r2.10ms.L32.classic"


def test_levels_for():
    assert levels_for(1, 2) == 1
    assert levels_for(2, 2) == 2
    assert levels_for(15, 16) == 1
    assert levels_for(16, 16) == 2


def test_widest_plan_sees_queues_added_by_a_larger_max_delay():
    # MAX_DELAY raised from 2 to 3 top-level units without a new level count:
    # inspecting or removing the old topology must look at the added queue too.
    narrow = make(radix=16, max_delay_ms=2 * 16**3)
    wide = make(radix=16, max_delay_ms=3 * 16**3)
    assert narrow.topology_id == wide.topology_id
    widest = widest_plan(
        prefix="p",
        radix=16,
        resolution_ms=1,
        levels=narrow.levels,
        queue_type="classic",
        queues=("default",),
    )
    names = {q.name for q in widest.delay_queues}
    assert {q.name for q in wide.delay_queues} <= names
    assert len(names) == narrow.levels * 15


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_every_queue_names_its_type_and_quorum_ones_their_delivery_limit(queue_type):
    # A vhost's default queue type applies to a queue declared without one.
    plan = build_plan(
        prefix="p",
        radix=16,
        resolution_ms=1,
        max_delay_ms=60_000,
        queue_type=queue_type,
        queues=("default",),
        delivery_limit=7,
    )
    for queue in plan.all_queues:
        expected = "stream" if queue in plan.streams else queue_type
        if queue == plan.up_queue:
            expected = "classic"  # its transient message must not outlive a restart
        assert queue.arguments["x-queue-type"] == expected, queue.name
        limit = queue.arguments.get("x-delivery-limit")
        if queue_type == "classic" or queue in plan.streams or queue == plan.up_queue:
            assert limit is None, queue.name  # classic queues and streams refuse one
        elif queue.name in (plan.ready_queues["default"].name, plan.hold_queues["default"].name):
            assert limit == 7
        else:
            assert limit == NO_DELIVERY_LIMIT, queue.name


def test_the_consumer_timeout_goes_on_the_quorum_ready_and_hold_queues_only():
    plan = build_plan(
        prefix="p",
        radix=16,
        resolution_ms=1,
        max_delay_ms=60_000,
        queue_type="quorum",
        queues=("default", "other"),
        consumer_timeout_ms=5000,
    )
    timed = {q.name for q in plan.all_queues if "x-consumer-timeout" in q.arguments}
    assert timed == {q.name for q in (*plan.ready_queues.values(), *plan.hold_queues.values())}
    assert {q.arguments["x-consumer-timeout"] for q in plan.ready_queues.values()} == {5000}


def test_quorum_delay_queues_under_classic_ready_queues_are_a_topology_of_their_own():
    from deferred.core.topology import build_plan, recorded_plan
    from deferred.operate.permissions import for_role

    common = dict(prefix="app", radix=16, resolution_ms=1, max_delay_ms=60_000, queues=("default",))
    classic = build_plan(queue_type="classic", max_priority=9, **common)
    mixed = build_plan(queue_type="classic", max_priority=9, delay_queue_type="quorum", **common)
    assert classic.topology_id == "r16.1ms.L4.P9.classic"
    assert mixed.topology_id == "r16.1ms.L4.P9.classic.quorum-delays"
    for queue in mixed.delay_queues:
        assert queue.arguments["x-queue-type"] == "quorum"
        assert queue.arguments["x-dead-letter-strategy"] == "at-least-once"
        assert queue.arguments["x-overflow"] == "reject-publish"
    # The queues workers consume stay classic, with their priorities.
    ready = mixed.ready_queues["default"]
    assert ready.arguments["x-queue-type"] == "classic" and ready.arguments["x-max-priority"] == 9
    assert ready.name == classic.ready_queues["default"].name
    # The registry record brings it back as it was; an old record, without the
    # delay queues' type, as the classic topology it was.
    again = recorded_plan(json.loads(mixed.record()), prefix="app", queues=("default",))
    assert again.topology_id == mixed.topology_id and again.delay_type == "quorum"
    old = {k: v for k, v in json.loads(classic.record()).items() if k != "delay_queue_type"}
    assert recorded_plan(old, prefix="app", queues=("default",)).delay_type == "classic"
    # Least-privilege users reach the new names.
    worker = for_role("worker", "app")
    for queue in mixed.delay_queues:
        assert re.match(worker.read, queue.name), queue.name
    assert re.match(for_role("publisher", "app").write, mixed.ingest_exchange)
