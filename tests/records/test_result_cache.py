"""The optional results cache (``RESULT_CACHE``) against the real broker: what a worker
puts there and when, that a look-up answers from it without reading the stream and
gives the stream's answer, and that a miss, a forgery or a broken cache reads the
stream instead."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.core.exceptions import ImproperlyConfigured

import deferred
from deferred import cancel, defer
from deferred.conf import get_settings
from deferred.core import signing
from deferred.records import result_cache, result_format, results
from tests.conftest import wait_for
from tests.testapp.tasks import add, always_fails, flaky, record, sleepy

pytestmark = pytest.mark.usefixtures("clean")

ALIAS = "deferred-results"


class BrokenCache(LocMemCache):
    """A cache whose server is gone: every call raises."""

    def get(self, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("cache server gone")

    def set_many(self, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("cache server gone")


@pytest.fixture
def cached(settings) -> Any:
    """RESULT_CACHE on, with a cache of this process (the test's workers are threads)."""
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        ALIAS: {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "r"},
    }
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": ALIAS}
    caches[ALIAS].clear()
    yield caches[ALIAS]
    caches[ALIAS].clear()


def entry_of(job_id: str) -> Any:
    return caches[ALIAS].get(result_cache.cache_key(get_settings(), job_id))


def from_stream(job_id: str, monkeypatch: pytest.MonkeyPatch) -> deferred.Result:
    """The stream's answer alone: what the look-up reads with no cache entry."""
    with monkeypatch.context() as m:
        m.setattr(result_cache, "get", lambda _settings, _job_id: None)
        return deferred.result(job_id)


def no_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of the stream fail the test."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the look-up read the stream")

    monkeypatch.setattr(results, "_read", refuse)


def test_a_finished_job_is_answered_from_the_cache_as_the_stream_answers(
    cached, run_worker, monkeypatch
):
    worker = run_worker(concurrency=1)
    job_id = defer(add, 0, 2, 3)
    assert wait_for(lambda: entry_of(job_id) is not None, 10), "no cache entry"
    stream = from_stream(job_id, monkeypatch)
    assert stream.state == "succeeded" and stream.value == 5
    no_stream(monkeypatch)
    found = deferred.result(job_id)
    assert found == stream
    assert found.worker == worker.worker_id and found.started_at is not None
    assert worker.results is not None and worker.results.cache is not None
    assert worker.results.cache.put >= 1


def test_a_long_job_keeps_its_started_record_in_the_cache(cached, run_worker, records, monkeypatch):
    # It runs past STARTED_AFTER_S: its "started" record goes out on its own first
    run_worker(concurrency=1)
    job_id = defer(sleepy, 0, records, "slow", result_format.STARTED_AFTER_S + 0.3)
    assert wait_for(lambda: deferred.result(job_id).state == "running", 10)
    assert wait_for(lambda: entry_of(job_id) is not None, 10)
    stream = from_stream(job_id, monkeypatch)
    no_stream(monkeypatch)
    found = deferred.result(job_id)
    assert found == stream
    assert found.state == "succeeded" and found.workers and found.started_at is not None
    assert found.finished_at is not None and found.finished_at > found.started_at


def test_cancelled_and_superseded_jobs_are_cached(cached, run_worker, records, monkeypatch):
    gone = defer(record, 0.3, records, "never")
    cancel(gone)
    older = defer(record.using(key="cache:superseded"), 0.3, records, "older")
    defer(record.using(key="cache:superseded"), 0.4, records, "newer")
    run_worker(concurrency=1)
    assert wait_for(lambda: entry_of(gone) is not None and entry_of(older) is not None, 10)
    no_stream(monkeypatch)
    assert deferred.result(gone).outcome == "cancelled"
    assert deferred.result(older).outcome == "superseded"


def test_retried_and_failed_jobs_are_not_cached_and_read_the_stream(cached, run_worker, records):
    # Earlier attempts' records were written by whichever worker ran them, and a
    # failed job may be re-driven: only the stream has the whole story.
    run_worker(concurrency=2)
    retried = defer(flaky, 0, records, "flaky", 1)
    failed = defer(always_fails, 0, records, "doomed")
    plain = defer(add, 0, 1, 1)
    assert wait_for(lambda: deferred.result(retried).state == "succeeded", 20)
    assert wait_for(lambda: deferred.result(failed).state == "failed", 20)
    assert wait_for(lambda: entry_of(plain) is not None, 10)
    assert entry_of(retried) is None and entry_of(failed) is None
    done = deferred.result(retried)
    assert done.attempts == 2 and len(done.errors) == 1
    assert len(deferred.result(failed).errors) == 3


def test_an_evicted_entry_reads_the_stream(cached, run_worker):
    run_worker(concurrency=1)
    job_id = defer(add, 0, 4, 4)
    assert wait_for(lambda: entry_of(job_id) is not None, 10)
    cached.clear()
    found = deferred.result(job_id)
    assert found.state == "succeeded" and found.value == 8 and found.complete


def test_a_forged_entry_is_ignored(cached, run_worker, records):
    job_id = defer(record, 30, records, "later")
    forged = result_format.encode([{"id": job_id, "ev": "succeeded", "at": time.time(), "a": 1}])
    key = result_cache.cache_key(get_settings(), job_id)
    cached.set(key, (forged, signing.sign(forged, ("not-the-key",))))
    assert deferred.result(job_id).state == "pending"
    cached.set(key, (forged, {}))  # unsigned
    assert deferred.result(job_id).state == "pending"
    cached.set(key, "not an entry")
    assert deferred.result(job_id).state == "pending"


def test_a_record_the_stream_did_not_take_is_not_cached(cached, run_worker, records, monkeypatch):
    from deferred.broker import results as broker_results

    monkeypatch.setattr(broker_results, "RETRY_FOR_S", 0.5)
    worker = run_worker(concurrency=1)
    assert worker.results is not None
    # The results stream's broker is unreachable for this worker's writer
    worker.results.writer.urls = ("amqp://guest:guest@127.0.0.1:1/%2F",)
    worker.results.writer.timeout = 0.5
    job_id = defer(record, 0, records, "unrecorded")
    assert wait_for(lambda: worker.results is not None and worker.results.writer.lost >= 1, 10)
    time.sleep(0.2)
    assert entry_of(job_id) is None
    assert worker.results.cache is not None and worker.results.cache.put == 0


def test_a_broken_cache_costs_nothing_but_a_warning(settings, run_worker, caplog):
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        ALIAS: {"BACKEND": f"{__name__}.BrokenCache"},
    }
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": ALIAS}
    monkey_last = result_cache._last_warning
    result_cache._last_warning = 0.0
    try:
        with caplog.at_level(logging.WARNING, logger="deferred.results"):
            worker = run_worker(concurrency=1)
            job_id = defer(add, 0, 3, 3)
            assert wait_for(lambda: deferred.result(job_id).state == "succeeded", 10)
            assert wait_for(
                lambda: (
                    worker.results is not None
                    and worker.results.cache is not None
                    and worker.results.cache.failed >= 1
                ),
                10,
            )
    finally:
        result_cache._last_warning = monkey_last
    assert deferred.result(job_id).value == 6
    assert "results cache (RESULT_CACHE)" in caplog.text
    assert worker.outcomes["succeeded"] >= 1


# ------------------------------------------------------------------ settings


def test_result_cache_must_name_a_configured_cache(settings):
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": "nope"}
    with pytest.raises(ImproperlyConfigured, match=r"RESULT_CACHE.*alias of CACHES"):
        get_settings()
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": 1}
    with pytest.raises(ImproperlyConfigured, match="RESULT_CACHE"):
        get_settings()


def test_result_cache_timeout_is_checked(settings):
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE_TIMEOUT": 0.5}
    with pytest.raises(ImproperlyConfigured, match=r"RESULT_CACHE_TIMEOUT.*1 second"):
        get_settings()
    settings.DEFERRED = {
        **settings.DEFERRED,
        "RESULT_TTL": timedelta(hours=1),
        "RESULT_CACHE_TIMEOUT": timedelta(hours=2),
    }
    assert get_settings().result_cache_timeout_s == 3600  # no longer than the stream keeps
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE_TIMEOUT": "soon"}
    with pytest.raises(ImproperlyConfigured, match="RESULT_CACHE_TIMEOUT"):
        get_settings()


def test_result_cache_defaults_to_off_for_an_hour(settings):
    current = get_settings()
    assert current.result_cache is None and current.result_cache_timeout_s == 3600
    # A RESULT_TTL under the default hour is still valid, and bounds the cache's
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_TTL": timedelta(minutes=30)}
    assert get_settings().result_cache_timeout_s == 1800
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": "default"}
    assert get_settings().result_cache == "default"


def test_check_warns_of_a_cache_each_process_has_its_own(settings, tmp_path):
    from deferred.checks import check_result_cache

    assert check_result_cache() == []
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": "default"}
    (warning,) = check_result_cache()
    assert warning.id == "deferred.W006" and "LocMemCache" in warning.msg
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "shared": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(tmp_path),
        },
    }
    settings.DEFERRED = {**settings.DEFERRED, "RESULT_CACHE": "shared"}
    assert check_result_cache() == []
