"""Cancels without a broker: job ids, records, how long a cancel is kept, the test modes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from deferred import cancel, defer
from deferred.conf import _build
from deferred.core.jobs import due_of, id_with_due, new_job_id
from deferred.core.topology import build_plan
from deferred.records.cancels import (
    CancelView,
    decode,
    encode,
    encode_marker,
    expires,
    marker_of,
)
from deferred.testing import capture, eager
from tests.testapp.tasks import chain, record

DAY = 86400.0
AT = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def test_a_job_id_is_a_uuid8_whose_first_bits_are_the_due_time():
    due = AT + timedelta(hours=5, milliseconds=123.9)
    job_id = new_job_id(due, now=AT)
    assert len(job_id) == 32 and uuid.UUID(job_id).version == 8
    assert uuid.UUID(job_id).variant == uuid.RFC_4122
    assert due_of(job_id) == AT + timedelta(hours=5, milliseconds=123)  # rounded down
    assert new_job_id(due, now=AT) != job_id  # 54 random bits


def test_ids_made_before_the_delay_was_carried_still_say_their_due_time():
    """Version 7 ids (jobs deferred by an earlier release, a schedule's runs)."""
    old = f"{int(AT.timestamp() * 1000):012x}7abc{0b10 << 2 | 1:x}{'0' * 15}"
    assert uuid.UUID(old).version == 7
    assert due_of(old) == AT


def test_ids_sort_by_due_time():
    ids = [new_job_id(AT + timedelta(seconds=n)) for n in (30, 10, 20)]
    assert [due_of(i) for i in sorted(ids)] == sorted(due_of(i) for i in ids)


def test_a_deterministic_id_carries_its_due_time_too():
    assert id_with_due(AT, b"x") == id_with_due(AT, b"x") != id_with_due(AT, b"y")
    assert due_of(id_with_due(AT, b"x")) == AT


#: Fixed values, so that every pytest-xdist process collects the same tests.
@pytest.mark.parametrize(
    "other",
    [
        "041998cc77e94beab10be3a401fcd0f9",
        "x" * 32,
        "",
        "job-1",
        "98d5f1be-9c81-4ebc-8167-9f4274dba99e",
    ],
)
def test_strings_that_are_not_our_ids_carry_no_due_time(other):
    assert due_of(other) is None


def test_a_cancel_before_the_due_time_is_kept_until_due_plus_the_margin():
    job_id = new_job_id(AT + timedelta(days=3))
    assert expires(job_id, AT, DAY) == (AT + timedelta(days=4)).timestamp()


def test_a_cancel_after_the_due_time_is_kept_for_the_margin_from_the_cancel():
    # The job may be running or waiting for a retry.
    job_id = new_job_id(AT - timedelta(days=3))
    assert expires(job_id, AT, DAY) == (AT + timedelta(days=1)).timestamp()


def test_an_id_that_names_no_job_is_kept_for_the_margin():
    assert expires("nobody", AT, DAY) == (AT + timedelta(days=1)).timestamp()


def test_the_view_keeps_what_is_in_force_and_forgets_the_rest():
    view = CancelView(margin_s=60)
    now = AT.timestamp()
    soon, later = new_job_id(AT + timedelta(seconds=30)), new_job_id(AT + timedelta(hours=1))
    old = new_job_id(AT - timedelta(days=1))
    view.add([soon, later], AT, now)
    view.add([old], AT - timedelta(hours=2), now)  # cancelled long ago: already expired
    assert soon in view and later in view and old not in view and len(view) == 2
    assert view.sweep(now + 89) == 0
    assert view.sweep(now + 91) == 1  # soon: due + 60 s has passed
    assert soon not in view and later in view


def test_records_round_trip_and_markers_are_told_apart():
    body = encode(["a", "b"], AT)
    assert decode(body) == (["a", "b"], AT)
    assert marker_of(body) is None
    assert marker_of(encode_marker("t1")) == "t1"
    with pytest.raises(ValueError):
        decode(encode_marker("t1"))


@pytest.mark.parametrize(
    "body",
    [b"", b"[]", b"{}", b'{"version": 2, "ids": [], "at": "2026-01-01T00:00:00+00:00"}',
     b'{"version": 1, "ids": [1], "at": "2026-01-01T00:00:00+00:00"}',
     b'{"version": 1, "ids": [], "at": "2026-01-01T00:00:00"}', b"\xff"],
)  # fmt: skip
def test_a_broken_record_is_a_value_error(body):
    with pytest.raises(ValueError):
        decode(body)


def test_cancel_margin_setting_is_validated_and_sets_the_streams_retention():
    assert _build({"CANCEL_MARGIN": timedelta(days=1)}).cancel_margin_ms == 86_400_000
    for bad in (0, 0.5, "1 day", float("inf"), timedelta(days=4000)):
        with pytest.raises(ImproperlyConfigured, match="CANCEL_MARGIN"):
            _build({"CANCEL_MARGIN": bad})
    plan = build_plan(
        prefix="p", radix=16, resolution_ms=1, max_delay_ms=3_600_000, queue_type="classic",
        queues=["default"], cancel_margin_ms=60_000,
    )  # fmt: skip
    assert plan.cancels_queue.name == "p.cancels"
    assert plan.cancels_queue.arguments["x-queue-type"] == "stream"
    assert plan.cancels_queue.arguments["x-max-age"] == "3660s"  # MAX_DELAY + margin
    assert plan.cancels_queue in plan.shared_queues


def test_capture_removes_a_cancelled_job():
    with capture() as jobs:
        kept = defer(record, 60, "/dev/null", "kept")
        gone = defer(record, 60, "/dev/null", "gone")
        cancel(gone)
        cancel(gone)  # twice is harmless
        cancel("nobody")
    assert [j.id for j in jobs] == [kept]


def test_capture_run_skips_a_job_cancelled_by_another_job(tmp_path):
    path = str(tmp_path / "runs.jsonl")
    with capture() as jobs:
        first = defer(chain, 0, path, 0)
    assert [j.id for j in jobs] == [first]
    with capture() as jobs:
        gone = defer(record, 5, path, "gone")
        defer(record, 10, path, "kept")
        cancel(gone)
        jobs.run()
    from tests.testapp.tasks import read_records

    assert [r["label"] for r in read_records(path)] == ["kept"]


def test_eager_cancel_of_a_job_that_ran_does_nothing(tmp_path):
    path = str(tmp_path / "runs.jsonl")
    with eager() as ran:
        job_id = defer(record, 60, path, "ran")
        cancel(job_id)  # it ran inside defer(): nothing left to stop, no broker needed
    assert [j.id for j in ran] == [job_id]
