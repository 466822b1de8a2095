"""defer() inside transactions: publish after the commit, nothing on a rollback."""

from __future__ import annotations

import logging
import time

import pytest
from django.db import transaction
from django.test import override_settings

from deferred import defer
from deferred.core.jobs import Job
from tests.conftest import depth, total_waiting, wait_for
from tests.testapp.tasks import record

pytestmark = [pytest.mark.usefixtures("clean"), pytest.mark.django_db(transaction=True)]


class Rollback(Exception):
    pass


def ready_ids(channel, plan) -> list[str]:
    ids = []
    while True:
        method, _props, body = channel.basic_get(plan.ready_queues["default"].name, auto_ack=True)
        if method is None:
            return ids
        ids.append(Job.decode(body).id)


def test_a_rollback_publishes_nothing(clean, raw_channel):
    with pytest.raises(Rollback), transaction.atomic():
        job_id = defer(record, 0, "p", "rolled-back")
        assert isinstance(job_id, str) and job_id  # the id comes back at once
        raise Rollback
    time.sleep(0.3)
    assert total_waiting(raw_channel, clean) == 0


def test_a_commit_publishes_exactly_once_after_it(clean, raw_channel):
    with transaction.atomic():
        job_id = defer(record, 0, "p", "committed")
        time.sleep(0.2)
        assert total_waiting(raw_channel, clean) == 0, "published before the commit"
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 1, 5)
    time.sleep(0.2)
    assert ready_ids(raw_channel, clean) == [job_id]


def test_a_rolled_back_savepoint_drops_only_its_own_jobs(clean, raw_channel):
    with transaction.atomic():
        kept = defer(record, 0, "p", "outer")
        with pytest.raises(Rollback), transaction.atomic():
            defer(record, 0, "p", "inner")
            raise Rollback
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 1, 5)
    time.sleep(0.2)
    assert ready_ids(raw_channel, clean) == [kept]


def test_publish_at_once_per_call_or_by_setting(clean, raw_channel, broker_url):
    with transaction.atomic():
        record.using(on_commit=False).defer(0, "p", "now")
        assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 1, 5)
        with override_settings(
            DEFERRED={
                "BROKER_URL": broker_url,
                "PREFIX": clean.prefix,
                "QUEUES": ["default", "other"],
                "ON_COMMIT": False,
            }
        ):
            defer(record, 0, "p", "also now")
        assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 2, 5)


def test_a_publish_that_fails_after_the_commit_is_logged_loudly_with_the_job(caplog):
    with override_settings(
        DEFERRED={
            "BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F",
            "QUEUES": ["default", "other"],
        }
    ):
        with caplog.at_level(logging.CRITICAL, logger="deferred"), transaction.atomic():
            job_id = defer(record, 0, "p", "lost?")
    (entry,) = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    message = entry.getMessage()
    assert job_id in message and "NOT published" in message and '"task"' in message


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_with_two_databases_it_waits_for_both_commits(clean, raw_channel):
    # The inner (default) transaction commits, the outer (other) one rolls back.
    with pytest.raises(Rollback), transaction.atomic(using="other"):
        with transaction.atomic():
            defer(record, 0, "p", "two-dbs")
        time.sleep(0.2)
        assert total_waiting(raw_channel, clean) == 0
        raise Rollback
    time.sleep(0.2)
    assert total_waiting(raw_channel, clean) == 0
    # Both commit: published once.
    with transaction.atomic(using="other"), transaction.atomic():
        job_id = defer(record, 0, "p", "both")
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 1, 5)
    assert ready_ids(raw_channel, clean) == [job_id]


def test_defer_many_follows_the_on_commit_rule(clean, raw_channel):
    from deferred import defer_many

    with pytest.raises(Rollback), transaction.atomic():
        defer_many([(record, 0, ("p", "a")), (record, 0, ("p", "b"))])
        raise Rollback
    with transaction.atomic():
        ids = defer_many([(record, 0, ("p", "c")), (record, 0, ("p", "d"))])
        time.sleep(0.2)
        assert total_waiting(raw_channel, clean) == 0
    assert wait_for(lambda: depth(raw_channel, clean.ready_queues["default"].name) == 2, 5)
    assert sorted(ready_ids(raw_channel, clean)) == sorted(ids)
