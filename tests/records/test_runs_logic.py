"""What a worker remembers of the attempts it ran, so that copies are not run again (pure)."""

from __future__ import annotations

from datetime import timedelta

from deferred.core.jobs import utcnow
from deferred.records.runs import Claim, End, RecentRuns
from deferred.worker.copies import attempt_ended, first_run_key, run_key
from tests.conftest import record_job


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_copy_of_a_running_attempt_joins_it_and_is_handed_back_at_its_end():
    runs: RecentRuns[str] = RecentRuns()
    assert runs.claim("job/1", "first") is Claim.RUN
    assert runs.claim("job/1", "copy") is Claim.JOINED
    assert runs.claim("job/1", "another") is Claim.JOINED
    assert runs.claim("other/1", "x") is Claim.RUN
    assert runs.end("job/1", End.SETTLED) == ["copy", "another"]
    # Ran and settled: a later copy is a duplicate.
    assert runs.claim("job/1", "late copy") is Claim.DONE
    assert runs.end("other/1", End.SETTLED) == []


def test_an_attempt_not_settled_or_sent_back_to_wait_is_forgotten():
    runs: RecentRuns[str] = RecentRuns()
    runs.claim("job/1", "first")
    runs.claim("job/1", "copy")
    # Its outcome could not be stored: the copy goes back with it, and runs later.
    assert runs.end("job/1", End.FORGOTTEN) == ["copy"]
    assert runs.claim("job/1", "copy again") is Claim.RUN
    assert len(runs) == 1


def test_a_requeued_attempt_runs_its_counted_copy_but_not_the_stale_original():
    runs: RecentRuns[str] = RecentRuns()
    assert runs.claim("job/1", "original", count=0) is Claim.RUN
    runs.end("job/1", End.REQUEUED, count=1)
    # The original, redelivered again because its ack was lost: stale.
    assert runs.claim("job/1", "original again", count=0) is Claim.DONE
    # The copy this worker sent on with count 1: runs.
    assert runs.claim("job/1", "copy", count=1) is Claim.RUN
    runs.end("job/1", End.SETTLED)
    assert runs.claim("job/1", "copy again", count=1) is Claim.DONE


def test_ended_attempts_are_remembered_for_keep_s_and_at_most_max_entries():
    clock = Clock()
    runs: RecentRuns[str] = RecentRuns(keep_s=10, max_entries=3, clock=clock)
    for n in range(3):
        runs.claim(f"job{n}", "d")
        runs.end(f"job{n}", End.SETTLED)
        clock.now += 1
    assert runs.claim("job0", "d") is Claim.DONE
    runs.claim("job3", "d")
    runs.end("job3", End.SETTLED)
    assert len(runs) == 3
    assert runs.claim("job0", "d") is Claim.RUN  # the oldest went first
    runs.end("job0", End.FORGOTTEN)
    clock.now += 20
    assert runs.claim("job1", "d") is Claim.RUN  # past keep_s
    assert len(runs) == 1  # every ended one expired; job1 runs


def test_a_running_attempt_is_never_expired_nor_trimmed():
    clock = Clock()
    runs: RecentRuns[str] = RecentRuns(keep_s=1, max_entries=1, clock=clock)
    runs.claim("long", "d")
    for n in range(5):
        runs.claim(f"short{n}", "d")
        runs.end(f"short{n}", End.SETTLED)
    clock.now += 100
    assert runs.claim("long", "copy") is Claim.JOINED
    assert runs.end("long", End.SETTLED) == ["copy"]


def test_the_run_key_tells_attempts_and_re_driven_runs_apart():
    job = record_job("path", "x")
    assert run_key(job) == first_run_key(job)
    retry = job.next_attempt(utcnow() + timedelta(seconds=1), worker="w")
    assert run_key(retry) != run_key(job)
    assert run_key(retry) == first_run_key(retry)
    # A re-drive from the failed list: a new first due time, attempt 1 again.
    redriven = record_job("path", "x", id=job.id, first_due_at=job.due + timedelta(hours=1))
    assert run_key(redriven) != run_key(job)
    assert run_key(redriven) != first_run_key(redriven)


def test_attempt_ended_reads_a_result_as_the_end_of_an_attempt_or_not():
    assert attempt_ended("succeeded", "succeeded", 1, 1)
    assert attempt_ended("failed", "failed", 2, 1)
    assert attempt_ended("cancelled", "superseded", 0, 1)
    assert attempt_ended("pending", "dropped", 0, 1)
    # Attempt 1 ended in a retry; attempt 2 has not run.
    assert attempt_ended("pending", "retrying", 1, 1)
    assert not attempt_ended("pending", "retrying", 1, 2)
    assert not attempt_ended("running", "started", 1, 1)
    assert not attempt_ended("pending", None, 0, 1)
