"""The worker's cap on unacked jobs across its queues, without a broker: how the
concurrency is split between consumers and roaming slots, and when the roaming
slots look into the queues."""

from __future__ import annotations

import pytest

from deferred.broker.consumer import (
    LEND_PROBE_CAP_S,
    PROBE_CAP_S,
    PROBE_FIRST_S,
    Slots,
    pinned_prefetch,
)

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


def test_a_busy_queue_borrows_the_slot_an_idle_queues_consumer_keeps():
    # Given concurrency 2 over two queues: a consumer of 1 on each, no roaming slot
    slots = Slots(2, [A, B])
    assert slots.free() == 0 and slots.to_release(0.0, Probe(A)) is None
    # When A's consumer is pushed a job, and A holds more
    slots.took(1, A, pinned=True, now=0.0)
    # Then B's idle consumer is to be cancelled, and its slot roams to A
    assert slots.to_release(0.0, Probe(A)) == B
    slots.released(B)
    assert slots.free() == 1 and slots.next_queue(0.0, Probe()) == A
    slots.took(2, A, pinned=False, now=0.0)
    # And with both slots running A's jobs, nothing more is taken or released
    assert slots.free() == 0 and slots.to_release(0.0, Probe(A)) is None


def test_a_lone_job_costs_one_look_and_no_cancel():
    slots = Slots(2, [A, B])
    slots.took(1, A, pinned=True, now=0.0)
    probe = Probe()  # A holds nothing more
    assert slots.to_release(0.0, probe) is None and probe.asked == [[A, B]]
    # A lost its turn: looked into again only once the wait between looks is over
    assert slots.to_release(0.0, probe) is None and probe.asked == [[A, B]]
    wait = slots.wait(10.0, 0.0)
    assert 0 < wait <= PROBE_CAP_S
    assert slots.to_release(wait, probe) is None and probe.asked == [[A, B], [A, B]]


def test_a_long_job_behind_a_full_consumer_costs_fewer_and_fewer_looks():
    # Given concurrency 2 over two queues, A's consumer running a long job, B idle
    slots = Slots(2, [A, B])
    slots.took(1, A, pinned=True, now=0.0)
    probe, now, waits = Probe(), 0.0, []
    for _ in range(12):
        slots.to_release(now, probe)
        wait = slots.wait(10.0, now)
        waits.append(wait)
        now += wait
    # Then the looks slow down to LEND_PROBE_CAP_S, not every 50 ms for as long as it runs
    assert waits[-1] == pytest.approx(LEND_PROBE_CAP_S)
    assert len(probe.asked) <= 12


def test_an_idle_queue_with_a_job_on_its_way_keeps_its_consumer():
    slots = Slots(2, [A, B])
    slots.took(1, A, pinned=True, now=0.0)
    # A holds more, but so does B: B's consumer is about to be pushed one, keep it
    assert slots.to_release(0.0, Probe(A, B)) is None
    assert B in slots.consuming


def test_jobs_that_arrive_behind_a_busy_consumer_borrow_an_idle_queues_slot():
    # Given concurrency 2 over two queues, A's consumer busy with a lone job
    slots = Slots(2, [A, B])
    slots.took(1, A, pinned=True, now=0.0)
    assert slots.to_release(0.0, Probe()) is None
    # When more jobs arrive in A, unseen (its consumer has no room)
    wait = slots.wait(10.0, 0.0)
    # Then the next look finds them, and B's idle consumer lends its slot
    assert slots.to_release(wait, Probe(A)) == B


def test_a_lent_consumer_comes_back_once_no_queue_is_known_to_hold_jobs():
    slots = Slots(2, [A, B])
    slots.took(1, A, pinned=True, now=0.0)
    slots.released(B)
    slots.took(2, A, pinned=False, now=0.0)
    slots.settled(2)
    # A may still hold jobs: the free slot keeps roaming there
    assert slots.to_restore() is None
    slots.empty(A)
    assert slots.to_restore() == B
    slots.restored(B)
    assert slots.free() == 0 and slots.to_restore() is None


def test_a_consumer_holding_a_job_is_never_released():
    slots = Slots(2, [A, B])
    slots.took(1, A, pinned=True, now=0.0)
    slots.took(2, B, pinned=True, now=0.0)
    assert slots.to_release(0.0, Probe(A, B)) is None


def test_queues_without_a_consumer_are_looked_into_while_a_busy_one_is_served():
    # Given one slot roaming over two queues, A known to hold jobs
    slots = Slots(1, [A, B])
    probe = Probe(A)
    assert slots.next_queue(0.0, probe) == A
    slots.took(1, A, pinned=False, now=0.0)
    slots.settled(1)
    # When B gets a job: it is looked into every PROBE_CAP_S, not only once A is drained
    probe.holding.add(B)
    assert slots.next_queue(PROBE_CAP_S / 2, probe) == A
    assert slots.next_queue(PROBE_CAP_S, probe) == B


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("limit, queues", [(2, 2), (3, 2), (4, 4), (4, 3), (2, 3), (1, 1), (5, 1)])
def test_never_more_jobs_held_than_the_limit(seed, limit, queues):
    """Random pushes (only to a consumer with room, as RabbitMQ does), gets, settles,
    releases and restores, in the order the I/O thread makes them."""
    import random

    rng = random.Random(seed)
    names = [f"q{n}" for n in range(queues)]
    slots = Slots(limit, names)
    held: set[int] = set()
    tag = 0
    for step in range(300):
        now = step * 0.01
        if held and rng.random() < 0.3:
            done = rng.choice(sorted(held))
            held.discard(done)
            slots.settled(done)
        pushable = [q for q in names if slots.room(q)]
        if pushable and rng.random() < 0.4:
            tag += 1
            held.add(tag)
            slots.took(tag, rng.choice(pushable), pinned=True, now=now)
        while True:  # Consumer._roam
            if not slots.free():
                idle = slots.to_release(now, lambda qs: [q for q in qs if rng.random() < 0.7])
                if idle is None:
                    break
                slots.released(idle)
                continue
            queue = slots.next_queue(now, lambda qs: [q for q in qs if rng.random() < 0.5])
            if queue is None:
                break
            if rng.random() < 0.2:
                slots.empty(queue)
            else:
                tag += 1
                held.add(tag)
                slots.took(tag, queue, pinned=False, now=now)
        while (queue := slots.to_restore()) is not None:
            slots.restored(queue)
        reserved = sum(slots.room(q) for q in names)
        assert len(held) + reserved <= limit, (step, held, reserved)
        assert slots.free() >= 0
