"""Parsing and rounding delays (pure)."""

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from deferred.core.delays import InvalidDelay, delay_ms

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def ms(delay, resolution_ms=1, max_delay_ms=10**12):
    return delay_ms(delay, now=NOW, resolution_ms=resolution_ms, max_delay_ms=max_delay_ms)


@pytest.mark.parametrize(
    ("delay", "expected"),
    [
        (0, 0),
        (1, 1000),
        (0.3, 300),
        (0.0001, 1),  # rounded up, never down
        (2.5, 2500),
        (Decimal("0.0015"), 2),
        (timedelta(milliseconds=1.5), 2),
        (timedelta(hours=24), 86_400_000),
        (NOW + timedelta(seconds=3), 3000),
        (NOW - timedelta(days=3), 0),  # the past means now
        (datetime(2026, 1, 1, 13, 0, tzinfo=timezone(timedelta(hours=1))), 0),  # same instant
    ],
)
def test_valid_delays(delay, expected):
    assert ms(delay) == expected


def test_rounds_up_to_the_resolution():
    assert ms(0.001, resolution_ms=1000) == 1000
    assert ms(1.0, resolution_ms=1000) == 1000
    assert ms(1.001, resolution_ms=1000) == 2000


@pytest.mark.parametrize("delay", [-1, -0.001, timedelta(seconds=-1), float("nan"), float("inf")])
def test_negative_or_non_finite_is_a_value_error(delay):
    with pytest.raises(ValueError):
        ms(delay)


def test_naive_datetime_is_a_value_error():
    with pytest.raises(InvalidDelay, match="naive"):
        ms(datetime(2026, 1, 1, 12, 0))


def test_without_use_tz_a_naive_datetime_is_a_local_time_in_time_zone():
    # USE_TZ = False: timezone.now() is naive, so "now + 5 s" must be accepted,
    # and read in TIME_ZONE (UTC+1 here: 13:00:05 local is 12:00:05 UTC).
    from django.test import override_settings

    with override_settings(USE_TZ=False, TIME_ZONE="Europe/Paris"):
        assert ms(datetime(2026, 1, 1, 13, 0, 5)) == 5_000
    with pytest.raises(InvalidDelay, match="naive"):
        ms(datetime(2026, 1, 1, 13, 0, 5))  # USE_TZ = True again


def test_above_the_maximum_is_a_value_error():
    assert ms(10, max_delay_ms=10_000) == 10_000
    with pytest.raises(InvalidDelay, match="MAX_DELAY"):
        ms(10.001, max_delay_ms=10_000)
    with pytest.raises(InvalidDelay, match="MAX_DELAY"):
        ms(1e300, max_delay_ms=10_000)


@pytest.mark.parametrize("delay", ["10", None, True, [1], 1j])
def test_wrong_types_are_type_errors(delay):
    with pytest.raises(TypeError):
        ms(delay)
