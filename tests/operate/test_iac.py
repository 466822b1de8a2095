"""Infrastructure as code on the real broker: definitions imported with
``rabbitmqctl import_definitions`` into a fresh vhost, then ``DECLARE = False``.

Each test gets a vhost of its own (and deletes it), so "nothing is declared"
can be checked on a broker that really has nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from deferred import defer, defer_many
from deferred.broker import TopologyNotDeclared, admin_channel
from deferred.conf import get_settings
from deferred.core.topology import Plan, plan_topology
from deferred.producer import publishing
from deferred.worker import Worker
from tests.conftest import rabbitmqctl, wait_for
from tests.testapp.tasks import read_records, record

HOST = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture
def vhost(broker_url: str) -> Iterator[str]:
    """A fresh, empty vhost the guest user may use; deleted with everything in it."""
    name = f"deferred-iac-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


def settings_for(vhost: str, **values: Any) -> dict[str, Any]:
    return {
        "BROKER_URL": HOST + vhost,
        "PREFIX": f"iac-{uuid.uuid4().hex[:6]}",
        "QUEUES": ["default", "other"],
        "RADIX": 16,
        "MAX_DELAY": 60,
        "DECLARE": False,
        **values,
    }


def run(*args: str) -> str:
    out = StringIO()
    call_command("declare_delay_topology", *args, stdout=out)
    return out.getvalue()


def current_plan() -> Plan:
    return plan_topology(get_settings())


def import_definitions(url: str) -> None:
    """What an operator does: print the definitions, import them, wait until they are there.

    The document goes in as a world-readable file under /tmp: rabbitmqctl may
    run as another user, who cannot read the test's temporary directory, and
    RabbitMQ 4.0's CLI never returns when it is given the document on
    standard input. The import is asynchronous: rabbitmqctl returns before it
    is done.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir="/tmp") as document:
        document.write(run("--format", "definitions"))
        document.flush()
        os.chmod(document.name, 0o644)
        subprocess.run(
            ["rabbitmqctl", "import_definitions", document.name],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
    plan = current_plan()

    def complete() -> bool:
        with admin_channel(url) as admin:
            return admin.missing(plan) == []

    assert wait_for(complete, 30, interval=0.2), "the imported topology did not appear"


def test_imported_definitions_run_jobs_with_declare_off(vhost, tmp_path, run_worker, records):
    with override_settings(DEFERRED=settings_for(vhost)):
        import_definitions(HOST + vhost)
        plan = current_plan()
        out = run()
        assert "DECLARE'] is False: nothing was declared" in out and "is complete" in out
        # The check recorded this version in the registry (imported definitions
        # have no record), and --list shows it.
        with admin_channel(HOST + vhost) as admin:
            assert [r["topology"] for r in admin.topology_records(plan)] == [plan.topology_id]
        run()  # recorded once, however often it runs
        with admin_channel(HOST + vhost) as admin:
            assert admin.message_count(plan.registry_queue.name) == 1
        (row,) = json.loads(run("--list", "--format", "json"))
        # Where the management API answers, the row also counts the queue
        # leaders per node: every queue of this one-node broker leads there.
        leaders = row.pop("leaders", None)
        assert leaders is None or (len(leaders) == 1 and sum(leaders.values()) > 0), leaders
        assert row == {
            "topology": plan.topology_id,
            "current": True,
            "pending": 0,
            "removed": False,
        }

        run_worker(concurrency=4)
        start = time.time()
        due = {}
        for n in range(20):
            wait = (n % 5) * 0.15 + n * 0.003  # 0 to ~0.66 s, several hops each
            due[str(n)] = start + wait
            defer(record, wait, records, str(n))
        defer_many([(record, 0.2, (records, "many-a")), (record, 0.05, (records, "many-b"))])
        due["many-a"], due["many-b"] = start + 0.2, start + 0.05
        assert wait_for(lambda: len(read_records(records)) >= len(due), 15)
        time.sleep(0.2)
        runs = read_records(records)
        assert sorted(r["label"] for r in runs) == sorted(due)  # each exactly once
        assert all(r["at"] >= due[r["label"]] for r in runs)  # none early
        with admin_channel(HOST + vhost) as admin:
            assert admin.message_count(plan.failed_queue.name) == 0

    # The app and the definitions agree to the last argument: declaring over
    # the imported topology creates nothing and raises no 406.
    with override_settings(
        DEFERRED={**settings_for(vhost), "PREFIX": plan.prefix, "DECLARE": True}
    ):
        assert "nothing changed" in run()


def test_defer_checks_the_topology_once_per_process(vhost, monkeypatch):
    from deferred import broker

    checks = []
    # defer() checks only the ingest exchange it publishes to (a publisher's
    # broker user may have no right on the rest).
    real = broker.verify_exchange
    monkeypatch.setattr(
        broker, "verify_exchange", lambda *a, **kw: checks.append(a) or real(*a, **kw)
    )
    with override_settings(DEFERRED=settings_for(vhost)):
        import_definitions(HOST + vhost)
        for n in range(3):
            defer(record, 0, "/dev/null", str(n))
        defer_many([(record, 0, ("/dev/null", "a")), (record, 0, ("/dev/null", "b"))])
        assert len(checks) == 1
        # A forked child (another process id) checks for itself.
        monkeypatch.setattr(publishing.os, "getpid", lambda: -1)
        defer(record, 0, "/dev/null", "child")
        assert len(checks) == 2


def test_imported_quorum_definitions_match_what_the_app_declares(vhost, tmp_path):
    values = settings_for(vhost, QUEUE_TYPE="quorum", RADIX=8, MAX_DELAY=1)
    with override_settings(DEFERRED=values):
        import_definitions(HOST + vhost)
    with override_settings(DEFERRED={**values, "DECLARE": True}):
        assert "nothing changed" in run()


def test_declare_off_on_an_empty_vhost_declares_nothing_and_names_what_is_missing(
    vhost, tmp_path, worker_process, monkeypatch
):
    with override_settings(DEFERRED=settings_for(vhost)):
        plan = current_plan()
        with pytest.raises(TopologyNotDeclared) as caught:
            defer(record, 0.1, "/dev/null", "x")
        message = str(caught.value)
        assert "DECLARE'] is False" in message and plan.ingest_exchange in message
        assert "--format definitions" in message
        with pytest.raises(TopologyNotDeclared, match="DECLARE'] is False"):
            defer_many([(record, 0.1, ("/dev/null", "x"))])

        with pytest.raises(CommandError) as caught_command:
            run()
        listed = str(caught_command.value)
        assert "nothing was declared" in listed
        everything = [
            *(f"exchange {e.name}" for e in plan.all_exchanges),
            *(f"queue {q.name}" for q in plan.all_queues),
        ]
        assert [line[2:] for line in listed.splitlines() if line.startswith("  ")] == everything

        worker = Worker(install_signal_handlers=False)
        with pytest.raises(TopologyNotDeclared, match="DECLARE'] is False"):
            worker.run()

        with pytest.raises(CommandError, match="deletes nothing"):
            run("--remove-empty")

        with admin_channel(HOST + vhost) as admin:
            assert admin.missing(plan) == everything
            assert not admin.queue_exists(plan.registry_queue.name)

    # The worker command exits non-zero with the message instead of waiting.
    monkeypatch.setenv("DEFERRED_BROKER_URL", HOST + vhost)
    monkeypatch.setenv("DEFERRED_TEST_DECLARE", "false")
    process = worker_process(expect_exit=True)
    assert process.wait(30) == 1
    output = process.output()
    assert "DECLARE'] is False" in output and "CommandError" in output
    prefix = os.environ["DEFERRED_TEST_PREFIX"]  # the subprocess's settings
    assert f"exchange {prefix}.failed" in output and "Worker consuming" not in output


def test_declare_off_names_exactly_the_missing_piece(vhost, tmp_path):
    with override_settings(DEFERRED=settings_for(vhost)):
        import_definitions(HOST + vhost)
        plan = current_plan()
        gone = plan.delay_queues[-1].name
        with admin_channel(HOST + vhost) as admin:
            admin.channel.queue_delete(gone)
            admin.channel.exchange_delete(plan.ingest_exchange)
        with pytest.raises(CommandError) as caught:
            run()
        assert f"2 of its {len(plan.all_exchanges) + len(plan.all_queues)}" in str(caught.value)
        assert str(caught.value).count("\n  ") == 2
        assert f"  exchange {plan.ingest_exchange}\n  queue {gone}\n" in str(caught.value)

        with pytest.raises(TopologyNotDeclared) as raised:
            Worker(install_signal_handlers=False).run()
        assert f"exchange {plan.ingest_exchange}, queue {gone}." in str(raised.value)


def test_check_verifies_without_declaring_when_declare_is_on(vhost):
    with override_settings(DEFERRED=settings_for(vhost, DECLARE=True)):
        with pytest.raises(CommandError, match="or run this command without --check"):
            run("--check")
        with admin_channel(HOST + vhost) as admin:
            assert not admin.exchange_exists(current_plan().ingest_exchange)
        run()
        assert "is complete" in run("--check")
        assert json.loads(run("--check", "--format", "json"))["missing"] == []


def test_publishing_to_a_missing_exchange_names_it(vhost):
    # DECLARE on: no passive check first, so the publish itself must say what is missing.
    with override_settings(DEFERRED=settings_for(vhost, DECLARE=True)):
        with pytest.raises(TopologyNotDeclared) as caught:
            defer(record, 0.1, "/dev/null", "x")
        assert f"Exchange {current_plan().ingest_exchange!r} does not exist" in str(caught.value)
