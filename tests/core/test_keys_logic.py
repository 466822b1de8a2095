"""Debounced jobs without a broker: keys, the view of the latest job per key, the
record a keyed job leaves in the cancels stream, and the test modes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from deferred import defer, defer_many
from deferred.conf import get_settings
from deferred.core.jobs import Job, new_job_id
from deferred.core.keys import MAX_KEY_LENGTH, KeyView, validate_key
from deferred.core.topology import CANCEL_ROUTING_KEY
from deferred.producer.publishing import prepare
from deferred.records.cancels import CancelView, decode_record, encode
from deferred.testing import capture
from tests.testapp.tasks import record

AT = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
NOW = AT.timestamp()
MARGIN = 60.0


def job_due(seconds: float) -> str:
    return new_job_id(AT + timedelta(seconds=seconds))


@pytest.mark.parametrize("key", ["digest:42", "x", "k" * MAX_KEY_LENGTH, "user 7 / sync"])
def test_a_key_is_any_printable_string_up_to_the_limit(key):
    assert validate_key(key) == key


@pytest.mark.parametrize(
    ("key", "error"),
    [
        (42, TypeError),
        (b"k", TypeError),
        ("", ValueError),
        ("k" * (MAX_KEY_LENGTH + 1), ValueError),
        ("a\nb", ValueError),
    ],
)
def test_a_bad_key_is_refused_before_anything_is_published(key, error):
    with pytest.raises(error):
        record.using(key=key)


def test_a_later_job_of_a_key_supersedes_the_earlier_one_until_its_due_time_plus_the_margin():
    view = KeyView(MARGIN)
    first, second = job_due(300), job_due(60)
    view.add("k", first, NOW + 300, NOW)
    assert view.latest("k") == first and not view.is_superseded(first)
    # A later job, due sooner: the earlier one is still superseded (deferred before it)
    view.add("k", second, NOW + 60, NOW + 1)
    assert view.latest("k") == second and view.is_superseded(first)
    assert not view.is_superseded(second) and len(view) == 1 and view.superseded == 1
    # The key is forgotten once its latest job is past; the superseded one is kept
    # until its own due time plus the margin, which is later
    view.sweep(NOW + 60 + MARGIN)
    assert len(view) == 0 and view.is_superseded(first)
    view.sweep(NOW + 300 + MARGIN)
    assert not view.is_superseded(first) and view.superseded == 0


def test_a_job_whose_own_record_is_not_read_yet_is_not_taken_for_an_older_one():
    # A job due at once can reach a worker a moment before the stream has its copy:
    # the key's latest known job is then an older one, and the new job must still run.
    view = KeyView(MARGIN)
    older, newer = job_due(-1), job_due(0)
    view.add("k", older, NOW - 1, NOW)
    assert view.latest("k") == older and not view.is_superseded(newer)
    view.add("k", newer, NOW, NOW + 0.01)  # read a moment later
    assert view.is_superseded(older) and not view.is_superseded(newer)


def test_the_same_job_read_twice_does_not_supersede_itself():
    view = KeyView(MARGIN)
    job_id = job_due(10)
    view.add("k", job_id, NOW + 10, NOW)
    view.add("k", job_id, NOW + 10, NOW)  # a publish the broker took twice
    assert view.latest("k") == job_id and not view.is_superseded(job_id)


def test_keys_do_not_mix():
    view = KeyView(MARGIN)
    a, b = job_due(10), job_due(10)
    view.add("a", a, NOW + 10, NOW)
    view.add("b", b, NOW + 10, NOW)
    assert not view.is_superseded(a) and not view.is_superseded(b) and len(view) == 2


def test_records_read_at_boot_keep_only_what_can_still_come_due():
    view = KeyView(MARGIN)
    old, past, pending, latest = job_due(-600), job_due(-300), job_due(100), job_due(200)
    now = NOW
    view.add("k", old, NOW - 600, now)  # past for good: not kept
    view.add("k", past, NOW - 300, now)
    assert len(view) == 0 and view.superseded == 0
    view.add("k", pending, NOW + 100, now)
    view.add("k", latest, NOW + 200, now)
    assert view.is_superseded(pending) and view.latest("k") == latest


def test_a_keyed_job_is_published_with_a_bcc_into_the_cancels_stream():
    settings = get_settings()
    keyed = prepare(record.using(key="k"), 5, ("/tmp/x", "y"), {}, settings, AT)
    plain = prepare(record, 5, ("/tmp/x", "y"), {}, settings, AT)
    assert keyed.job.key == "k" and keyed.headers["BCC"] == [CANCEL_ROUTING_KEY]
    assert plain.job.key is None and "BCC" not in plain.headers
    # The key travels in the body, and only when set
    assert Job.decode(keyed.body).key == "k"
    assert b'"key"' not in plain.body


def test_the_stream_tells_cancels_keyed_jobs_and_anything_else_apart():
    settings = get_settings()
    keyed = prepare(record.using(key="k"), 5, ("/tmp/x", "y"), {}, settings, AT)
    plain = prepare(record, 5, ("/tmp/x", "y"), {}, settings, AT)
    assert decode_record(keyed.body) == keyed.job
    assert decode_record(encode(["a"], AT)) == (["a"], AT)
    with pytest.raises(ValueError, match="no key"):
        decode_record(plain.body)
    with pytest.raises(ValueError):
        decode_record(b'{"task": 1}')
    view = CancelView(MARGIN)
    view.apply(keyed.job, NOW)
    view.apply((["a"], AT), NOW)
    assert "a" in view and view.keys.latest("k") == keyed.job.id


def test_capture_keeps_only_the_latest_job_of_each_key():
    with capture() as jobs:
        first = record.using(key="k").defer(60, "/tmp/x", "first")
        other = defer(record.using(key="other"), 60, "/tmp/x", "other")
        plain = defer(record, 60, "/tmp/x", "plain")
        second, third = defer_many(
            [
                (record.using(key="k"), 30, ("/tmp/x", "second")),
                (record.using(key="k"), 90, ("/tmp/x", "third")),
            ]
        )
    assert first and second
    assert [job.id for job in jobs] == [other, plain, third]


def test_a_transfer_copies_the_keyed_jobs_that_can_still_come_due():
    from deferred.operate.transfer_plan import in_force

    settings = get_settings()
    keyed = prepare(record.using(key="k"), 5, ("/tmp/x", "y"), {}, settings, AT)
    assert in_force(keyed.body, MARGIN, NOW)
    assert not in_force(keyed.body, MARGIN, NOW + 5 + MARGIN)
    plain = prepare(record, 5, ("/tmp/x", "y"), {}, settings, AT)
    assert not in_force(plain.body, MARGIN, NOW)
