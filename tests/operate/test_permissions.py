"""Least-privilege users made with rabbitmqctl from the exported permissions, on the real broker."""

from __future__ import annotations

import json
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pika
import pika.exceptions as px
import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.test import override_settings

import deferred
from deferred import cancel, defer
from deferred.conf import get_settings
from deferred.core.topology import Plan
from deferred.operate import permissions
from tests.conftest import depth, rabbitmqctl, wait_for
from tests.testapp.framework_tasks import double
from tests.testapp.tasks import flaky, read_records, record

PASSWORD = "pw-" + uuid.uuid4().hex[:12]
ACCESS_REFUSED = 403


def url(user: str) -> str:
    return f"amqp://{user}:{PASSWORD}@127.0.0.1:5672/%2F"


@pytest.fixture
def users(own_topology: Plan) -> Iterator[dict[str, str]]:
    """The three users, imported with rabbitmqctl from the exported definitions."""
    out = StringIO()
    call_command("declare_delay_topology", "--format", "definitions", "--users", stdout=out)
    document = json.loads(out.getvalue())
    names = {entry["name"].rsplit("-", 1)[1]: entry["name"] for entry in document["users"]}
    # rabbitmqctl reads the file as the rabbitmq user: a world-readable one in /tmp.
    path = Path(tempfile.gettempdir()) / f"deferred-definitions-{uuid.uuid4().hex}.json"
    path.write_text(out.getvalue())
    path.chmod(0o644)
    try:
        rabbitmqctl("import_definitions", str(path))
        # The import runs in the background: wait for its users and permissions.
        listed = lambda: rabbitmqctl("list_permissions", "-p", "/", "-q")  # noqa: E731
        assert wait_for(lambda: all(name in listed() for name in names.values()), 30)
        for name in names.values():
            rabbitmqctl("change_password", name, PASSWORD)
        yield names
    finally:
        path.unlink(missing_ok=True)
        for name in names.values():
            subprocess.run(["rabbitmqctl", "delete_user", name], capture_output=True, timeout=60)


def as_user(user: str, **changes):
    return override_settings(
        DEFERRED={
            **django_settings.DEFERRED,
            "PREFIX": get_settings().prefix,
            "BROKER_URL": url(user),
            "DECLARE": False,
            **changes,
        }
    )


def refused(user: str, action) -> bool:
    """Whether ``action(channel)`` is refused (403) for ``user``."""
    connection = pika.BlockingConnection(pika.URLParameters(url(user)))
    try:
        channel = connection.channel()
        channel.confirm_delivery()  # a refused publish then raises here, not later
        action(channel)
    except px.ChannelClosedByBroker as exc:
        return exc.reply_code == ACCESS_REFUSED
    finally:
        if connection.is_open:
            connection.close()
    return False


def test_the_export_lists_three_users_without_passwords(own_topology):
    out = StringIO()
    call_command("declare_delay_topology", "--format", "definitions", "--users", stdout=out)
    document = json.loads(out.getvalue())
    prefix = own_topology.prefix
    assert [u["name"] for u in document["users"]] == [
        f"{prefix}-publisher",
        f"{prefix}-worker",
        f"{prefix}-admin",
    ]
    assert not any("password" in key for u in document["users"] for key in u)
    publisher = permissions.for_role("publisher", prefix)
    assert document["permissions"][0]["write"] == publisher.write
    # Without --users, no users.
    out = StringIO()
    call_command("declare_delay_topology", "--format", "definitions", stdout=out)
    assert "users" not in json.loads(out.getvalue())


def test_the_publisher_can_defer_cancel_list_and_move_and_nothing_else(
    users, own_topology, raw_channel
):
    publisher = users["publisher"]
    ready = own_topology.ready_queues["default"].name
    with as_user(publisher):
        job_id = defer(record, 60, "/tmp/never", "by the publisher")
        cancel(job_id)
        # It reads results: the results stream, and a marker through the ingest exchange
        # (a job due now: one not due yet is answered without a read).
        assert deferred.result(defer(record, 0, "/tmp/never", "now")).state == "pending"
        # And a django.tasks task not started yet, enqueued elsewhere: from the ledger,
        # its marker through the ingest exchange too.
        from deferred.django_tasks import backend as backends

        enqueued = double.enqueue(3)
        backends._enqueued.clear()
        backend = backends.api.task_backends["default"]
        assert backend.get_result(enqueued.id).status.name == "READY"
        # It lists the pending jobs (the ledger, its checkpoints, the cancels) and moves one.
        kept = defer(record, 60, "/tmp/never", "kept")
        assert kept in [job.id for job in deferred.pending()]
        deferred.reschedule(kept, 120)
        assert [job.moved for job in deferred.pending() if job.id == kept] == [True]
    assert wait_for(
        lambda: sum(depth(raw_channel, q.name) for q in own_topology.delay_queues) == 3, 5
    )
    assert refused(publisher, lambda ch: ch.basic_consume(ready, lambda *a: None))
    assert refused(publisher, lambda ch: ch.basic_get(ready))
    assert refused(publisher, lambda ch: ch.queue_purge(ready))
    assert refused(publisher, lambda ch: ch.queue_delete(ready))
    assert refused(publisher, lambda ch: ch.queue_declare(f"{own_topology.prefix}.mine"))
    # Straight into a ready queue (default exchange), or past the delays (a level exchange):
    assert refused(publisher, lambda ch: ch.basic_publish("", ready, b"{}"))
    level = next(e.name for e in own_topology.exchanges if ".after." in e.name)
    assert refused(publisher, lambda ch: ch.basic_publish(level, "0.0.default", b"{}"))
    assert refused(
        publisher, lambda ch: ch.basic_consume(own_topology.failed_queue.name, lambda *a: None)
    )


def test_the_worker_runs_retries_and_fails_jobs_but_cannot_delete(
    users, own_topology, run_worker, records, raw_channel
):
    with as_user(users["publisher"]):
        defer(record, 0.2, records, "ran")
        defer(flaky, 0, records, "retried", 1)
    with as_user(users["worker"]):
        worker = run_worker()
        assert wait_for(
            lambda: (
                sorted(r["label"] for r in read_records(records)) == ["ran", "retried", "retried"]
            ),
            15,
        )
        assert wait_for(lambda: worker.outcomes["retrying"] == 1, 5), worker.outcomes
        # A failure record goes to the failed queue, and a re-drive brings it back.
        defer(record, 0, "/nonexistent/dir/file", "fails")
        assert wait_for(lambda: depth(raw_channel, own_topology.failed_queue.name) == 1, 10)
        out = StringIO()
        call_command("deferred_failed", "retry", "--all", stdout=out)
        assert "1 job re-queued" in out.getvalue()
    ready = own_topology.ready_queues["default"].name
    assert refused(users["worker"], lambda ch: ch.queue_delete(ready))
    assert refused(users["worker"], lambda ch: ch.queue_declare(f"{own_topology.prefix}.mine"))


def test_the_admin_declares_a_topology(users, own_topology):
    with as_user(users["admin"], DECLARE=True, RADIX=8):
        out = StringIO()
        call_command("declare_delay_topology", stdout=out)
        assert "Declared topology r8." in out.getvalue()
        call_command("declare_delay_topology", "--check", stdout=StringIO())
