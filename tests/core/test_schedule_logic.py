"""Schedules as pure logic: the instants every(...) and cron(...) give, time zones and
the days the clocks change (no broker needed)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.test import override_settings

from deferred.core.jobs import due_of
from deferred.core.schedule import ScheduleError, cron, every, occurrence_id

NEW_YORK = ZoneInfo("America/New_York")
PARIS = ZoneInfo("Europe/Paris")


def runs(schedule, start: datetime, count: int) -> list[datetime]:
    found, at = [], start
    for _ in range(count):
        at = schedule.after(at)
        found.append(at)
    return found


def test_every_falls_on_the_same_grid_whoever_computes_it():
    five = every(minutes=5)
    assert five.after(datetime(2026, 1, 1, 10, 2, 13, tzinfo=UTC)) == datetime(
        2026, 1, 1, 10, 5, tzinfo=UTC
    )
    # Strictly after: an occurrence is never given twice.
    assert five.after(datetime(2026, 1, 1, 10, 5, tzinfo=UTC)) == datetime(
        2026, 1, 1, 10, 10, tzinfo=UTC
    )
    assert every(timedelta(minutes=5)) == five
    second = every(seconds=1)
    start = datetime(2026, 1, 1, 0, 0, 0, 400000, tzinfo=UTC)
    assert [r.microsecond for r in runs(second, start, 3)] == [0, 0, 0]
    assert [r.second for r in runs(second, start, 3)] == [1, 2, 3]


def test_every_with_a_start_and_in_other_zones():
    start = datetime(2026, 3, 1, 9, 0, tzinfo=PARIS)
    daily = every(days=1, start=start)
    # A fixed period: 24 h, so across the spring change it moves by an hour of wall time.
    at = daily.after(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))
    assert at == datetime(2026, 3, 29, 8, 0, tzinfo=UTC)
    assert daily.after(datetime(2020, 1, 1, tzinfo=UTC)) == start.astimezone(UTC)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "needs a period"),
        ((timedelta(seconds=5),), {"minutes": 1}, "not both"),
        ((), {"fortnights": 1}, "fortnights"),
        ((5,), {}, "takes a timedelta"),
        ((), {"milliseconds": 10}, "at least 100 ms"),
        ((), {"seconds": -1}, "at least"),
        ((), {"minutes": 1, "misfire": "later"}, "misfire must be one of"),
        ((), {"minutes": 1, "start": datetime(2026, 1, 1)}, "aware datetime"),
    ],
)
def test_every_refuses_what_it_cannot_plan(args, kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        every(*args, **kwargs)


def test_cron_in_a_zone_on_weekdays():
    digest = cron("30 7 * * mon-fri", tz="Europe/Paris")
    friday_noon = datetime(2026, 11, 20, 12, 0, tzinfo=PARIS)
    assert [r.astimezone(PARIS) for r in runs(digest, friday_noon, 2)] == [
        datetime(2026, 11, 23, 7, 30, tzinfo=PARIS),
        datetime(2026, 11, 24, 7, 30, tzinfo=PARIS),
    ]
    assert digest.describe() == "cron '30 7 * * mon-fri' (Europe/Paris)"


def test_cron_on_the_spring_forward_night_runs_the_skipped_time_once_after_the_jump():
    # New York, 2026-03-08: 02:00 becomes 03:00, so 02:30 does not exist that night.
    nightly = cron("30 2 * * *", tz="America/New_York")
    found = runs(nightly, datetime(2026, 3, 7, 12, 0, tzinfo=NEW_YORK), 3)
    assert [r.astimezone(NEW_YORK).replace(tzinfo=None) for r in found] == [
        datetime(2026, 3, 8, 3, 0),
        datetime(2026, 3, 9, 2, 30),
        datetime(2026, 3, 10, 2, 30),
    ]


def test_cron_on_the_fall_back_night_runs_the_repeated_time_once():
    # New York, 2026-11-01: 02:00 becomes 01:00 again, so 01:30 happens twice.
    nightly = cron("30 1 * * *", tz="America/New_York")
    found = runs(nightly, datetime(2026, 10, 31, 12, 0, tzinfo=NEW_YORK), 3)
    assert [r.astimezone(NEW_YORK).replace(tzinfo=None) for r in found] == [
        datetime(2026, 11, 1, 1, 30),
        datetime(2026, 11, 2, 1, 30),
        datetime(2026, 11, 3, 1, 30),
    ]
    # The first 01:30 (EDT, UTC-4) is the one kept.
    assert found[0] == datetime(2026, 11, 1, 5, 30, tzinfo=UTC)


def test_cron_without_tz_reads_django_time_zone():
    with override_settings(TIME_ZONE="Asia/Tokyo"):
        morning = cron("0 9 * * *")
    assert morning.tz == "Asia/Tokyo"
    assert morning.after(datetime(2025, 12, 31, 23, tzinfo=UTC)) == datetime(2026, 1, 1, tzinfo=UTC)
    assert cron("0 9 * * *", tz=ZoneInfo("Europe/Paris")).tz == "Europe/Paris"


@pytest.mark.parametrize(
    ("expression", "tz", "message"),
    [
        ("61 * * * *", "UTC", "Bad minute"),
        ("* * * *", "UTC", "Wrong number of fields"),
        ("0 9 * * *", "Mars/Olympus", "unknown time zone"),
        (5, "UTC", "as a str"),
    ],
)
def test_cron_refuses_bad_expressions_and_zones(expression, tz, message):
    with pytest.raises(ScheduleError, match=message):
        cron(expression, tz=tz)


def test_a_schedule_between_two_instants_is_capped():
    second = every(seconds=1)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    assert len(second.between(start, start + timedelta(seconds=10), 100)) == 10
    assert second.between(start, start + timedelta(seconds=10), 3)[-1] == start + timedelta(
        seconds=3
    )


def test_occurrence_ids_are_stable_per_task_and_instant():
    at = datetime(2026, 1, 1, 7, 30, tzinfo=UTC)
    same = datetime(2026, 1, 1, 8, 30, tzinfo=PARIS)
    assert occurrence_id("app.digest", at) == occurrence_id("app.digest", same)
    assert occurrence_id("app.digest", at) != occurrence_id("app.other", at)
    assert occurrence_id("app.digest", at) != occurrence_id("app.digest", at + timedelta(minutes=1))
    # A job id like any other: 32 hex digits carrying the due time, so it can be cancelled.
    assert due_of(occurrence_id("app.digest", at)) == at
    assert len(occurrence_id("app.digest", at)) == 32


def test_a_changed_schedule_has_another_key():
    assert every(minutes=5).key == every(minutes=5).key
    assert every(minutes=5).key != every(minutes=6).key
    assert cron("0 9 * * *", tz="UTC").key != cron("0 9 * * *", tz="Europe/Paris").key


def test_a_scheduled_task_takes_no_arguments_and_a_schedule_is_a_schedule():
    from deferred import task
    from deferred.producer.tasks import unregister

    with pytest.raises(TypeError, match="callable with no arguments"):

        @task(name="tests.needs_args", schedule=every(minutes=1))
        def needs(x): ...

    with pytest.raises(ScheduleError, match="every"):

        @task(name="tests.bad_schedule", schedule="*/5 * * * *")
        def bad(): ...

    @task(name="tests.defaults_ok", schedule=every(minutes=1))
    def fine(x=1): ...

    assert fine.schedule == every(minutes=1)
    unregister("tests.defaults_ok")


def test_schedules_from_settings_are_checked():
    from django.core.exceptions import ImproperlyConfigured

    from deferred.conf import get_settings

    for bad, message in (
        ([("tests.tick", every(minutes=1))], "must be a dict"),
        ({"tests.tick": "every minute"}, "every"),
        ({"": every(minutes=1)}, "task names"),
    ):
        with override_settings(DEFERRED={"SCHEDULES": bad}):
            with pytest.raises(ImproperlyConfigured, match=message):
                get_settings()
    with override_settings(DEFERRED={"SCHEDULES": {"tests.tick": every(minutes=1)}}):
        assert get_settings().schedules == (("tests.tick", every(minutes=1)),)


def test_fire_schedule_runs_the_next_occurrence_inline(tmp_path, monkeypatch):
    from deferred.testing import fire_schedule
    from tests.testapp.tasks import read_records

    ticks = tmp_path / "ticks.jsonl"
    monkeypatch.setenv("DEFERRED_TEST_TICKS", str(ticks))
    start = datetime(2026, 1, 1, 12, 0, 0, 500000, tzinfo=UTC)
    with override_settings(DEFERRED={"SCHEDULES": {"tests.tick": every(seconds=1)}}):
        at = fire_schedule("tests.tick", after=start)
        with pytest.raises(LookupError, match="no schedule"):
            fire_schedule("tests.record")
    assert at == datetime(2026, 1, 1, 12, 0, 1, tzinfo=UTC)
    (row,) = read_records(str(ticks))
    assert row["occurrence"] == at.timestamp()
    assert row["job"] == occurrence_id("tests.tick", at)
