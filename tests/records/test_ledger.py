"""The job ledger against the real broker: list what is pending, run it now, move it, cancel it.

Each test has a topology of its own: a listing reads the whole ledger, and the
session's topology holds the jobs of every other test.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

import deferred
from deferred import JobNotPending, cancel, defer, pending, reschedule, run_now
from deferred.broker.ledger_index import StreamSession
from deferred.conf import get_settings
from deferred.core.jobs import new_job_id
from deferred.records import changes, checkpoints
from tests.conftest import rabbitmqctl, remove_topologies, wait_for
from tests.testapp.tasks import late_retry, on_other, read_records, record, sleepy, timed


def ids(rows) -> list[str]:
    return [r.id for r in rows]


def test_pending_lists_each_waiting_job_soonest_first_with_what_it_is(own_topology, records):
    late = defer(record, 90, records, "late")
    soon = defer(timed, 30, records, "soon")
    other = defer(on_other, 60, records, "other")
    keyed = defer(record.using(key="cart:7", priority=5), 45, records, "keyed")
    before = datetime.now(UTC)

    rows = pending()
    assert ids(rows) == [soon, keyed, other, late]
    first = rows[0]
    assert first.task == "tests.timed" and first.queue == "default" and first.attempt == 1
    assert first.args == [records, "soon"] and first.kwargs == {} and not first.truncated
    assert before + timedelta(seconds=25) < first.due <= before + timedelta(seconds=31)
    assert first.enqueued <= before
    by_id = {r.id: r for r in rows}
    assert by_id[keyed].key == "cart:7" and by_id[keyed].priority == 5
    assert by_id[other].queue == "other"
    as_json = by_id[keyed].as_dict()
    assert as_json["due"].endswith("+00:00") and as_json["id"] == keyed

    assert ids(pending(task="tests.timed")) == [soon]
    assert ids(pending(queue="other")) == [other]
    assert ids(pending(key="cart:7")) == [keyed]
    assert ids(pending(due_after=before + timedelta(seconds=50))) == [other, late]
    assert ids(pending(due_before=before + timedelta(seconds=50))) == [soon, keyed]
    assert ids(pending(limit=2)) == [soon, keyed]
    assert pending(task="no.such.task") == []


def test_a_job_leaves_the_list_when_it_runs_is_cancelled_or_superseded(
    own_topology, run_worker, records
):
    ran = defer(record, 0.2, records, "ran")
    cancelled = defer(record, 60, records, "cancelled")
    old = defer(record.using(key="digest"), 60, records, "old")
    new = defer(record.using(key="digest"), 60, records, "new")
    assert old not in ids(pending())  # superseded at once by "new"
    waiting = defer(record, 60, records, "waiting")
    # A later job of its key superseded "old" as soon as it was deferred.
    assert set(ids(pending())) == {ran, cancelled, new, waiting}, pending()
    cancel(cancelled)
    run_worker()
    assert wait_for(lambda: len(read_records(records)) == 1, 10)
    # The run's record reaches the results within the writer's linger.
    assert wait_for(lambda: set(ids(pending())) == {new, waiting}, 10), ids(pending())


def test_big_arguments_are_listed_as_a_preview(own_topology, records):
    job = defer(record, 60, records, "x" * 5000)
    (row,) = pending()
    assert row.id == job and row.truncated and row.args is None
    assert row.preview.startswith(f'[["{records}","xxx') and len(row.preview) < 1100


def test_bad_filters_are_refused(own_topology):
    with pytest.raises(ValueError):
        pending(due_after=datetime(2030, 1, 1))  # naive
    with pytest.raises(TypeError):
        pending(task=3)
    with pytest.raises(ValueError):
        pending(limit=0)


def test_run_now_runs_the_job_at_once_and_once(own_topology, run_worker, records):
    job = defer(timed, 3, records, "now")
    worker = run_worker()
    asked = time.time()
    run_now(job)
    assert wait_for(lambda: len(read_records(records)) == 1, 5)
    (run,) = read_records(records)
    assert run["job"] == job and run["at"] - asked < 3
    # The copy it had in the delay line comes due, and is dropped.
    assert wait_for(lambda: worker.outcomes["moved"] == 1, 10)
    time.sleep(0.3)
    assert len(read_records(records)) == 1
    assert deferred.result(job).state == "succeeded"


def test_reschedule_moves_the_job_later_never_before_the_new_time(
    own_topology, run_worker, records
):
    job = defer(timed, 0.5, records, "moved")
    new_due = reschedule(job, 2.0)
    (row,) = pending()
    assert row.id == job and row.moved and abs((row.due - new_due).total_seconds()) < 0.01
    worker = run_worker()
    assert wait_for(lambda: worker.outcomes["moved"] == 1, 5)
    assert read_records(records) == []
    assert wait_for(lambda: len(read_records(records)) == 1, 5)
    (run,) = read_records(records)
    assert run["job"] == job
    assert run["at"] >= new_due.timestamp(), "ran before its new time"
    assert run["due"] == pytest.approx(new_due.timestamp(), abs=0.01)
    assert wait_for(lambda: pending() == [], 5)


def test_a_cancel_after_a_reschedule_holds_until_the_new_time(own_topology, run_worker, records):
    job = defer(timed, 0.3, records, "cancelled")
    reschedule(job, timedelta(seconds=1.5))
    cancel(job)
    worker = run_worker()
    # The cancel names the job: both its copies are dropped as they come due.
    assert wait_for(lambda: worker.outcomes["cancelled"] == 2, 6)
    time.sleep(0.5)
    assert read_records(records) == []
    assert pending() == []


@pytest.mark.parametrize("ahead", [0.6, 0.45, 0.3])
def test_a_move_that_meets_the_jobs_due_time_runs_it_once(own_topology, run_worker, records, ahead):
    # run_now() this long before the job is due: its look and publish take about as
    # long, so the old copy starts before, during or after the move.
    worker = run_worker(concurrency=2)
    job = defer(timed, 0.8, records, "race")
    time.sleep(0.8 - ahead)
    try:
        run_now(job)
        moved = True
    except JobNotPending as exc:  # it started before the look: nothing was published
        assert exc.state == "started"
        moved = False
    assert wait_for(lambda: len(read_records(records)) >= 1, 5)
    if moved:
        # Its other copy is dropped: as moved, or as a duplicate of the run.
        assert wait_for(lambda: worker.outcomes["moved"] + worker.outcomes["duplicate"] == 1, 10)
    time.sleep(2.5)  # a moved copy waits COPY_WAIT_S before its look-up
    assert len(read_records(records)) == 1
    assert worker.outcomes["succeeded"] == 1


def test_a_job_that_ran_or_never_was_cannot_be_moved(own_topology, run_worker, records):
    job = defer(record, 0, records, "ran")
    run_worker()
    assert wait_for(lambda: len(read_records(records)) == 1, 5)
    time.sleep(0.5)  # its result record is out
    with pytest.raises(JobNotPending) as raised:
        run_now(job)
    assert raised.value.state == "started"
    with pytest.raises(JobNotPending) as raised:
        reschedule(new_job_id(datetime.now(UTC) + timedelta(hours=1)), 5)
    assert raised.value.state == "unknown"
    with pytest.raises(ValueError):
        reschedule("not-an-id", 5)
    with pytest.raises((TypeError, ValueError)):
        reschedule(job, "soon")
    cancelled = defer(record, 60, records, "c")
    cancel(cancelled)
    with pytest.raises(JobNotPending) as raised:
        reschedule(cancelled, 5)
    assert raised.value.state == "cancelled"


def jobs_command(*args: str) -> str:
    out = StringIO()
    call_command("deferred_jobs", *args, stdout=out)
    return out.getvalue()


def test_the_command_lists_shows_and_filters(own_topology, records):
    soon = defer(timed, 30, records, "soon")
    later = defer(on_other, 60, records, "later")
    listed = json.loads(jobs_command("list", "--json"))
    assert [r["id"] for r in listed] == [soon, later]
    assert set(listed[0]) >= {"id", "task", "queue", "priority", "key", "due", "enqueued", "args"}
    assert listed[0]["args"] == [records, "soon"] and listed[0]["kwargs"] == {}
    assert datetime.fromisoformat(listed[0]["due"]).utcoffset() == timedelta(0)
    assert [r["id"] for r in json.loads(jobs_command("list", "--json", "--queue", "other"))] == [
        later
    ]
    assert json.loads(jobs_command("list", "--json", "--due-after", "+45s")) == [listed[1]]
    assert json.loads(jobs_command("list", "--json", "--due-before", "+45s")) == [listed[0]]
    text = jobs_command("list", "--limit", "1")
    assert soon in text and later not in text and "the first 1" in text
    shown = json.loads(jobs_command("show", soon, "--json"))
    assert shown["state"] == "pending" and shown["job"]["task"] == "tests.timed"
    assert f"job {soon}: pending" in jobs_command("show", soon)
    with pytest.raises(CommandError, match="not a job id"):
        jobs_command("show", "nope")
    with pytest.raises(CommandError, match="No job"):
        jobs_command("show", new_job_id(datetime.now(UTC) + timedelta(hours=1)))
    with pytest.raises(CommandError):
        jobs_command("list", "--due-after", "tomorrowish")


def test_the_command_moves_and_cancels_by_filter(own_topology, run_worker, records):
    a = defer(record, 60, records, "a")
    b = defer(record, 60, records, "b")
    keep = defer(on_other, 60, records, "keep")
    out = jobs_command("cancel", "--task", "tests.testapp.tasks.record", "--dry-run")
    assert "Would cancel 2 pending jobs" in out and a in out and b in out
    assert len(pending()) == 3
    with pytest.raises(CommandError, match="Say which jobs"):
        jobs_command("cancel")
    with pytest.raises(CommandError, match="without confirmation"):
        jobs_command("cancel", "--task", "tests.testapp.tasks.record")  # not a terminal
    assert "Cancelled 2 pending jobs" in jobs_command(
        "cancel", "--task", "tests.testapp.tasks.record", "--yes"
    )
    assert ids(pending()) == [keep]
    out = jobs_command("reschedule", keep, "--in", "1")
    assert keep in out and "due" in out
    worker = run_worker()
    assert wait_for(lambda: [r["label"] for r in read_records(records)] == ["keep"], 5)
    with pytest.raises(CommandError, match="not pending"):
        jobs_command("run-now", a)
    assert worker.outcomes["succeeded"] == 1


def test_a_listing_after_a_checkpoint_is_the_checkpoint_and_what_came_since(
    own_topology, run_worker, records
):
    settings = get_settings()
    kept = defer(record, 60, records, "kept")
    cancelled = defer(record, 61, records, "cancelled")
    moved = defer(timed, 62, records, "moved")
    runs = defer(record, 0.3, records, "runs")
    head = checkpoints.write(settings, timeout=30)
    assert head.rows == 4 and len(head.pages) == 1
    with StreamSession(settings.broker_urls, timeout=10) as session:
        assert checkpoints.latest_head(settings, session) == head
    # Since the checkpoint: a cancel, a new job, a move, and a run.
    cancel(cancelled)
    new = defer(record, 30, records, "new")
    new_due = reschedule(moved, 90)
    worker = run_worker()
    assert wait_for(lambda: len(read_records(records)) == 1, 5)
    assert wait_for(lambda: ids(pending()) == [new, kept, moved], 5), pending()
    assert pending()[-1].due == new_due.replace(microsecond=new_due.microsecond // 1000 * 1000)
    assert changes.look(settings, moved).state == "pending"
    assert changes.look(settings, cancelled).state == "cancelled"
    assert changes.look(settings, runs).state == "started"
    # The next checkpoint holds the same, and so does a listing of it alone.
    later = checkpoints.write(settings, timeout=30)
    assert later.rows == 3 and later.ledger_offset > head.ledger_offset
    assert ids(pending()) == [new, kept, moved]
    assert ids(pending(due_after=datetime.now(UTC) + timedelta(seconds=45))) == [kept, moved]
    assert worker.outcomes["succeeded"] == 1


def test_a_job_due_away_from_its_first_due_time_is_found_after_a_checkpoint(
    own_topology, run_worker, records, monkeypatch
):
    """A look-up reads the pages of the due time a job's id carries: a retry due later,
    and rows past the second page of jobs due at one millisecond, are on the
    checkpoint's away pages, and found there."""
    from deferred.core import ledger_index

    monkeypatch.setattr(ledger_index, "ROWS_PER_PAGE", 1)  # a page per row
    settings = get_settings()
    retried = defer(late_retry, 0.2, records, "retried", 1)
    # Due before the retry (30 s after its first run), and well after the test ends.
    between = [defer(record, 20 + n, records, f"b{n}") for n in range(3)]
    at = datetime.now(UTC) + timedelta(seconds=60)
    crowd = deferred.defer_many([(record, at, (records, f"c{n}")) for n in range(4)])
    worker = run_worker()
    assert wait_for(lambda: worker.outcomes["retrying"] == 1, 10)
    worker.stop()
    head = checkpoints.write(settings, timeout=30)
    assert head.rows == 8 and len(head.pages) == 8
    # Pages b0 b1 b2 retry c c c c: the retry (its id says pages 0 and 1) and the crowd's
    # last two (its ids say pages 4 and 5).
    assert sum(a.rows for a in head.away) == 3
    checkpoints.forget(settings)
    for job_id in [retried, *between, *crowd]:
        found = changes.look(settings, job_id)
        assert found.state == "pending" and found.job is not None, (job_id, found)
    assert changes.look(settings, retried).job.attempt == 2  # its retry
    assert changes.look(settings, new_job_id(at)).state == "unknown"
    # And so it can be moved: the retry runs now, once.
    run_now(retried)
    run_worker()

    def attempts() -> list[int]:
        return [r["attempt"] for r in read_records(records) if r["label"] == "retried"]

    assert wait_for(lambda: attempts() == [1, 2], 10), attempts()
    time.sleep(0.5)
    assert attempts() == [1, 2]


def test_the_keeper_writes_checkpoints(own_topology, run_worker, records, monkeypatch):
    from deferred.worker import keeper

    monkeypatch.setattr(keeper, "CHECKPOINT_FIRST_S", 0.2)
    job = defer(record, 60, records, "waits")
    worker = run_worker()
    assert wait_for(lambda: worker.keeper is not None and worker.keeper.checkpointed.is_set(), 20)
    settings = get_settings()
    with StreamSession(settings.broker_urls, timeout=10) as session:
        head = checkpoints.latest_head(settings, session)
    assert head is not None and head.rows == 1
    assert ids(pending()) == [job]


def test_a_checkpoint_is_written_in_a_process_of_its_own_and_says_why_it_failed(
    own_topology, monkeypatch
):
    from dataclasses import replace

    from deferred.worker import checkpointing

    settings = get_settings()
    job = defer(record, 60, "unused", "waits")
    written = checkpointing.write_aside(settings, timeout=30)
    head = written.head
    assert head.rows == 1 and written.cpu_s > 0
    # By another process, at a lower priority than this one's.
    assert written.pid != os.getpid()
    assert written.nice == min(19, os.nice(0) + checkpointing.NICE)
    with StreamSession(settings.broker_urls, timeout=10) as session:
        assert checkpoints.latest_head(settings, session) == head
    assert ids(pending()) == [job]
    # A broker that does not answer: the child says so, as BrokerUnavailable.
    nowhere = replace(settings, broker_urls=("amqp://guest:guest@127.0.0.1:1/%2F",))
    with pytest.raises(deferred.BrokerUnavailable):
        checkpointing.write_aside(nowhere, timeout=5)
    # A worker that stops ends its checkpoint's process, and says so.
    stop = threading.Event()
    stop.set()
    with pytest.raises(checkpointing.CheckpointFailed, match="stops"):
        checkpointing.write_aside(settings, timeout=30, stop=stop)
    with StreamSession(settings.broker_urls, timeout=10) as session:
        assert checkpoints.latest_head(settings, session) == head
    # Settings made in code, no module to set Django up from: on this thread.
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE")
    again = checkpointing.write_aside(settings, timeout=30)
    assert again.head.rows == 1 and again.head.token != head.token
    assert again.pid == os.getpid()


def test_a_worker_killed_mid_job_leaves_exactly_the_pending_jobs_listed(
    own_topology, worker_process, records
):
    env = {"DEFERRED_TEST_PREFIX": own_topology.prefix}
    waiting = [defer(record, 60 + n, records, f"w{n}") for n in range(3)]
    killed = defer(sleepy, 0, records, "killed", 5.0)
    first = worker_process("--concurrency", "1", env=env)
    assert wait_for(lambda: [r["event"] for r in read_records(records)] == ["start"], 10)
    time.sleep(0.5)  # its "started" record is out
    first.kill()
    # Running when it was killed: not pending, and back in its queue for the next worker.
    assert ids(pending()) == waiting
    second = worker_process("--concurrency", "1", env=env)
    assert wait_for(lambda: sum(r["event"] == "end" for r in read_records(records)) == 1, 20), (
        second.output()
    )
    assert ids(pending()) == waiting
    assert killed


@pytest.mark.alone  # restarts the broker
def test_the_ledger_lists_the_same_jobs_after_a_broker_restart(own_topology, records):
    settings = get_settings()
    waiting = [defer(record, 120 + n, records, f"w{n}") for n in range(3)]
    checkpoints.write(settings, timeout=30)
    after = defer(record, 130, records, "after")
    rabbitmqctl("stop_app")
    try:
        time.sleep(1)
    finally:
        rabbitmqctl("start_app")
    assert wait_for(lambda: _readable(), 30)
    assert ids(pending()) == [*waiting, after]
    cancel(waiting[0])
    assert ids(pending()) == [*waiting[1:], after]


def _readable() -> bool:
    try:
        pending()
    except deferred.BrokerError:
        return False
    return True


def test_a_listing_after_the_topology_was_declared_again_reads_the_new_streams(
    own_topology, broker_url, records
):
    settings = get_settings()
    gone = defer(record, 60, records, "gone")
    checkpoints.write(settings, timeout=30)
    assert ids(pending()) == [gone]  # this process now keeps the head, tail and cancels read
    remove_topologies(broker_url, own_topology)
    call_command("declare_delay_topology", verbosity=0)
    new = defer(record, 60, records, "new")
    assert ids(pending()) == [new]
    assert changes.look(settings, new, with_job=False).state == "pending"
