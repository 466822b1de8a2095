"""Declare (or inspect, or retire) the delay topology described by ``DEFERRED``."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from deferred.broker import BrokerError, admin_channel
from deferred.conf import get_settings
from deferred.topology import Plan, plan_topology, widest_plan


class Command(BaseCommand):
    help = (
        "Declare the exchanges, queues and bindings of the delay topology. Idempotent: "
        "run it on every deploy. --list shows older topologies still on the broker and "
        "--remove-empty deletes the ones no job waits in any more."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Print the plan; touch nothing.")
        parser.add_argument("--format", choices=["text", "json"], default="text")
        parser.add_argument(
            "--list", action="store_true", help="List the topologies declared under PREFIX."
        )
        parser.add_argument(
            "--remove-empty",
            action="store_true",
            help="Delete old topologies (not the current one) in which no job waits.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            settings = get_settings()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        plan = plan_topology(settings)
        as_json = options["format"] == "json"
        if options["dry_run"]:
            self._emit(plan.describe() if as_json else _plan_text(plan), as_json)
            return
        try:
            with admin_channel(settings.broker_url) as admin:
                if options["list"] or options["remove_empty"]:
                    rows = []
                    for record in admin.topology_records(plan):
                        old = _rebuild(plan, record, settings.queues)
                        pending = admin.pending(old)
                        row = {
                            "topology": old.topology_id,
                            "current": old.topology_id == plan.topology_id,
                            "pending": pending,
                            "removed": False,
                        }
                        if options["remove_empty"] and not row["current"] and not pending:
                            admin.remove(old)
                            row["removed"] = True
                        rows.append(row)
                    self._emit(rows if as_json else _rows_text(rows), as_json)
                    return
                report = admin.declare(plan)
        except BrokerError as exc:
            raise CommandError(str(exc)) from exc
        if as_json:
            self._emit(
                {**plan.describe(), "changed": report.changed, "created": report.created}, True
            )
        elif report.changed:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Declared topology {plan.topology_id}: created {len(report.created)} "
                    f"exchanges and queues, {len(report.existing)} already present; "
                    f"{report.bindings} bindings."
                )
            )
            if options["verbosity"] > 1:
                self.stdout.write("\n".join(f"  created {name}" for name in report.created))
        else:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Topology {plan.topology_id} is already declared: nothing changed "
                    f"({len(report.existing)} exchanges and queues present, "
                    f"{report.bindings} bindings confirmed)."
                )
            )

    def _emit(self, payload: Any, as_json: bool) -> None:
        self.stdout.write(json.dumps(payload, indent=2) if as_json else payload)


def _rebuild(current: Plan, record: dict[str, Any], queues: tuple[str, ...]) -> Plan:
    """The plan of a topology from its registry record, with every queue it may have."""
    return widest_plan(
        prefix=current.prefix,
        radix=int(record["radix"]),
        resolution_ms=int(record["resolution_ms"]),
        levels=int(record["levels"]),
        queue_type=str(record["queue_type"]),
        queues=queues,
    )


def _plan_text(plan: Plan) -> str:
    lines = [
        f"Topology {plan.topology_id}: radix {plan.radix}, resolution {plan.resolution_ms} ms, "
        f"{plan.levels} levels, max delay {plan.max_delay_ms} ms, {plan.queue_type} queues.",
        f"Exchanges ({len(plan.exchanges) + 1}, durable):",
        *(f"  {e.name}  {e.type}  {e.arguments}" for e in (*plan.exchanges, plan.failed_exchange)),
        f"Delay queues ({len(plan.delay_queues)}, durable):",
        *(f"  {q.name}  ttl={q.ttl_ms} ms  {q.arguments}" for q in plan.delay_queues),
        "Shared queues (durable):",
        *(f"  {q.name}  {q.arguments}" for q in plan.shared_queues),
        f"Bindings ({len(plan.bindings) + len(plan.shared_bindings)}):",
        *(
            f"  {b.source} -> {b.destination} ({b.destination_type})  {b.routing_key}"
            for b in (*plan.bindings, *plan.shared_bindings)
        ),
    ]
    return "\n".join(lines)


def _rows_text(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "No topology is recorded under this PREFIX yet: run declare_delay_topology."
    out = []
    for row in rows:
        state = "current" if row["current"] else "old"
        pending = "missing" if row["pending"] is None else f"{row['pending']} job(s) waiting"
        removed = ", removed" if row["removed"] else ""
        out.append(f"{row['topology']}  {state}  {pending}{removed}")
    return "\n".join(out)
