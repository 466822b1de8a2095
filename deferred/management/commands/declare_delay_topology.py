"""Declare (or inspect, check, export or retire) the delay topology described by ``DEFERRED``."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import pluralize

from deferred.broker import Admin, BrokerError, DeclareReport, admin_channel, vhost_of
from deferred.broker.http_api import ManagementAPI
from deferred.cluster.nodes import leaders_per_node, management_api
from deferred.core.topology import Plan, plan_topology, recorded_plan
from deferred.management.arguments import command_settings
from deferred.operate import export
from deferred.operate.removal import Removal, prefix_removal, topology_removal
from deferred.records.cancels import cancel_route_missing

#: Formats that print the topology as infrastructure code, without the broker.
IAC_FORMATS = ("definitions", "terraform")


class Command(BaseCommand):
    help = (
        "Declare the exchanges, queues and bindings of the delay topology. Idempotent: "
        "run it on every deploy. --list shows older topologies still on the broker and "
        "--remove-empty deletes the ones no job waits in any more. --format definitions "
        "or terraform prints the topology as infrastructure code; --check (implied when "
        "DEFERRED['DECLARE'] is False) only verifies that it exists. --delete removes every "
        "queue and exchange of the PREFIX (or, with --topology, of one old topology), "
        "after listing them and asking."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Print the plan; touch nothing.")
        parser.add_argument(
            "--format",
            choices=["text", "json", *IAC_FORMATS],
            default="text",
            help="definitions: JSON for `rabbitmqctl import_definitions`; terraform: a module "
            "for the cyrilgdn/rabbitmq provider. Both only print.",
        )
        parser.add_argument(
            "--vhost",
            help="The vhost written into --format definitions/terraform "
            "(default: the vhost of BROKER_URL).",
        )
        parser.add_argument(
            "--users",
            action="store_true",
            help="With --format definitions: add the publisher, worker and admin users and "
            "their permissions (no passwords; set them with rabbitmqctl change_password).",
        )
        parser.add_argument(
            "--check",
            action="store_true",
            help="Declare nothing; fail unless every exchange and queue exists.",
        )
        parser.add_argument(
            "--list", action="store_true", help="List the topologies declared under PREFIX."
        )
        parser.add_argument(
            "--remove-empty",
            action="store_true",
            help="Delete old topologies (not the current one) in which no job waits.",
        )
        parser.add_argument(
            "--delete",
            action="store_true",
            help="Remove every queue and exchange of the PREFIX, jobs included: lists them "
            "and asks first (--dry-run only lists). Refused while jobs wait there or workers "
            "consume, unless --force.",
        )
        parser.add_argument(
            "--topology",
            metavar="ID",
            help="With --delete: remove only this old topology (an id --list shows).",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="With --delete: remove even what holds jobs (they are lost) or has consumers.",
        )
        parser.add_argument(
            "--yes", action="store_true", help="With --delete: do not ask for confirmation."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        settings = command_settings()
        plan = plan_topology(settings)
        fmt = options["format"]
        as_json = fmt == "json"
        if options["vhost"] is not None and fmt not in IAC_FORMATS:
            raise CommandError("--vhost only applies to --format definitions or terraform.")
        if options["users"] and fmt != "definitions":
            raise CommandError("--users only applies to --format definitions.")
        if fmt in IAC_FORMATS:
            if options["list"] or options["remove_empty"] or options["check"] or options["delete"]:
                raise CommandError(f"--format {fmt} only prints; it takes no other action.")
            vhost = options["vhost"] or vhost_of(settings.broker_urls)
            if fmt == "definitions":
                self._emit(export.definitions(plan, vhost=vhost, users=options["users"]), True)
                if options["users"]:
                    self.stderr.write(
                        "The users have no password: import this once, then set one for each "
                        "with `rabbitmqctl change_password NAME`. Import later changes without "
                        "--users: RabbitMQ clears the password of a user imported without one."
                    )
            else:
                self.stdout.write(export.terraform(plan, vhost=vhost), ending="")
            return
        delete_only = [o for o in ("topology", "force", "yes") if options[o]]
        if delete_only and not options["delete"]:
            raise CommandError(f"--{delete_only[0]} only applies to --delete.")
        if options["delete"]:
            if options["list"] or options["remove_empty"] or options["check"]:
                raise CommandError("--delete takes no other action.")
            self._delete(settings, plan, options)
            return
        if options["dry_run"]:
            self._emit(plan.describe() if as_json else _plan_text(plan), as_json)
            return
        if options["remove_empty"] and not settings.declare:
            raise CommandError(
                "DEFERRED['DECLARE'] is False: the infrastructure owns the topology, so "
                "deferred deletes nothing either. Remove old topologies there once "
                "--list shows no job waiting in them."
            )
        api = management_api(settings)
        try:
            with admin_channel(settings.broker_urls) as admin:
                if options["list"] or options["remove_empty"]:
                    rows = _list(admin, plan, settings.queues, remove=options["remove_empty"])
                    api_queues = api.queues(plan.prefix) if api.enabled else None
                    for row in rows:
                        delay_queues = row.pop("delay_queues")
                        # Only the management API knows where leaders are.
                        if api_queues is not None:
                            row["leaders"] = leaders_per_node(api_queues, delay_queues)
                    self._emit(rows if as_json else _rows_text(rows), as_json)
                elif options["check"] or not settings.declare:
                    missing = admin.missing(plan)
                    if not missing:
                        # Bindings cannot be listed over AMQP; this one is new
                        # in a topology of the same name: try it.
                        route = cancel_route_missing(settings)
                        missing += [route] if route else []
                    self._checked(plan, missing, settings.declare, as_json)
                    if not settings.declare:
                        # Complete (else _checked raised): record this version, so
                        # --list and deferred_status still see it once the settings
                        # move on to another and jobs drain from this one.
                        admin.record(plan)
                else:
                    self._declared(plan, admin.declare(plan), as_json, options["verbosity"])
                    self._warn_if_classic_on_a_cluster(plan, len(settings.broker_urls), api)
        except BrokerError as exc:
            raise CommandError(str(exc)) from exc

    def _delete(self, settings: Any, plan: Plan, options: dict[str, Any]) -> None:
        """``--delete``: list, count, refuse or ask, then remove."""
        if not settings.declare:
            raise CommandError(
                "DEFERRED['DECLARE'] is False: the infrastructure owns the topology, so "
                "deferred deletes nothing. Remove it there."
            )
        try:
            with admin_channel(settings.broker_urls) as admin:
                records = admin.topology_records(plan)
                try:
                    removal = (
                        topology_removal(plan, records, options["topology"])
                        if options["topology"]
                        else prefix_removal(plan, records)
                    )
                except ValueError as exc:
                    raise CommandError(str(exc)) from None
                queues = {q: s for q in removal.queues if (s := admin.queue_stats(q)) is not None}
                exchanges = [e for e in removal.exchanges if admin.exchange_exists(e)]
                jobs = sum(s.messages for q, s in queues.items() if q not in removal.bookkeeping)
                consumers = sum(s.consumers for s in queues.values())
                self.stdout.write(
                    _removal_text(removal, queues, exchanges, jobs, consumers, options["verbosity"])
                )
                if not queues and not exchanges:
                    self.stdout.write(f"Nothing of {removal.what} is on the broker.")
                    return
                if options["dry_run"]:
                    self.stdout.write("Dry run: nothing was removed.")
                    return
                if (jobs or consumers) and not options["force"]:
                    raise CommandError(
                        f"Refused: {_holding(jobs, consumers)}. Let the jobs run (and stop "
                        "the workers) first, or add --force to remove them anyway: "
                        f"{_count(jobs, 'job')} would be lost."
                    )
                if not options["yes"] and not _confirmed(
                    f"Remove {_count(len(queues), 'queue')} and "
                    f"{_count(len(exchanges), 'exchange')} of {removal.what}"
                    + (f", losing {_count(jobs, 'job')}" if jobs else "")
                    + "? [y/N] "
                ):
                    raise CommandError(
                        "Not confirmed: nothing was removed (--yes skips the question)."
                    )
                admin.delete(list(queues), exchanges)
                for topology in removal.forget:
                    admin.forget_topology(plan, topology)
        except BrokerError as exc:
            raise CommandError(str(exc)) from exc
        lost = f"; {_count(jobs, 'job')} lost" if jobs else ""
        self.stdout.write(
            self.style.SUCCESS(
                f"Removed {removal.what}: {_count(len(queues), 'queue')} and "
                f"{_count(len(exchanges), 'exchange')}{lost}."
            )
        )

    def _warn_if_classic_on_a_cluster(self, plan: Plan, urls: int, api: ManagementAPI) -> None:
        """Classic queues live on one node each: say what a node loss then costs."""
        if plan.queue_type != "classic":
            return
        nodes = api.nodes() if api.enabled else None
        size = len(nodes) if nodes is not None else urls
        if size > 1:
            self.stderr.write(
                self.style.WARNING(
                    f"Warning: classic queues on a cluster of {size} nodes: each queue lives on "
                    "one node. While a node is down, the jobs in its delay and ready queues "
                    "wait for it (they are not lost if its disk survives), and its queues take "
                    "and deliver nothing. For replicated queues set QUEUE_TYPE to 'quorum' "
                    "(under a new PREFIX: see the README's 'Running on a cluster')."
                )
            )

    def _declared(self, plan: Plan, report: DeclareReport, as_json: bool, verbosity: int) -> None:
        for warning in report.warnings:
            self.stderr.write(self.style.WARNING(f"Warning: {warning}."))
        if as_json:
            self._emit(
                {**plan.describe(), "changed": report.changed, "created": report.created}, True
            )
        elif report.changed:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Declared topology {plan.topology_id}, {plan.size()}: created "
                    f"{len(report.created)}, {len(report.existing)} already present; "
                    f"{report.bindings} bindings."
                )
            )
            if verbosity > 1:
                self.stdout.write("\n".join(f"  created {name}" for name in report.created))
        else:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Topology {plan.topology_id} is already declared: nothing changed "
                    f"({plan.size()}, all present; {report.bindings} bindings confirmed)."
                )
            )

    def _emit(self, payload: Any, as_json: bool) -> None:
        self.stdout.write(json.dumps(payload, indent=2) if as_json else payload)

    def _checked(self, plan: Plan, missing: list[str], declare: bool, as_json: bool) -> None:
        """Report a passive check; ``CommandError`` (exit 1) if anything is missing."""
        total = len(plan.all_exchanges) + len(plan.all_queues)
        if as_json:
            self._emit({"topology": plan.topology_id, "missing": missing}, True)
        why = "" if declare else "DEFERRED['DECLARE'] is False: nothing was declared. "
        if missing:
            raise CommandError(
                f"{why}Topology {plan.topology_id} is incomplete: {len(missing)} of its {total} "
                "exchanges and queues (or the cancels' binding) are missing:\n"
                + "\n".join(f"  {name}" for name in missing)
                + "\nCreate them with what `--format definitions` or `--format terraform` prints"
                + (" (or run this command without --check)." if declare else ".")
            )
        if not as_json:
            self.stdout.write(
                self.style.SUCCESS(
                    f"{why}Topology {plan.topology_id} is complete: all {total} exchanges and "
                    "queues exist, and cancels reach their stream (other bindings cannot be "
                    "checked over AMQP)."
                )
            )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _holding(jobs: int, consumers: int) -> str:
    parts = [f"{_count(jobs, 'job')} {'waits' if jobs == 1 else 'wait'} there"] if jobs else []
    if consumers:
        verb = "reads" if consumers == 1 else "read"
        parts.append(f"{_count(consumers, 'consumer')} (workers) {verb} there")
    return " and ".join(parts)


def _removal_text(
    removal: Removal,
    queues: dict[str, Any],
    exchanges: list[str],
    jobs: int,
    consumers: int,
    verbosity: int = 1,
) -> str:
    """What ``--delete`` would remove: the counts, the queues that hold messages or have
    consumers, and every name with ``-v 2``."""
    lines = [
        f"{removal.what}: {_count(len(queues), 'queue')} and "
        f"{_count(len(exchanges), 'exchange')} on the broker"
        + (f", {_holding(jobs, consumers)}" if jobs or consumers else ", no job in them")
        + ("." if verbosity < 2 else ":")
    ]
    for name, stats in queues.items():
        kind = "record" if name in removal.bookkeeping else "job"
        held = [f"{_count(stats.messages, kind)}"] if stats.messages else []
        held += [f"{_count(stats.consumers, 'consumer')}"] if stats.consumers else []
        if held or verbosity > 1:
            lines.append(f"  queue     {name}" + (f"  ({', '.join(held)})" if held else ""))
    if verbosity > 1:
        lines += [f"  exchange  {name}" for name in exchanges]
    elif queues or exchanges:
        lines.append("  (every name: -v 2)")
    return "\n".join(lines)


def _confirmed(question: str) -> bool:
    """Ask on the terminal; no answer (no terminal) is no."""
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        return False


def _list(
    admin: Admin, plan: Plan, queues: tuple[str, ...], *, remove: bool
) -> list[dict[str, Any]]:
    """One row per topology of the PREFIX; with ``remove``, old empty ones are deleted."""
    rows = []
    for record in _records(admin.topology_records(plan), plan):
        old = recorded_plan(record, prefix=plan.prefix, queues=queues)
        pending = admin.pending(old)
        row = {
            "topology": old.topology_id,
            "current": old.topology_id == plan.topology_id,
            "pending": pending,
            "removed": False,
            "delay_queues": [q.name for q in old.delay_queues],
        }
        if remove and not row["current"] and not pending:
            admin.remove(old)
            row["removed"] = True
        rows.append(row)
    rows += _legacy_rows(admin, plan, rows, remove=remove)
    return rows


def _legacy_rows(
    admin: Admin, plan: Plan, rows: list[dict[str, Any]], *, remove: bool
) -> list[dict[str, Any]]:
    """The ready and hold queues left from before PRIORITIES changed, while they exist; with
    ``remove``, deleted once no topology that delivers there is left and they are empty."""
    ready, hold = plan.legacy_queues
    names = [*ready.values(), *hold.values()]
    counts = {name: admin.message_count(name) for name in names}
    present = [name for name, count in counts.items() if count is not None]
    if not present:
        return []
    feeding = any(not r["current"] and not r["removed"] for r in rows)
    removed = False
    if remove and not feeding and not any(counts[n] for n in present):
        removed = all([admin.delete_if_empty(name) for name in present])
    return [
        {
            "topology": plan.legacy_label,
            "current": False,
            "pending": sum(counts[n] or 0 for n in present),
            "removed": removed,
            "delay_queues": present,
        }
    ]


def _records(records: list[dict[str, Any]], current: Plan) -> list[dict[str, Any]]:
    """The registry's records, plus the current topology if none records it.

    A topology created by infrastructure code (definitions, Terraform) has
    no record: it is still the one new jobs go to, so it is always listed.
    """
    if any(r["topology"] == current.topology_id for r in records):
        return records
    return [json.loads(current.record()), *records]


def _plan_text(plan: Plan) -> str:
    lines = [
        f"Topology {plan.topology_id}: radix {plan.radix}, resolution {plan.resolution_ms} ms, "
        f"{plan.levels} levels, max delay {plan.max_delay_ms} ms, {plan.queue_type} queues.",
        (
            f"The lowest {plan.hold_levels} level{pluralize(plan.hold_levels)} "
            f"{pluralize(plan.hold_levels, 'is,are')} left to the workers: a job due within "
            f"{plan.window_ms} ms goes to its hold queue (HOLD_WINDOW)."
            if plan.hold_levels
            else "Every level is declared: nothing is held in the workers (HOLD_WINDOW)."
        ),
        f"Exchanges ({len(plan.all_exchanges)}, durable):",
        *(f"  {e.name}  {e.type}  {e.arguments}" for e in (*plan.exchanges, plan.failed_exchange)),
        f"Delay queues ({len(plan.delay_queues)}, durable):",
        *(f"  {q.name}  ttl={q.ttl_ms} ms  {q.arguments}" for q in plan.delay_queues),
        "Shared queues (durable):",
        *(f"  {q.name}  {q.arguments}" for q in plan.shared_queues),
        f"Bindings ({len(plan.all_bindings)}):",
        *(
            f"  {b.source} -> {b.destination} ({b.destination_type})  {b.routing_key}"
            for b in (*plan.bindings, *plan.shared_bindings)
        ),
    ]
    return "\n".join(lines)


def _rows_text(rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        state = "current" if row["current"] else "old"
        pending = (
            "missing"
            if row["pending"] is None
            else f"{row['pending']} job{pluralize(row['pending'])} waiting"
        )
        removed = ", removed" if row["removed"] else ""
        out.append(f"{row['topology']}  {state}  {pending}{removed}")
        if row.get("leaders"):
            leaders = ", ".join(f"{node} {n}" for node, n in row["leaders"].items())
            out.append(f"  delay-queue leaders per node: {leaders}")
    return "\n".join(out)
