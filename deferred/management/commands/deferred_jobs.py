"""See and change the pending jobs: list, show, run-now, reschedule, cancel."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import pluralize

from deferred.broker import BrokerError
from deferred.core.jobs import looks_like_id
from deferred.core.pending_jobs import PendingJob
from deferred.management.arguments import command_settings, moment, seconds
from deferred.records import changes, listing
from deferred.records.cancels import cancel_many
from deferred.records.results import lookup

#: How much of a row's arguments the text listing shows (``--json`` has them whole).
PREVIEW_CHARS = 60


class Command(BaseCommand):
    help = (
        "Pending jobs: `list [filters] [--limit N] [--json]`, `show ID [--json]`, "
        "`run-now ID ...`, `reschedule ID ... --in SECONDS | --at WHEN`, "
        "`cancel ID ... | [filters] | --all [--dry-run] [--yes]`. "
        "Filters: --task, --queue, --key, --due-after WHEN, --due-before WHEN."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listed = actions.add_parser("list", help="The pending jobs, soonest due first.")
        _filters(listed)
        listed.add_argument(
            "--limit",
            type=int,
            default=listing.DEFAULT_LIMIT,
            help=f"At most this many (default {listing.DEFAULT_LIMIT}; 0: all).",
        )
        listed.add_argument("--json", action="store_true", help="One JSON array of objects.")
        show = actions.add_parser("show", help="One job: its record, and its result once it ran.")
        show.add_argument("id", metavar="ID")
        show.add_argument("--json", action="store_true", help="One JSON object.")
        now = actions.add_parser("run-now", help="Run pending jobs as soon as a worker is free.")
        now.add_argument("ids", nargs="+", metavar="ID")
        later = actions.add_parser("reschedule", help="Move pending jobs to a new time.")
        later.add_argument("ids", nargs="+", metavar="ID")
        when = later.add_mutually_exclusive_group(required=True)
        when.add_argument("--in", dest="in_s", type=seconds(0), help="Seconds from now.")
        when.add_argument("--at", type=moment, help="ISO 8601, or +90s, +2h, +1d.")
        cancel = actions.add_parser("cancel", help="Cancel pending jobs, by id or by filter.")
        cancel.add_argument("ids", nargs="*", metavar="ID")
        _filters(cancel)
        cancel.add_argument("--all", action="store_true", help="Every pending job.")
        cancel.add_argument("--dry-run", action="store_true", help="List them; cancel none.")
        cancel.add_argument("--yes", action="store_true", help="Do not ask for confirmation.")

    def handle(self, *args: Any, **options: Any) -> None:
        command_settings()  # a bad DEFERRED setting is a CommandError, not a traceback
        action = options["action"]
        try:
            if action == "list":
                limit = options["limit"]
                if limit < 0:
                    raise CommandError("--limit must be 0 (all) or more.")
                rows = listing.pending(**_filter_options(options), limit=limit or None)
                self._list(rows, as_json=options["json"], limit=limit)
            elif action == "show":
                self._show(options["id"], as_json=options["json"])
            elif action in ("run-now", "reschedule"):
                self._move(options)
            else:
                self._cancel(options)
        except changes.JobNotPending as exc:
            raise CommandError(str(exc)) from exc
        except (BrokerError, TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from exc

    def _list(self, rows: list[PendingJob], *, as_json: bool, limit: int) -> None:
        if as_json:
            self.stdout.write(json.dumps([r.as_dict() for r in rows], indent=2))
            return
        if not rows:
            self.stdout.write("No pending jobs.")
            return
        for r in rows:
            preview = r.preview if len(r.preview) <= PREVIEW_CHARS else r.preview[:59] + "…"
            extras = "".join(
                f"  {name}={value}"
                for name, value in (("priority", r.priority), ("key", r.key))
                if value
            )
            self.stdout.write(
                f"{r.id}  {_iso(r.due)}  {r.task}  queue={r.queue}{extras}  {preview}"
            )
        more = f" (the first {limit}: --limit for more)" if limit and len(rows) == limit else ""
        self.stdout.write(f"{len(rows)} pending job{pluralize(len(rows))}{more}.")

    def _show(self, job_id: str, *, as_json: bool) -> None:
        settings = command_settings()
        if not isinstance(job_id, str) or not looks_like_id(job_id):
            raise CommandError(f"{job_id!r} is not a job id (32 hexadecimal digits).")
        found = changes.look(settings, job_id, with_job=False)
        result = lookup(settings, job_id) if found.state != "pending" else None
        if found.row is None and (result is None or result.outcome is None):
            raise CommandError(f"No job {job_id} in the ledger or the results.")
        record = None if found.row is None else found.row.public().as_dict()
        if as_json:
            out = {"id": job_id, "state": found.state, "job": record}
            out["result"] = None if result is None else result.as_dict()
            self.stdout.write(json.dumps(out, indent=2, default=str))
            return
        self.stdout.write(f"job {job_id}: {found.state}")
        for name, value in (record or {}).items():
            if name != "id" and value not in (None, False):
                self.stdout.write(f"  {name}: {value}")
        if result is not None and result.outcome is not None:
            self.stdout.write(f"  result: {result.state} ({result.outcome})")
            if result.finished_at:
                self.stdout.write(f"  finished: {_iso(result.finished_at)}")

    def _move(self, options: dict[str, Any]) -> None:
        if options["action"] == "run-now":
            delay: object = 0
        else:
            delay = options["at"] if options["at"] is not None else options["in_s"]
        failed = []
        for job_id in options["ids"]:
            try:
                due = changes.reschedule(job_id, delay)
            except changes.JobNotPending as exc:
                failed.append(str(exc))
                continue
            self.stdout.write(f"{job_id}: due {_iso(due)}")
        if failed:
            raise CommandError(" ".join(failed))

    def _cancel(self, options: dict[str, Any]) -> None:
        filters = _filter_options(options)
        ids = list(options["ids"])
        chosen_filter = any(v is not None for v in filters.values())
        if ids and (chosen_filter or options["all"]):
            raise CommandError("Give job ids, or filters (or --all), not both.")
        if not ids and not chosen_filter and not options["all"]:
            raise CommandError(
                "Say which jobs: their ids, a filter (--task, --queue, --key, --due-after, "
                "--due-before), or --all."
            )
        if not ids:
            ids = [r.id for r in listing.pending(**filters, limit=None)]
        count = len(ids)
        what = f"{count} pending job{pluralize(count)}"
        if options["dry_run"]:
            for job_id in ids:
                self.stdout.write(f"  {job_id}")
            self.stdout.write(f"Would cancel {what}; cancelled none (--dry-run).")
            return
        if not count:
            self.stdout.write("No pending job matches: nothing cancelled.")
            return
        if not options["yes"] and not self._confirm(what):
            self.stdout.write("Nothing cancelled.")
            return
        cancel_many(ids)
        self.stdout.write(self.style.SUCCESS(f"Cancelled {what}."))

    def _confirm(self, what: str) -> bool:
        if not sys.stdin.isatty():
            raise CommandError(
                f"Refusing to cancel {what} without confirmation: run it in a terminal, "
                "or add --yes (--dry-run lists them)."
            )
        return input(f"Cancel {what}? [y/N] ").strip().lower() in ("y", "yes")


def _filters(parser: CommandParser) -> None:
    parser.add_argument("--task", help="The task's name (as `list` shows it).")
    parser.add_argument("--queue", help="A queue of DEFERRED['QUEUES'].")
    parser.add_argument("--key", help="A debounce key.")
    parser.add_argument("--due-after", type=moment, metavar="WHEN", help="Due at or after.")
    parser.add_argument("--due-before", type=moment, metavar="WHEN", help="Due before.")


def _filter_options(options: dict[str, Any]) -> dict[str, Any]:
    return {name: options[name] for name in ("task", "queue", "key", "due_after", "due_before")}


def _iso(moment_: datetime) -> str:
    return moment_.astimezone(UTC).isoformat(timespec="milliseconds")
