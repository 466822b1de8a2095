"""The scheduler's planning as pure logic: what it defers at each instant, from its record."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from deferred.core.schedule import every, occurrence_id
from deferred.records.schedules import Command, Entry, Records, read
from deferred.worker.scheduler import plan

T0 = datetime(2026, 1, 1, 12, 0, 0, 300000, tzinfo=UTC)
SECOND = timedelta(seconds=1)


def instants(occurrences) -> list[float]:
    return [(o.at - T0.replace(microsecond=0)).total_seconds() for o in occurrences]


def test_a_new_schedule_is_planned_from_now_a_few_seconds_ahead():
    out, following = plan(Records(), {"t": every(seconds=1)}, [], T0)
    assert instants(out) == [1, 2, 3, 4, 5]
    assert all(o.due == o.at and o.id == occurrence_id("t", o.at) for o in out)
    assert following.seq == 1 and following.entries["t"].planned == out[-1].at
    # A tick later only what came into the window is added: nothing twice.
    again, _ = plan(following, {"t": every(seconds=1)}, [], T0 + SECOND)
    assert instants(again) == [6]


def test_missed_occurrences_are_coalesced_skipped_or_all_run():
    planned = T0.replace(microsecond=0)
    records = Records(seq=4, entries={"t": Entry(planned=planned, key=every(seconds=1).key)})
    later = T0 + 10 * SECOND  # nine occurrences came due while nobody planned
    for policy, expected_late in (("coalesce", [9]), ("skip", []), ("all", list(range(1, 10)))):
        schedule = every(seconds=1, misfire=policy)
        out, following = plan(records, {"t": schedule}, [], later)
        late = [o for o in out if o.due < o.at or o.due == later]
        assert instants(late) == expected_late, policy
        assert all(o.due == later for o in late)
        # then the normal window, from the last missed one on
        assert instants([o for o in out if o not in late]) == [10, 11, 12, 13, 14, 15]
        assert following.entries["t"].planned == planned + 15 * SECOND


def test_a_changed_schedule_goes_on_from_what_was_planned():
    _, first = plan(Records(), {"t": every(seconds=1)}, [], T0)
    out, following = plan(first, {"t": every(seconds=2)}, [], T0 + SECOND)
    assert instants(out) == [6]  # after 5 (planned by the old rule), nothing before it again
    assert following.entries["t"].key == every(seconds=2).key


def test_pause_resume_and_run_now():
    _, first = plan(Records(), {"t": every(seconds=1)}, [], T0)
    pause = Command("pause", "t", "c1", T0)
    out, paused = plan(first, {"t": every(seconds=1)}, [pause], T0 + 10 * SECOND)
    assert out == [] and paused.entries["t"].paused
    out, still = plan(paused, {"t": every(seconds=1)}, [], T0 + 20 * SECOND)
    assert out == []
    resume = Command("resume", "t", "c2", T0 + 30 * SECOND)
    out, resumed = plan(still, {"t": every(seconds=1)}, [resume], T0 + 30 * SECOND)
    # nothing owed for the pause: from now on
    assert instants(out) == [31, 32, 33, 34, 35] and not resumed.entries["t"].paused
    run = Command("run", "t", "c3", T0 + 31 * SECOND)
    out, _ = plan(resumed, {"t": every(seconds=1)}, [run], T0 + 31 * SECOND)
    assert [o.id for o in out if o.id == "c3"] == ["c3"]


def test_a_removed_schedule_is_forgotten():
    _, first = plan(Records(), {"t": every(seconds=1), "u": every(seconds=1)}, [], T0)
    out, following = plan(first, {"u": every(seconds=1)}, [], T0 + SECOND)
    assert {o.task for o in out} == {"u"} and set(following.entries) == {"u"}


def test_the_newest_record_wins_and_commands_are_kept():
    _, one = plan(Records(), {"t": every(seconds=1)}, [], T0)
    _, two = plan(one, {"t": every(seconds=1)}, [], T0 + SECOND)
    command = Command("pause", "t", "c", T0)
    records, commands = read([two.encode(), one.encode(), command.encode(), b"not json"])
    assert records.seq == two.seq and records.entries == two.entries
    assert commands == [command]
