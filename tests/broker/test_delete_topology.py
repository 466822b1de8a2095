"""declare_delay_topology --delete against the real broker: a whole PREFIX or one old
topology, listed first, refused while jobs wait or workers read, asked, forced."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from deferred import defer
from deferred.conf import get_settings
from deferred.core.topology import plan_topology
from deferred.operate.removal import prefix_removal, topology_removal
from tests.broker.test_declare import current_plan, own_prefix, run
from tests.conftest import rabbitmqctl, wait_for
from tests.testapp.tasks import record


def on_broker(prefix: str) -> tuple[list[str], list[str]]:
    """The queues and exchanges whose names start with ``prefix.``."""
    queues = rabbitmqctl("list_queues", "name", "-q", "--no-table-headers").split()
    exchanges = rabbitmqctl("list_exchanges", "name", "-q", "--no-table-headers").split()
    return (
        [q for q in queues if q.startswith(f"{prefix}.")],
        [e for e in exchanges if e.startswith(f"{prefix}.")],
    )


def test_a_dry_run_lists_and_removes_nothing(broker_url):
    with own_prefix(broker_url) as prefix:
        run()
        before = on_broker(prefix)
        out = run("--delete", "--dry-run")
        assert f"PREFIX '{prefix}'" in out and "no job in them" in out
        assert "Dry run: nothing was removed." in out
        # A few lines; every name with -v 2
        plan = current_plan()
        assert f"{len(plan.all_queues)} queues and {len(plan.all_exchanges)} exchanges" in out
        assert len(out.splitlines()) <= 4 and "-v 2" in out, out
        named = run("--delete", "--dry-run", "-v", "2")
        assert f"queue     {plan.ready_queues['default'].name}" in named
        assert len(named.splitlines()) > len(plan.all_queues)
        assert on_broker(prefix) == before


def test_delete_refuses_while_jobs_wait_then_force_removes_the_whole_prefix(
    broker_url, records, tmp_path
):
    with own_prefix(broker_url) as prefix:
        run()
        defer(record, 30, records, "waiting")
        with pytest.raises(CommandError) as refused:
            run("--delete", "--yes")
        message = str(refused.value)
        assert "1 job waits there" in message and "--force" in message
        assert "1 job would be lost" in message
        assert on_broker(prefix)[0], "nothing may go on a refusal"

        out = run("--delete", "--yes", "--force")
        assert f"Removed PREFIX '{prefix}'" in out and "1 job lost" in out
        assert on_broker(prefix) == ([], [])  # every queue and exchange of it
        assert "Nothing of" in run("--delete", "--yes")


def test_delete_asks_and_no_answer_is_no(broker_url, monkeypatch):
    with own_prefix(broker_url) as prefix:
        run()
        monkeypatch.setattr("builtins.input", lambda question: "n")
        with pytest.raises(CommandError, match="Not confirmed: nothing was removed"):
            run("--delete")
        assert on_broker(prefix)[0]

        def no_terminal(question: str) -> str:
            raise EOFError

        monkeypatch.setattr("builtins.input", no_terminal)
        with pytest.raises(CommandError, match="Not confirmed"):
            run("--delete")
        asked: list[str] = []
        monkeypatch.setattr("builtins.input", lambda question: asked.append(question) or "y")
        assert "Removed" in run("--delete")
        assert asked and asked[0].startswith("Remove ") and "exchanges of PREFIX" in asked[0]
        assert on_broker(prefix) == ([], [])


def test_delete_refuses_while_a_worker_reads_there(broker_url, run_worker):
    with own_prefix(broker_url):
        run()
        worker = run_worker(settings=get_settings())
        with pytest.raises(CommandError, match=r"consumers? \(workers\) reads? there"):
            run("--delete", "--yes")
        worker.stop()
        assert wait_for(lambda: not worker.consuming.is_set(), 10)


def test_delete_one_old_topology_keeps_the_shared_queues_and_the_current_one(broker_url):
    with own_prefix(broker_url, PRIORITIES=False) as prefix:
        run()
        old = current_plan()
        with override_settings(DEFERRED={**get_settings_values(), "PRIORITIES": True}):
            run()
            new = current_plan()
            assert old.topology_id in run("--list")
            with pytest.raises(CommandError, match="is the topology these settings use"):
                run("--delete", "--topology", new.topology_id, "--yes")
            with pytest.raises(CommandError, match="No topology r2"):
                run("--delete", "--topology", "r2.1ms.L3.classic", "--yes")
            out = run("--delete", "--topology", old.topology_id, "--yes")
            assert f"Removed topology {old.topology_id}" in out
            queues, exchanges = on_broker(prefix)
            assert not any(old.topology_id in name for name in queues + exchanges)
            assert new.ready_queues["default"].name in queues
            assert new.failed_queue.name in queues
            assert any(new.topology_id in name for name in queues)
            assert old.topology_id not in run("--list")


def test_delete_options_need_delete():
    with pytest.raises(CommandError, match="--force only applies to --delete"):
        call_command("declare_delay_topology", "--force", stdout=StringIO())
    with pytest.raises(CommandError, match="only prints"):
        call_command("declare_delay_topology", "--format", "definitions", "--delete")


def test_the_removal_of_a_prefix_names_every_queue_the_library_gives_it():
    plan = plan_topology(get_settings())
    removal = prefix_removal(plan, [])
    assert set(q.name for q in plan.all_queues) <= set(removal.queues)
    assert set(e.name for e in plan.all_exchanges) <= set(removal.exchanges)
    legacy_ready, legacy_hold = plan.legacy_queues
    assert set(legacy_ready.values()) | set(legacy_hold.values()) <= set(removal.queues)
    assert f"{plan.prefix}.transfer" in removal.queues
    # Delay queues go first, longest TTL first: nothing is deleted under a message on its way.
    delay = [q.name for q in plan.delay_queues]
    first = list(removal.queues[: len(delay)])
    assert sorted(first) == sorted(delay)
    with pytest.raises(ValueError, match="is the topology these settings use"):
        topology_removal(plan, [], plan.topology_id)


def get_settings_values() -> dict:
    from django.conf import settings

    return dict(settings.DEFERRED)
