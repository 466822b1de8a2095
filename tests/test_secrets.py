"""A broker password never shows: logs, errors, status, the page, exports, dry runs."""

from __future__ import annotations

import logging
import subprocess
import uuid
from collections.abc import Iterator
from io import StringIO

import pytest
from django.conf import settings as django_settings
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings

from deferred import BrokerError, cancel, defer
from deferred.core.topology import Plan
from tests.conftest import rabbitmqctl, wait_for
from tests.testapp.tasks import explode, read_records, record

PASSWORD = f"Recognisable-Pw-{uuid.uuid4().hex[:8]}"
USER = f"deferred-secret-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def secret_user(own_topology: Plan) -> Iterator[str]:
    rabbitmqctl("add_user", USER, PASSWORD)
    rabbitmqctl("set_permissions", "-p", "/", USER, ".*", ".*", ".*")
    rabbitmqctl("set_user_tags", USER, "administrator")
    url = f"amqp://{USER}:{PASSWORD}@127.0.0.1:5672/%2F"
    try:
        with override_settings(
            DEFERRED={
                **django_settings.DEFERRED,
                "PREFIX": own_topology.prefix,
                "BROKER_URL": url,
                # The test runs in a transaction (it makes a staff user): publish now.
                "ON_COMMIT": False,
            }
        ):
            yield url
    finally:
        subprocess.run(["rabbitmqctl", "delete_user", USER], capture_output=True, timeout=60)


def run(*args: str) -> str:
    out, err = StringIO(), StringIO()
    try:
        call_command(*args, stdout=out, stderr=err)
    except CommandError as exc:
        return out.getvalue() + err.getvalue() + str(exc)
    return out.getvalue() + err.getvalue()


@pytest.mark.alone
def test_the_password_is_in_no_output(
    secret_user, run_worker, records, caplog, capsys, django_user_model
):
    # Jobs that run and fail, a cancel, a worker that loses its connection,
    run_worker()
    defer(record, 0, records, "ran")
    defer(explode, 0, "boom")
    cancel(defer(record, 5, records, "cancelled"))
    assert wait_for(lambda: len(read_records(records)) == 1, 10)
    rabbitmqctl("close_all_connections", "test: the password must not show")
    defer(record, 0.2, records, "after")
    assert wait_for(lambda: len(read_records(records)) == 2, 20)
    # the commands' outputs,
    outputs = [
        run("deferred_status"),
        run("deferred_status", "--json"),
        run("deferred_failed", "list", "--json"),
        run("declare_delay_topology", "--dry-run"),
        run("declare_delay_topology", "--dry-run", "--format", "json"),
        run("declare_delay_topology", "--format", "definitions", "--users"),
        run("declare_delay_topology", "--format", "terraform"),
        run("declare_delay_topology", "--list"),
        run("deferred_schedules", "--json"),
    ]
    # the status page,
    staff = django_user_model.objects.create_user("ops", password="x", is_staff=True)
    client = Client()
    client.force_login(staff)
    page = client.get("/deferred/")
    assert page.status_code == 200
    outputs.append(page.content.decode())
    # the checks,
    outputs += [str(m) for m in run_checks(include_deployment_checks=True)]
    # and the errors of a broker that refuses the password or does not answer.
    for bad in (
        f"amqp://{USER}:{PASSWORD}-wrong@127.0.0.1:5672/%2F",
        f"amqp://{USER}:{PASSWORD}@127.0.0.1:1/%2F",
    ):
        with override_settings(
            DEFERRED={**django_settings.DEFERRED, "BROKER_URL": bad, "PUBLISH_TIMEOUT": 3}
        ):
            with pytest.raises(BrokerError) as caught:
                defer(record, 1, records, "never")
            outputs.append(str(caught.value))
            outputs.append(repr(caught.value))
            outputs.append(run("deferred_status"))
            outputs.append(run("declare_delay_topology"))
    captured = capsys.readouterr()
    # Each log record as a handler would write it, tracebacks included.
    outputs += [captured.out, captured.err, *map(logging.Formatter().format, caplog.records)]
    assert len(outputs) > 20 and all(outputs[:9])
    leaked = [text[:300] for text in outputs if PASSWORD in text]
    assert not leaked, leaked
