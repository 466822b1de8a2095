"""The worker's intake (size, signature, format), property-based: no input breaks it."""

from __future__ import annotations

import json
from datetime import timedelta

from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deferred.conf import get_settings
from deferred.core import intake, signing
from deferred.core.jobs import INVALID, UNDECODABLE, Job, utcnow
from deferred.records import failures
from tests.conftest import record_job

REASONS = {intake.TOO_LARGE, intake.BAD_SIGNATURE, UNDECODABLE, INVALID}
LIMIT = 4096


def configured():
    """The test settings with a small limit (built once: they do not change)."""
    from django.conf import settings as django_settings

    if not _configured:
        with override_settings(DEFERRED={**django_settings.DEFERRED, "MAX_MESSAGE_BYTES": LIMIT}):
            _configured.append(get_settings())
    return _configured[0]


_configured: list = []


def signed(body: bytes) -> dict:
    return signing.sign(body, configured().signing_keys)


def a_job(**changes) -> Job:
    return record_job("/tmp/x", "label", **changes)


def check(body: bytes, headers) -> Job | intake.Refused:
    result = intake.read(body, headers, configured())
    assert isinstance(result, Job | intake.Refused)
    if isinstance(result, intake.Refused):
        assert result.reason in REASONS
        assert isinstance(result.detail, str) and result.detail
    return result


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)
header_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text() | st.binary(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3)
    ),
    max_leaves=8,
)
headers = st.none() | st.dictionaries(
    st.sampled_from([signing.HEADER, "x-death", "x-deferred-deliveries", "other"]),
    header_values,
    max_size=4,
)
FIELDS = ["version", "id", "task", "args", "kwargs", "due", "queue", "attempt", "created"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=LIMIT * 2), headers=headers)
def test_random_bytes_and_headers_never_raise(body, headers):
    result = check(body, headers)
    if len(body) > LIMIT:
        assert result.reason == intake.TOO_LARGE and not result.keep_body


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values)
def test_random_json_signed_or_not_maps_to_a_reason(value):
    body = json.dumps(value).encode()
    for hdrs in (None, signed(body)):
        result = check(body, hdrs)
        assert isinstance(result, intake.Refused)  # no random value is a whole job
        if hdrs is None:
            assert result.reason == intake.BAD_SIGNATURE


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(FIELDS),
    value=json_values,
)
def test_a_field_of_the_wrong_type_is_invalid_not_an_error(field, value):
    data = a_job().to_dict()
    data[field] = value
    body = json.dumps(data).encode()
    result = check(body, signed(body))
    if isinstance(result, intake.Refused):
        assert result.reason in (INVALID, intake.TOO_LARGE)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(min_value=0, max_value=400))
def test_a_truncated_body_is_refused(cut):
    body = a_job().encode()
    part = body[: min(cut, len(body) - 1)]
    assert check(part, signed(body)).reason == intake.BAD_SIGNATURE
    assert check(part, signed(part)).reason in (UNDECODABLE, INVALID)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255))
def test_one_altered_byte_breaks_the_signature(position, flip):
    body = bytearray(a_job().encode())
    headers = signed(bytes(body))
    body[position % len(body)] ^= flip
    assert check(bytes(body), headers).reason == intake.BAD_SIGNATURE


def test_deeply_nested_and_huge_bodies():
    deep = b"[" * 100_000 + b"]" * 100_000
    assert check(deep, signed(deep)).reason == intake.TOO_LARGE
    nested = b"[" * 2000 + b"]" * 2000  # under the limit, deeper than json's recursion
    assert check(nested, signed(nested)).reason in (UNDECODABLE, INVALID)
    digits = b"1" * 4000  # beyond int's digit limit
    assert check(digits, signed(digits)).reason == UNDECODABLE


def test_a_signed_job_is_read_and_the_same_unsigned_is_refused():
    job = a_job(args=("/tmp/y", "ok"), due=utcnow() + timedelta(seconds=5))
    body = job.encode()
    assert check(body, signed(body)) == job
    refused = check(body, {})
    assert refused.reason == intake.BAD_SIGNATURE and "not signed" in refused.detail
    other = signing.sign(body, ("another key",))
    assert "does not match" in check(body, other).detail


record_like = st.fixed_dictionaries(
    {"reason": json_values, "job": json_values},
    optional={
        "id": json_values,
        "task": json_values,
        "attempts": json_values,
        "error": json_values,
        "detail": json_values,
        "due": json_values,
        "raw_body": json_values,
        "raw_body_base64": json_values,
    },
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.binary(max_size=300) | record_like.map(lambda r: json.dumps(r).encode()),
    headers=headers,
    message_id=st.none() | st.text(max_size=40),
)
def test_the_failed_queue_reader_shows_anything_without_raising(body, headers, message_id):
    entry = failures.parse_failed(body, headers or {}, message_id, configured().signing_keys)
    assert isinstance(entry.reason, str) and isinstance(entry.id, str)
    assert entry.task is None or isinstance(entry.task, str)
    assert entry.to_json()["reason"] == entry.reason
    assert not entry.trusted or signing.HEADER in (headers or {})
