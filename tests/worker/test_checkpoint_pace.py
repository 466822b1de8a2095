"""The pace of a checkpoint's reads, without a broker."""

from __future__ import annotations

import time

from deferred.core.ledger_index import Head
from deferred.worker.checkpointing import READ_PER_S, Pace, read_rate


def test_the_pace_keeps_calls_to_their_rate_on_average():
    pace = Pace(10_000)
    started = time.monotonic()
    for _ in range(3_000):
        pace()
    took = time.monotonic() - started
    # 3,000 calls at 10,000 a second: never sooner than 0.3 s.
    assert took >= 0.3 - 1e-3 and pace.slept > 0.2


def test_a_reader_slower_than_the_rate_never_sleeps():
    pace = Pace(1_000_000)
    for _ in range(Pace.EVERY * 3):
        pace()
    assert pace.slept < 0.01


def test_the_next_checkpoint_reads_twice_as_fast_as_the_ledger_grew():
    before = Head("a", 0, 1_000, ())
    last = Head("b", 60_000, 1_000 + 300_000, ())  # 5,000 records a second
    assert read_rate(before, last) == 10_000
    # Slower than the floor, or nothing to go by: the floor.
    assert read_rate(before, Head("b", 60_000, 2_000, ())) == READ_PER_S
    assert read_rate(None, last) == READ_PER_S and read_rate(last, before) == READ_PER_S
