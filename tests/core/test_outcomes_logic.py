"""The outcomes enum, its log levels, and observers told in turn (pure: no broker)."""

import logging

from deferred.core.outcomes import JOB_LINE, Observer, Observers, Outcome


class Recording(Observer):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def consuming(self, up: bool) -> None:
        self.calls.append(("consuming", up))

    def outcome(self, task, queue, outcome, *, lateness_s=None, duration_s=None) -> None:
        self.calls.append(("outcome", task, queue, outcome, lateness_s, duration_s))

    def attempt_started(self, job, at, *, redelivered) -> None:
        self.calls.append(("attempt_started", job, at, redelivered))

    def job_ended(self, job, outcome, at, *, value=None, error=None, reason=None) -> None:
        self.calls.append(("job_ended", job, outcome, at, value, error, reason))


def test_the_ten_outcomes_are_the_strings_the_log_and_the_metric_say():
    assert [str(o) for o in Outcome] == [
        "succeeded",
        "retrying",
        "failed",
        "cancelled",
        "superseded",
        "rescheduled",
        "requeued",
        "dropped",
        "duplicate",
        "moved",
    ]
    assert Outcome("failed") is Outcome.FAILED
    assert "outcome=requeued" in JOB_LINE % ("j", "t", 1, 0.0, Outcome.REQUEUED, 0.0, "")


def test_a_failure_logs_an_error_a_retry_or_requeue_a_warning_the_rest_info():
    levels = {o: o.level for o in Outcome}
    assert levels[Outcome.FAILED] == logging.ERROR
    assert {o for o, level in levels.items() if level == logging.WARNING} == {
        Outcome.RETRYING,
        Outcome.REQUEUED,
        Outcome.DROPPED,
    }
    assert levels[Outcome.SUCCEEDED] == levels[Outcome.CANCELLED] == logging.INFO


def test_observers_tell_each_observer_in_turn_and_skip_the_absent_ones():
    first, second = Recording(), Recording()
    both = Observers([first, None, second])
    both.consuming(True)
    both.beat()  # neither overrides it: nothing happens, nothing raises
    both.started()
    both.finished()
    both.attempt_started("job", "now", redelivered=True)
    both.job_ended("job", Outcome.FAILED, "then", error="boom", reason="task_error")
    both.outcome("t", "default", Outcome.SUCCEEDED, lateness_s=0.01, duration_s=0.5)
    expected = [
        ("consuming", True),
        ("attempt_started", "job", "now", True),
        ("job_ended", "job", Outcome.FAILED, "then", None, "boom", "task_error"),
        ("outcome", "t", "default", Outcome.SUCCEEDED, 0.01, 0.5),
    ]
    assert first.calls == expected
    assert second.calls == expected


def test_no_observer_at_all_is_fine():
    nobody = Observers([None, None])
    nobody.consuming(False)
    nobody.outcome("t", "q", Outcome.DROPPED)
