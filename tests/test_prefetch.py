"""The worker's cap on unacked jobs across its queues, without a broker: how the
concurrency is split between consumers and roaming slots, and when the roaming
slots look into the queues."""

from __future__ import annotations

import pytest

from deferred.broker.consumer import PROBE_CAP_S, PROBE_FIRST_S, Slots, pinned_prefetch

A, B, C = "ready.a", "ready.b", "ready.c"


class Probe:
    """Stands in for the broker's queue counts: which queues hold jobs, and who asked."""

    def __init__(self, *holding: str) -> None:
        self.holding = set(holding)
        self.asked: list[list[str]] = []

    def __call__(self, queues: list[str]) -> list[str]:
        self.asked.append(list(queues))
        return [q for q in queues if q in self.holding]


def test_one_queue_gets_a_consumer_with_every_slot():
    assert pinned_prefetch(8, [A]) == {A: 8}
    assert pinned_prefetch(1, [A]) == {A: 1}


def test_with_a_slot_for_each_queue_each_gets_a_consumer_of_one_and_the_rest_roam():
    assert pinned_prefetch(2, [A, B]) == {A: 1, B: 1}
    slots = Slots(5, [A, B, C])
    assert slots.pinned == {A: 1, B: 1, C: 1} and slots.roaming == 2


def test_with_fewer_slots_than_queues_every_slot_roams():
    assert pinned_prefetch(1, [A, B]) == {}
    slots = Slots(2, [A, B, C])
    assert slots.pinned == {} and slots.roaming == 2


@pytest.mark.parametrize("limit", range(1, 7))
@pytest.mark.parametrize("queues", range(1, 5))
def test_consumers_and_roaming_slots_add_up_to_the_limit(limit, queues):
    names = [f"q{n}" for n in range(queues)]
    slots = Slots(limit, names)
    assert all(prefetch >= 1 for prefetch in slots.pinned.values())
    assert slots.roaming >= 0
    assert sum(slots.pinned.values()) + slots.roaming == limit


def test_a_roaming_slot_is_taken_until_its_job_is_settled():
    slots = Slots(1, [A, B])
    assert slots.free() == 1
    slots.took(7, A, pinned=False, now=0.0)
    assert slots.free() == 0
    slots.settled(7)
    assert slots.free() == 1


def test_pushed_jobs_take_no_roaming_slot_and_a_full_consumer_leaves_its_queue_unseen():
    slots = Slots(3, [A, B])  # a consumer of 1 each, one roaming slot
    assert slots.unseen() == []
    slots.took(1, A, pinned=True, now=0.0)
    assert slots.free() == 1
    # A's consumer has no room: a job arriving in A is nobody's until someone looks.
    assert slots.unseen() == [A]
    slots.settled(1)
    assert slots.unseen() == []


def test_queues_with_jobs_take_turns():
    # Given two queues holding jobs and one roaming slot
    slots = Slots(1, [A, B])
    probe = Probe(A, B)
    assert slots.next_queue(0.0, probe) == A
    # When A's job is taken and settled, B is next, then A again
    slots.took(1, A, pinned=False, now=0.0)
    slots.settled(1)
    assert slots.next_queue(0.0, probe) == B
    slots.took(2, B, pinned=False, now=0.0)
    slots.settled(2)
    assert slots.next_queue(0.0, probe) == A
    # Then only one look was needed: the turns came from the jobs taken
    assert probe.asked == [[A, B]]


def test_a_queue_found_empty_loses_its_turn():
    slots = Slots(1, [A, B])
    assert slots.next_queue(0.0, Probe(A, B)) == A
    slots.empty(A)  # another worker was quicker
    assert slots.next_queue(0.0, Probe()) == B


def test_the_wait_between_looks_doubles_up_to_the_cap_and_a_job_taken_resets_it():
    slots = Slots(1, [A, B])
    probe = Probe()
    now, waits = 0.0, []
    for _ in range(10):
        assert slots.next_queue(now, probe) is None
        wait = slots.wait(10.0, now)
        # No look before the wait is over.
        assert slots.next_queue(now + wait / 2, probe) is None
        waits.append(wait)
        now += wait
    assert waits[0] == pytest.approx(PROBE_FIRST_S)
    assert waits[1] == pytest.approx(2 * PROBE_FIRST_S)
    assert max(waits) == pytest.approx(PROBE_CAP_S) and waits[-1] == pytest.approx(PROBE_CAP_S)
    assert len(probe.asked) == 10

    # A job taken (here, pushed while it waited): the next look is at once.
    slots.took(1, B, pinned=False, now=now)
    slots.settled(1)
    slots.empty(B)
    assert slots.wait(10.0, now) == 0.0
    assert slots.next_queue(now, Probe(A)) == A


def test_counts_the_gets_cannot_match_never_make_a_busy_loop():
    # The probe says A holds jobs, but every get comes back empty.
    slots = Slots(1, [A, B])
    probe = Probe(A)
    assert slots.next_queue(0.0, probe) == A
    slots.empty(A)
    assert slots.next_queue(0.0, probe) is None
    assert slots.wait(10.0, 0.0) > 0


def test_a_worker_with_a_consumer_on_each_queue_never_looks_while_they_have_room():
    slots = Slots(4, [A, B])
    probe = Probe(A, B)
    assert slots.next_queue(0.0, probe) is None
    assert probe.asked == []
    assert slots.wait(0.2, 0.0) == 0.2


def test_a_full_consumer_rings_for_the_roaming_slots_at_once():
    # Given a consumer of 1 on each queue and two roaming slots, idle
    slots = Slots(4, [A, B])
    slots.next_queue(0.0, Probe())
    # When A's consumer is handed a job (so A had one, and may have more)
    slots.took(1, A, pinned=True, now=5.0)
    # Then the roaming slots try A first, with no probe and no wait
    probe = Probe()
    assert slots.next_queue(5.0, probe) == A
    assert probe.asked == []


def test_only_unseen_queues_are_looked_into():
    slots = Slots(3, [A, B])
    slots.took(1, B, pinned=True, now=0.0)
    slots.empty(B)
    probe = Probe()
    slots.next_queue(1.0, probe)
    assert probe.asked == [[B]]


def test_with_no_free_slot_there_is_nothing_to_wait_for():
    slots = Slots(1, [A, B])
    slots.took(1, A, pinned=False, now=0.0)
    assert slots.wait(0.2, 0.0) == 0.2
