"""declare_delay_topology against the real broker, and topology changes on a live system."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from deferred import defer
from deferred.broker import admin_channel
from deferred.conf import get_settings
from deferred.core.topology import Plan, plan_topology
from tests.conftest import _every_plan, rabbitmqctl, wait_for
from tests.testapp.tasks import read_records, record


def run(*args: str) -> str:
    out = StringIO()
    call_command("declare_delay_topology", *args, stdout=out)
    return out.getvalue()


@contextmanager
def own_prefix(broker_url: str, **values) -> Iterator[str]:
    """Settings with a throwaway PREFIX; everything under it is deleted afterwards."""
    prefix = f"deferred-test-{uuid.uuid4().hex[:8]}"
    base = {"BROKER_URL": broker_url, "PREFIX": prefix, "MAX_DELAY": 60}
    try:
        with override_settings(DEFERRED={**base, **values}):
            yield prefix
    finally:
        with override_settings(DEFERRED=base), admin_channel(broker_url) as admin:
            for plan in _every_plan(admin, plan_topology(get_settings())):
                admin.delete_everything(plan)


def current_plan() -> Plan:
    return plan_topology(get_settings())


def test_second_run_changes_nothing_and_says_so(topology):
    assert "nothing changed" in run()
    data = json.loads(run("--format", "json"))
    assert data["changed"] is False and data["created"] == []


def test_first_run_says_what_it_created(broker_url):
    with own_prefix(broker_url, RADIX=16):
        out = run()
        plan = current_plan()
        # One count, by kind, the same in both messages and as the plan says it
        size = plan.size()
        assert size.startswith(f"{len(plan.all_queues)} queues ({len(plan.delay_queues)} delay, ")
        assert f"Declared topology r16.1ms.L4.H2.P9.classic, {size}: created " in out
        again = run()
        assert "nothing changed" in again and size in again


def test_dry_run_prints_the_plan_and_touches_nothing(broker_url):
    with own_prefix(broker_url, RADIX=4):
        text = run("--dry-run")
        assert "Topology r4.1ms.L8.H4.P9.classic" in text and "ttl=" in text
        plan = json.loads(run("--dry-run", "--format", "json"))
        assert plan["radix"] == 4 and plan["levels"] == 8
        ttls = sorted(
            q["arguments"]["x-message-ttl"]
            for q in plan["queues"]
            if "x-message-ttl" in q["arguments"]
        )
        # The four lowest levels (4**4 ms: the 256 ms HOLD_WINDOW) are left to the workers.
        assert plan["hold_levels"] == 4 and plan["window_ms"] == 256
        assert ttls[:4] == [256, 512, 768, 1024]
        assert {b["destination_type"] for b in plan["bindings"]} == {"queue"}
        assert any(e["arguments"].get("alternate-exchange") for e in plan["exchanges"])
        with admin_channel(broker_url) as admin:
            assert not admin.exchange_exists(current_plan().ingest_exchange)
            assert not admin.queue_exists(current_plan().ready_queues["default"].name)


def test_queue_with_other_arguments_is_a_clear_error(broker_url):
    with own_prefix(broker_url) as prefix:
        ready = f"{prefix}.ready.p9.default"
        assert current_plan().ready_queues["default"].name == ready
        with admin_channel(broker_url) as admin:
            admin.channel.queue_declare(ready, durable=True, arguments={"x-queue-type": "quorum"})
        with pytest.raises(CommandError) as caught:
            run()
        message = str(caught.value)
        assert ready in message
        assert "delete_queue" in message and "inequivalent arg" in message


def test_quorum_mode(broker_url, run_worker, records):
    with own_prefix(broker_url, QUEUE_TYPE="quorum", RADIX=4) as prefix:
        run()
        listed = rabbitmqctl("list_queues", "name", "type", "arguments", "-q", "--no-table-headers")
        mine = [line for line in listed.splitlines() if line.startswith(prefix)]
        delay_lines = [line for line in mine if ".delay." in line]
        streams = tuple(
            f"{prefix}.{name}\t"
            for name in ("cancels", "results", "ledger", "ledger-pages", "ledger-heads")
        )
        # The "up" marker's queue is classic on purpose: its transient message must not
        # survive a restart.
        up = f"{prefix}.up\t"
        assert delay_lines and all(
            "quorum" in line for line in mine if not line.startswith((*streams, up))
        )
        for stream in streams:
            assert any(line.startswith(f"{stream}stream") for line in mine), stream
        assert any(line.startswith(f"{up}classic") for line in mine)
        assert all("at-least-once" in line for line in delay_lines)
        run_worker()
        start = time.time()
        for n in (3, 2, 1):
            defer(record, n * 0.2, records, str(n))
        assert wait_for(lambda: len(read_records(records)) == 3, 15)
        at = {r["label"]: r["at"] for r in read_records(records)}
        # Each after its own delay, never before. (Not their order: 0.2 s apart,
        # a busy CI host's lateness once put "3" before "2"; order is no promise.)
        assert sorted(at) == ["1", "2", "3"]
        assert all(at[n] >= start + int(n) * 0.2 for n in at)


def test_quorum_queues_declared_before_placement_settings_are_kept_with_a_warning(
    broker_url, raw_channel
):
    # Given the shared ready queue of an earlier version: quorum, but without
    # the group size and leader locator (placement is fixed at creation)
    with own_prefix(broker_url, QUEUE_TYPE="quorum", RADIX=16) as prefix:
        ready = f"{prefix}.ready.default"
        old = {
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": f"{prefix}.failed",
            "x-delivery-limit": 5,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }
        raw_channel.queue_declare(ready, durable=True, arguments=old)
        # When the topology is declared, Then it succeeds and says what it kept
        out, err = StringIO(), StringIO()
        call_command("declare_delay_topology", stdout=out, stderr=err)
        assert "Declared topology" in out.getvalue()
        assert f"queue {ready} exists with other replica placement" in err.getvalue()
        assert "x-quorum-initial-group-size=None" in err.getvalue()
        # And a second run still succeeds
        call_command("declare_delay_topology", stdout=StringIO(), stderr=StringIO())
        # But another difference (here a delivery limit) is still a conflict
        with (
            override_settings(DEFERRED={**get_settings_dict(), "DELIVERY_LIMIT": 9}),
            pytest.raises(CommandError, match="x-delivery-limit"),
        ):
            run()


def get_settings_dict() -> dict:
    from django.conf import settings

    return dict(settings.DEFERRED)


def test_changing_the_radix_strands_no_pending_job(broker_url, run_worker, records):
    with own_prefix(broker_url, RADIX=2) as prefix:
        base = {"BROKER_URL": broker_url, "PREFIX": prefix, "MAX_DELAY": 60}
        run()
        old = current_plan()
        due = {}
        for n in range(15):
            # Long enough to still wait while the new topology is declared
            # and listed on a loaded host.
            due[f"old-{n}"] = time.time() + 4 + n * 0.05
            defer(record, 4 + n * 0.05, records, f"old-{n}")
        # A deploy with a new radix: the new topology is declared beside the old.
        with override_settings(DEFERRED={**base, "RADIX": 4}):
            assert "Declared topology r4." in run()
            for n in range(15):
                due[f"new-{n}"] = time.time() + 0.3 + n * 0.05
                defer(record, 0.3 + n * 0.05, records, f"new-{n}")
            listing = json.loads(run("--list", "--format", "json"))
            rows = {row["topology"]: row for row in listing}
            assert rows[old.topology_id]["current"] is False
            assert rows[old.topology_id]["pending"] > 0
            assert rows[current_plan().topology_id]["current"] is True
            # Not empty yet: --remove-empty keeps it.
            run("--remove-empty")
            with admin_channel(broker_url) as admin:
                assert admin.exchange_exists(old.ingest_exchange)

            run_worker()
            assert wait_for(lambda: len(read_records(records)) >= 30, 15)
            time.sleep(0.3)
            runs = read_records(records)
            assert sorted(r["label"] for r in runs) == sorted(due)  # each exactly once
            assert all(r["at"] >= due[r["label"]] for r in runs)  # none early

            out = run("--remove-empty")
            assert "removed" in out
            listing = json.loads(run("--list", "--format", "json"))
            assert [row["topology"] for row in listing] == [current_plan().topology_id]
            with admin_channel(broker_url) as admin:
                assert not admin.exchange_exists(old.ingest_exchange)
                assert not admin.queue_exists(old.delay_queues[0].name)
                assert admin.queue_exists(old.ready_queues["default"].name)  # shared, kept


def test_exchange_of_another_type_is_a_clear_error(broker_url):
    with own_prefix(broker_url, RADIX=16):
        ingest = current_plan().ingest_exchange
        with admin_channel(broker_url) as admin:
            admin.channel.exchange_declare(ingest, "direct", durable=True)
        try:
            with pytest.raises(CommandError, match="already exists with other properties"):
                run()
        finally:
            with admin_channel(broker_url) as admin:
                admin.channel.exchange_delete(ingest)


def test_a_binding_the_broker_refuses_is_a_clear_error_and_the_others_stand(broker_url):
    # Bindings are pipelined (nowait): a refused one must still surface, named,
    # and the one sent before it must have been made.
    from deferred.broker import BrokerError
    from deferred.core.topology import Binding

    def bound(b: Binding) -> bool:
        listed = rabbitmqctl(
            "list_bindings",
            "source_name",
            "destination_name",
            "routing_key",
            "-q",
            "--no-table-headers",
        )
        return (b.source, b.destination, b.routing_key) in {
            tuple(line.split("\t")) for line in listed.splitlines()
        }

    with own_prefix(broker_url, RADIX=16):
        run()
        plan = current_plan()
        first = plan.bindings[0]
        with admin_channel(broker_url) as admin:
            admin.channel.queue_unbind(first.destination, first.source, first.routing_key)
            assert not bound(first)
            missing = Binding(f"{plan.prefix}.no-such-exchange", first.destination, "x")
            with pytest.raises(BrokerError, match=r"refused a binding.*no-such-exchange"):
                admin.bind(plan, [first, missing])
            assert bound(first)
            # The admin goes on, on a fresh channel.
            assert admin.queue_exists(first.destination)


def test_a_spare_test_topology_comes_back_empty_and_as_declared(broker_url, raw_channel, records):
    """The suite's own economy (tests/conftest.py): a topology a test leaves goes to the
    next test emptied, its streams new, what the test cut back, and its one record kept."""
    from tests.conftest import depth, topology_of_its_own, total_waiting

    def routed(plan: Plan, binding) -> bool:
        before = depth(raw_channel, binding.destination)
        raw_channel.basic_publish(binding.source, binding.routing_key, b"routed?")
        return wait_for(lambda: depth(raw_channel, binding.destination) > before, 1)

    with topology_of_its_own(broker_url) as first:
        top = first.delay_queues[0].name  # the longest wait: what lands there stays
        cut = next(b for b in first.bindings if b.destination == top)
        raw_channel.queue_unbind(cut.destination, cut.source, cut.routing_key)
        assert not routed(first, cut)
        defer(record, 60, records, "still waiting")
        raw_channel.basic_publish("", first.ready_queues["default"].name, b"left over")
        raw_channel.basic_publish("", first.results_queue.name, b"a record")
        assert wait_for(lambda: total_waiting(raw_channel, first) == 2, 5)
    with topology_of_its_own(broker_url) as second, admin_channel(broker_url) as admin:
        assert second.prefix == first.prefix
        assert total_waiting(raw_channel, second) == 0
        assert admin.stream_span(second.results_queue.name) == 0
        assert [r["topology"] for r in admin.topology_records(second)] == [second.topology_id]
        assert admin.missing(second) == []
        assert routed(second, cut)


def test_a_test_topology_with_a_consumer_left_on_it_is_not_handed_out_again(
    broker_url, raw_channel
):
    from tests.conftest import topology_of_its_own

    with topology_of_its_own(broker_url) as first:
        raw_channel.basic_consume(first.ready_queues["default"].name, lambda *a: None)
    with topology_of_its_own(broker_url) as second:
        assert second.prefix != first.prefix
