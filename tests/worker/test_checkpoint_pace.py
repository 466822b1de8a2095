"""The pace of a checkpoint's reads, without a broker."""

from __future__ import annotations

import pytest

from deferred.core.ledger_index import Head
from deferred.worker.checkpointing import READ_PER_S, Pace, read_rate


class Clock:
    """Time that passes only when told to (each call read, each sleep)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_fast_reader_is_held_to_the_rate():
    clock = Clock()
    pace = Pace(1_000, clock=clock, sleep=clock.sleep)
    for _ in range(Pace.EVERY * 4):
        pace()  # no time passes: reading is free here
    # Four batches of 50 at 1,000 a second: 0.2 s, slept a batch at a time.
    assert clock.now - 100.0 == pytest.approx(0.2, rel=1e-3)
    assert len(clock.sleeps) == 4 and pace.slept == pytest.approx(0.2, rel=1e-3)


def test_a_reader_slower_than_the_rate_never_sleeps_and_saves_nothing_up():
    clock = Clock()
    pace = Pace(1_000, clock=clock, sleep=clock.sleep)
    for _ in range(Pace.EVERY * 3):
        clock.now += 0.002  # 500 a second
        pace()
    assert clock.sleeps == []
    # Ten seconds away from reading (a connection, the fold): no burst after it.
    clock.now += 10
    for _ in range(Pace.EVERY * 3):
        pace()
    # The first batch after it starts at once; the next two keep to the rate (which
    # has grown a little in those ten seconds).
    assert sum(clock.sleeps) == pytest.approx(2 * Pace.EVERY / pace.rate(clock.now), rel=0.01)


def test_the_rate_doubles_as_a_read_goes_on():
    clock = Clock()
    pace = Pace(1_000, clock=clock, sleep=clock.sleep)
    assert pace.rate(clock.now) == 1_000
    assert pace.rate(clock.now + Pace.DOUBLE_EVERY_S) == 2_000
    assert pace.rate(clock.now + 5 * Pace.DOUBLE_EVERY_S) == 32_000


def test_the_next_checkpoint_reads_twice_as_fast_as_the_ledger_grew():
    before = Head("a", 0, 1_000, ())
    last = Head("b", 60_000, 1_000 + 300_000, ())  # 5,000 records a second
    assert read_rate(before, last) == 10_000
    # Slower than the floor, or nothing to go by: the floor.
    assert read_rate(before, Head("b", 60_000, 2_000, ())) == READ_PER_S
    assert read_rate(None, last) == READ_PER_S and read_rate(last, before) == READ_PER_S
