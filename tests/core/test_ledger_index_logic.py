"""The job ledger without a broker: rows, pages, heads, the fold of a checkpoint with
the ledger's tail and the other streams, and moves in the cancels' view."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from deferred.core.jobs import Job, due_ms_of, new_job_id
from deferred.core.ledger_index import (
    ROWS_PER_PAGE,
    AwayRef,
    Head,
    PageRef,
    Waiting,
    away_rows,
    decode_page,
    encode_page,
    find_in_page,
    fold,
    newest,
    paginate,
    waiting_of,
)
from deferred.core.moves import MoveView, new_gen
from deferred.core.pending_jobs import PREVIEW_BYTES, Filter, Starts
from deferred.records.cancels import CancelView, decode_record

AT = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NOW_MS = int(AT.timestamp() * 1000)


def job(seconds: float, *, task: str = "app.send", **changes) -> Job:
    due = AT + timedelta(seconds=seconds)
    made = Job(
        id=new_job_id(due, now=AT),
        task=task,
        args=(7, "x"),
        kwargs={"k": 1},
        due=due,
        queue="default",
        created=AT,
    )
    return replace(made, **changes)


def row(seconds: float, offset: int = 0, **changes) -> Waiting:
    return waiting_of(job(seconds, **changes), offset, results=True)


def test_a_row_keeps_what_a_listing_shows_and_round_trips():
    j = job(30, priority=5, key="cart:7")
    r = waiting_of(j, 42, results=True)
    assert Waiting.from_wire(r.wire()) == r
    shown = r.public()
    assert shown.id == j.id and shown.due == j.due and shown.enqueued == AT
    assert shown.args == [7, "x"] and shown.kwargs == {"k": 1} and not shown.truncated
    assert shown.priority == 5 and shown.key == "cart:7" and r.offset == 42
    as_json = shown.as_dict()
    assert as_json["due"] == j.due.isoformat() and as_json["args_preview"] == '[[7,"x"],{"k":1}]'


def test_big_arguments_are_a_preview_only():
    r = waiting_of(job(1, args=("y" * 5000,)), 0, results=True)
    assert r.args is None and r.kwargs is None
    assert len(r.preview.encode()) <= PREVIEW_BYTES + 3 and r.preview.endswith("…")
    assert r.public().truncated


def test_pages_and_heads_round_trip_and_refuse_anything_else():
    rows = [row(n, offset=n) for n in range(5)]
    body = encode_page("tok", 3, rows)
    assert decode_page(body) == ("tok", 3, rows)
    assert find_in_page(body, rows[2].id) == ("tok", rows[2])
    assert find_in_page(body, new_job_id(AT)) == ("tok", None)
    head = Head("tok", NOW_MS, 99, (PageRef(10, 1, 2, 5), PageRef(11, 3, 9, 4)))
    assert Head.decode(head.encode()) == head and head.rows == 9
    away = replace(head, away=(AwayRef(12, "0a", "0f", 3),))
    assert Head.decode(away.encode()) == away and away.rows == 9
    # A head written before away pages existed reads as one without them.
    older = b'{"v":1,"token":"tok","made":1,"ledger":99,"pages":[[10,1,2,5]]}'
    assert Head.decode(older).away == ()
    for bad in (b"", b"{}", b'{"v":2}', b"not json"):
        with pytest.raises(ValueError):
            Head.decode(bad)
        with pytest.raises(ValueError):
            decode_page(bad)


def test_pages_cover_the_window_they_may_hold():
    head = Head(
        "t",
        0,
        0,
        (PageRef(1, 100, 200, 9), PageRef(2, 200, 300, 9), PageRef(3, 300, 400, 9)),
    )
    assert head.pages_from(None, None) == [0, 1, 2]
    assert head.pages_from(250, None) == [1, 2]
    assert head.pages_from(200, None) == [0, 1, 2]  # rows due at 200 may be on page 0
    assert head.pages_from(None, 200) == [0]
    assert head.pages_from(401, None) == []


def test_a_look_up_reads_the_two_pages_of_its_first_due_time_or_the_away_page_of_its_id():
    head = Head(
        "t",
        0,
        0,
        (PageRef(1, 100, 200, 9), PageRef(2, 200, 300, 9), PageRef(3, 300, 400, 9)),
        (AwayRef(4, "10", "3f", 9), AwayRef(5, "40", "7f", 9)),
    )
    assert head.pages_of(200) == [0, 1]
    assert head.pages_of(250) == [1, 2]
    assert head.pages_of(400) == [2]
    assert head.pages_of(401) == [] and head.pages_of(None) == []
    assert head.away_page("10") == 0 and head.away_page("2a") == 0 and head.away_page("3f") == 0
    assert head.away_page("40") == 1 and head.away_page("7f") == 1
    assert head.away_page("0f") is None and head.away_page("3f0") is None
    assert head.away_page("80") is None


def test_rows_a_look_up_by_due_time_misses_are_away():
    retried = row(1)
    retried = replace(retried, due_ms=retried.due_ms + 60_000, attempt=1)
    crowd = [row(30) for _ in range(5)]
    crowd = [replace(r, due_ms=crowd[0].due_ms) for r in crowd]  # due at one millisecond
    home = [row(2), row(3), *crowd, row(40), retried]
    pages = [home[i : i + 2] for i in range(0, len(home), 2)]
    first_due_of = {r.id: due_ms_of(r.id) for r in home}
    away = away_rows(pages, first_due_of.get)
    # Pages [2, 3] [c0, c1] [c2, c3] [c4, 40] [retry]: the retry, due a minute after its
    # id says, and the crowd's row past the two pages of its due time.
    assert away == sorted([retried, crowd[4]], key=lambda r: r.id)
    head = Head(
        "t",
        0,
        0,
        tuple(PageRef(n, p[0].due_ms, p[-1].due_ms, len(p)) for n, p in enumerate(pages)),
    )
    for index, page in enumerate(pages):
        for r in page:
            assert (r in away) == (index not in head.pages_of(due_ms_of(r.id))), r
    # An id without a due time is found by its id only.
    assert away_rows([[row(5)]], lambda _id: None) != []


def test_paginate_cuts_sorted_rows():
    rows = [row(n) for n in range(ROWS_PER_PAGE * 2 + 1)]
    pages = paginate(rows)
    assert [len(p) for p in pages] == [ROWS_PER_PAGE, ROWS_PER_PAGE, 1]
    assert [r for p in pages for r in p] == rows


def fold_all(
    base, tail, *, starts=None, gone=(), stale=lambda _id, _gen, _attempt: False, now_ms=NOW_MS
):
    return list(
        fold(
            base,
            newest(tail, stale),
            starts=starts or Starts(),
            gone=lambda job_id: job_id in gone,
            stale=stale,
            now_ms=now_ms,
        )
    )


def test_the_fold_merges_a_checkpoint_with_the_tail_soonest_first():
    a, b, c = row(10), row(20), row(30)
    d = row(15)
    assert fold_all([a, b, c], [d]) == [a, d, b, c]


def test_a_newer_record_replaces_the_checkpoints_row():
    a = row(10)
    retry = replace(a, due_ms=a.due_ms + 50_000, attempt=2, offset=9)
    assert fold_all([a, row(20)], [retry])[-1] == retry
    assert a not in fold_all([a], [retry])


def test_started_cancelled_and_superseded_jobs_leave():
    a, b, c = row(-5), row(-4), row(60)
    starts = Starts()
    starts.add({"id": a.id, "ev": "started", "a": 1})
    assert fold_all([a, b, c], [], starts=starts, gone={c.id}) == [b]


def test_a_retry_waits_while_only_its_earlier_attempt_started():
    a = row(-5)
    retry = replace(a, attempt=2, due_ms=a.due_ms + 1000)
    starts = Starts()
    starts.add({"id": a.id, "ev": "retrying", "a": 1})
    assert fold_all([], [retry], starts=starts) == [retry]
    starts.add({"id": a.id, "ev": "started", "a": 2})
    assert fold_all([], [retry], starts=starts) == []


def test_a_redriven_run_is_not_the_first_run():
    a = row(-5)
    starts = Starts()
    starts.add({"id": a.id, "ev": "failed", "a": 3})
    redriven = replace(a, run=a.due_ms + 9000)
    assert fold_all([], [redriven], starts=starts) == [redriven]


def test_a_job_without_results_is_listed_until_it_is_due():
    late, soon = row(-1), row(1)
    late, soon = replace(late, results=False), replace(soon, results=False)
    assert fold_all([late, soon], []) == [soon]


def test_of_a_moved_job_only_the_latest_moves_copy_is_listed():
    gen = new_gen()
    old = row(60)
    moved = replace(old, due_ms=old.due_ms - 55_000, gen=gen, offset=5)
    stale = lambda job_id, g, _attempt: job_id == old.id and g != gen  # noqa: E731
    assert fold_all([old], [moved], stale=stale) == [moved]
    # A carried copy of the old record after the move does not bring it back.
    assert fold_all([], [moved, old], stale=stale) == [moved]


def test_the_move_view_keeps_the_latest_generation_until_it_is_due():
    view = MoveView(margin_s=60)
    job_id = new_job_id(AT)
    now = AT.timestamp()
    view.add(job_id, "g1", now + 10, now)
    view.add(job_id, "g2", now + 20, now)
    assert view.gen(job_id) == "g2" and view.due(job_id) == now + 20
    assert view.is_stale(job_id, "g1") and view.is_stale(job_id, None)
    assert not view.is_stale(job_id, "g2") and not view.is_stale(new_job_id(AT), None)
    assert view.sweep(now + 79) == 0 and view.sweep(now + 81) == 1 and len(view) == 0


def test_a_cancel_before_a_move_holds_until_the_moved_copy_is_due():
    j = job(10)
    view = CancelView(margin_s=60)
    now = AT.timestamp()
    view.add([j.id], AT, now)
    moved = replace(j, due=AT + timedelta(hours=5), first_due_at=j.due, gen="g")
    view.apply(decode_record(moved.encode()), now)
    assert view.sweep(now + 3600) == 0 and j.id in view  # past the first due + margin
    assert view.sweep(now + 5 * 3600 + 61) >= 1 and j.id not in view


def test_a_cancel_after_a_move_holds_until_the_moved_copy_is_due():
    j = job(10)
    view = CancelView(margin_s=60)
    now = AT.timestamp()
    moved = replace(j, due=AT + timedelta(hours=5), first_due_at=j.due, gen="g")
    view.apply(decode_record(moved.encode()), now)
    view.add([j.id], AT, now)
    view.sweep(now + 3600)
    assert j.id in view


def test_filters_select_rows():
    r = row(30, priority=1, key="k")
    assert r.matches(Filter(task="app.send", queue="default", key="k"))
    assert not r.matches(Filter(task="other"))
    assert r.matches(Filter(due_after=AT + timedelta(seconds=30)))
    assert not r.matches(Filter(due_before=AT + timedelta(seconds=30)))


def test_a_move_is_kept_as_long_as_the_copy_it_replaced_waits():
    view = MoveView(margin_s=60)
    job_id = new_job_id(AT + timedelta(days=10))
    now = AT.timestamp()
    # Run now a job due in ten days: its old copy comes due then, and must be dropped.
    view.add(job_id, "g", now, now, old_due_s=now + 10 * 86400)
    assert view.sweep(now + 9 * 86400) == 0 and view.is_stale(job_id, None)
    assert view.sweep(now + 10 * 86400 + 61) == 1
    # A later move keeps what the earlier one had to keep.
    view.add(job_id, "g1", now, now, old_due_s=now + 86400)
    view.add(job_id, "g2", now + 5, now, old_due_s=now + 60)
    assert view.until(job_id) == now + 86400 + 60 and view.gen(job_id) == "g2"


def test_the_retry_of_an_old_copy_that_started_before_the_move_runs():
    view = MoveView(margin_s=60)
    job_id = new_job_id(AT)
    now = AT.timestamp()
    view.add(job_id, "g", now + 5, now, attempt=1)
    assert view.is_stale(job_id, None, 1)
    assert not view.is_stale(job_id, None, 2)  # its moved copy was a duplicate of attempt 1
