"""The ledger's pure logic: when a job moved between queues, and which jobs a restart
window puts at risk. No broker."""

from __future__ import annotations

import pytest

from deferred.core import ledger
from deferred.core.ledger import Entry, Shape, at_risk, hop_times, latest, shape_of, to_carry
from deferred.core.topology import build_plan

DAY_MS = 24 * 3600 * 1000


def plan(hold_window_ms: int = 0):
    return build_plan(
        prefix="p",
        radix=16,
        resolution_ms=1,
        max_delay_ms=365 * DAY_MS,
        queue_type="classic",
        queues=("default",),
        hold_window_ms=hold_window_ms,
    )


def entry(p, delay_ms: int, published_ms: int = 1_000_000, job_id: str = "a", **kw) -> Entry:
    fields = {
        "job_id": job_id,
        "due_ms": published_ms + delay_ms,
        "routing_key": p.routing_key(delay_ms, "default"),
        "exchange": p.ingest_exchange,
        "body": b"{}",
        "headers": {},
        "priority": None,
        "written_ms": published_ms,
        "offset": 0,
    }
    fields.update(kw)
    return Entry(**fields)


def test_the_shape_is_read_from_the_ingest_exchange_name():
    p = plan(hold_window_ms=1000)
    assert shape_of(p.ingest_exchange) == Shape(16, 1, p.levels, p.hold_levels)
    assert shape_of(plan().ingest_exchange) == Shape(16, 1, plan().levels, 0)
    assert shape_of("p.failed") is None
    assert shape_of("p.delay.r16.1ms.L9.P9.classic.quorum-delays.ingest") == Shape(
        16, 1, 9, 0, quorum_delays=True
    )
    assert shape_of("p.delay.r16.1ms.L9.H2.quorum.ingest") == Shape(16, 1, 9, 2, True)
    assert shape_of("p.delay.r16.1ms.L9.H2.classic.ingest") == Shape(16, 1, 9, 2, False)


@pytest.mark.parametrize("delay_ms", [1, 15, 16, 4095, 70_000, 3 * DAY_MS + 17])
def test_hops_are_at_the_sums_of_the_ttls_and_the_last_at_the_due_time(delay_ms):
    p = plan()
    published = 5_000_000
    hops = hop_times(
        shape_of(p.ingest_exchange), p.routing_key(delay_ms, "default"), published + delay_ms
    )
    # One hop per delay queue visited, the exits of each, highest level first.
    assert len(hops) == p.hops(delay_ms)
    ttls = [
        int(w) * 16 ** (p.levels - 1 - i)
        for i, w in enumerate(p.routing_key(delay_ms, "default").split(".")[:-1])
        if w != "0"
    ]
    expected, t = [], published
    for ttl in ttls:
        t += ttl
        expected.append((t, t))
    assert hops == expected
    assert hops[-1] == (published + delay_ms, published + delay_ms)


def test_a_job_for_the_hold_queue_leaves_its_last_queue_up_to_a_window_early():
    p = plan(hold_window_ms=1000)
    shape = shape_of(p.ingest_exchange)
    assert shape is not None and shape.window_ms == 256
    key = p.routing_key(70_000, "default")  # 70,000 = 0x11170: held digits not zero
    assert key.split(".")[-2] == "1"
    hops = hop_times(shape, key, 1_070_000)
    lo, hi = hops[-1]
    assert hi == 1_070_000 and lo == 1_070_000 - 256
    # Due at once: no hop at all.
    assert hop_times(shape, p.routing_key(0, "default"), 5) == []


def test_a_routing_key_of_another_shape_is_refused():
    with pytest.raises(ValueError):
        hop_times(Shape(16, 1, 9, 0), "1.2.default", 0)


def test_a_job_is_at_risk_only_if_a_hop_falls_in_the_window():
    p = plan()
    e = entry(p, 0x12000, published_ms=0)  # hops at 0x10000 (65,536) and 0x12000 (73,728)
    assert at_risk(e, 65_000, 66_000)
    assert at_risk(e, 73_000, 74_000)
    assert not at_risk(e, 71_000, 72_000)
    assert not at_risk(e, 80_000 + ledger.LATE_HOP_MS, 90_000)
    assert not at_risk(e, 0, 60_000)
    # A hop may be late under load: one just before the window counts.
    assert at_risk(e, 65_536 + ledger.LATE_HOP_MS, 70_000)
    assert not at_risk(e, 65_537 + ledger.LATE_HOP_MS, 70_000)


def test_a_job_in_quorum_delay_queues_is_never_at_risk():
    for queue_type, delay_type in (("quorum", None), ("classic", "quorum")):
        p = build_plan(
            prefix="p",
            radix=16,
            resolution_ms=1,
            max_delay_ms=DAY_MS,
            queue_type=queue_type,
            queues=("default",),
            delay_queue_type=delay_type,
        )
        e = entry(p, 0x12000, published_ms=0)
        assert not at_risk(e, 65_000, 66_000)
    assert at_risk(entry(plan(), 0x12000, published_ms=0), 65_000, 66_000)


def test_a_record_of_an_unknown_topology_is_at_risk_if_due_after_the_window_began():
    p = plan()
    e = entry(p, 50_000, published_ms=0, exchange="elsewhere")
    assert at_risk(e, 10_000, 11_000)
    assert not at_risk(e, 60_000, 61_000)
    bad = entry(p, 50_000, published_ms=0, routing_key="x.default")
    assert at_risk(bad, 10_000, 11_000)


def test_the_newest_record_of_a_job_wins():
    p = plan()
    first = entry(p, 10_000, offset=1)
    retry = entry(p, 20_000, offset=5)
    other = entry(p, 30_000, job_id="b", offset=3)
    assert latest([first, other, retry]) == {"a": retry, "b": other}
    assert list(latest([first, other, retry])) == ["b", "a"]


def test_to_repair_takes_the_newest_records_in_the_window_soonest_first():
    p = plan()
    old = entry(p, 65_536, published_ms=0, job_id="a")  # its hop at 65,536
    moved = entry(p, 200_000, published_ms=100_000, job_id="a")  # a retry, hops later
    b = entry(p, 65_536, published_ms=1, job_id="b")
    c = entry(p, 65_536, published_ms=2, job_id="c")
    assert [e.job_id for e in ledger.to_repair([old, c, b, moved], 60_000, 70_000)] == ["b", "c"]


def test_records_older_than_half_the_retention_of_pending_jobs_are_carried():
    p = plan()
    keep = 7 * DAY_MS
    now = 10 * DAY_MS
    pending_old = entry(p, 30 * DAY_MS, published_ms=now - 4 * DAY_MS, job_id="old")
    pending_new = entry(p, 30 * DAY_MS, published_ms=now - 2 * DAY_MS, job_id="new")
    done_old = entry(p, 3 * DAY_MS, published_ms=now - 4 * DAY_MS, job_id="done")
    carried = entry(p, 30 * DAY_MS, published_ms=now - 6 * DAY_MS, job_id="carried")
    again = Entry(**{**carried.__dict__, "written_ms": now - DAY_MS, "offset": 9})
    found = {
        e.job_id for e in to_carry([pending_old, pending_new, done_old, carried, again], now, keep)
    }
    assert found == {"old"}


def test_a_window_starts_at_the_last_marker_or_the_oldest_unsettled_repair():
    M = ledger.Marker
    assert ledger.window_start([M(5_000), M(9_000), M(12_000)], 10_000, 1_000) == 8_000
    # A marker written while a repair was not finished: from that repair's start.
    assert ledger.window_start([M(5_000), M(9_000, 3_000)], 10_000, 1_000) == 2_000
    # Only the newest counts: that repair was finished when the next marker was written.
    assert ledger.window_start([M(5_000, 3_000), M(9_000)], 10_000, 1_000) == 8_000
    assert ledger.window_start([M(12_000)], 10_000, 1_000) == 0
    assert ledger.window_start([], 10_000, 1_000) == 0


def test_a_job_is_lost_once_the_jobs_due_after_it_have_started():
    later = [(10_000 + 3_000 + i * 1_000, True) for i in range(8)]
    # They started, it did not: passed by, gone.
    assert ledger.overtaken(10_000, later) is True
    # They have not started either: a backlog holds them all up.
    assert ledger.overtaken(10_000, [(d, False) for d, _ in later]) is False
    # Mostly not: still a backlog.
    half = [(d, i % 2 == 0) for i, (d, _) in enumerate(later)]
    assert ledger.overtaken(10_000, half) is False
    # Too few after it to tell, or only jobs due right after it (within after_ms) or
    # long after: nothing to tell by.
    assert ledger.overtaken(10_000, later[:4]) is None
    assert ledger.overtaken(10_000, [(10_500, True)] * 10 + [(40_000, True)] * 10) is None


def test_a_job_due_at_once_makes_no_hop():
    from deferred.core.ledger import Shape, makes_no_hop

    held = Shape(radix=16, resolution_ms=1, levels=4, hold_levels=2)
    assert makes_no_hop(held, "0.0.0.default")  # to the ready queue
    assert makes_no_hop(held, "0.0.1.default")  # to the hold queue
    assert not makes_no_hop(held, "0.3.0.default")
    assert not makes_no_hop(held, "1.0.1.default")
    plain = Shape(radix=16, resolution_ms=1, levels=3, hold_levels=0)
    assert makes_no_hop(plain, "0.0.0.default")
    assert not makes_no_hop(plain, "0.0.7.default")
