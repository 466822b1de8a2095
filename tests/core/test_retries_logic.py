"""Retry policies (pure)."""

import pytest

from deferred import Exponential, Retry
from deferred.core.retries import RetryPolicy, Schedule, parse_backoff


def test_schedule_last_value_repeats():
    backoff = parse_backoff([10, 60, 600])
    assert [backoff.seconds(n) for n in range(1, 6)] == [10, 60, 600, 600, 600]


def test_exponential_with_cap_and_jitter_that_only_adds():
    backoff = parse_backoff({"base": 1, "factor": 2, "cap": 5, "jitter": 0.5})
    assert isinstance(backoff, Exponential)
    for retry, nominal in [(1, 1), (2, 2), (3, 4), (4, 5), (50, 5)]:
        for _ in range(20):
            assert nominal <= backoff.seconds(retry) <= nominal * 1.5
    assert Exponential(base=3, jitter=0).seconds(1) == 3


@pytest.mark.parametrize(
    "bad", [[], [-1], ["10"], "10", {"base": -1}, {"nope": 1}, {"factor": 0.5}, [float("nan")]]
)
def test_bad_backoffs(bad):
    with pytest.raises(ValueError):
        parse_backoff(bad)


def policy(max_retries=2, **kw):
    return RetryPolicy(max_retries=max_retries, backoff=Schedule((1.0, 5.0)), **kw)


def test_retries_until_exhausted():
    p = policy()
    assert p.decide(RuntimeError(), 1).retry and p.decide(RuntimeError(), 1).delay == 1.0
    assert p.decide(RuntimeError(), 2).delay == 5.0
    last = p.decide(RuntimeError(), 3)
    assert not last.retry and last.reason == "retries_exhausted"


def test_no_retries_is_a_task_error():
    assert policy(max_retries=0).decide(RuntimeError(), 1).reason == "task_error"


def test_retry_for_and_dont_retry_for():
    p = policy(retry_for=(ConnectionError,), dont_retry_for=(ConnectionRefusedError,))
    assert p.decide(ConnectionResetError(), 1).retry
    assert not p.decide(ConnectionRefusedError(), 1).retry
    assert p.decide(KeyError(), 1).reason == "task_error"


def test_retry_exception_uses_its_delay_and_counts():
    p = policy(max_retries=1)
    assert p.decide(Retry(delay=42), 1).delay == 42
    assert p.decide(Retry(), 1).delay == 1.0  # the backoff
    assert p.decide(Retry(delay=42), 2).reason == "retries_exhausted"
