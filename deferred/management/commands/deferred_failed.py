"""Inspect, re-drive and purge the jobs in the failed queue."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import pluralize

from deferred.broker import BrokerError
from deferred.management.arguments import command_settings, seconds
from deferred.records import failures


class Command(BaseCommand):
    help = (
        "Failed jobs: `list [--json]`, `retry ID ... | --all [--delay SECONDS] [--resign]`, "
        "`purge ID ... | --all [--yes]`."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        listing = actions.add_parser("list", help="Show the failed jobs.")
        listing.add_argument("--json", action="store_true", help="A JSON list of objects.")
        listing.add_argument(
            "--tracebacks", action="store_true", help="Each entry's traceback too."
        )
        retry = actions.add_parser("retry", help="Defer failed jobs again (a fresh attempt 1).")
        retry.add_argument("ids", nargs="*", metavar="ID")
        retry.add_argument("--all", action="store_true", help="Every failed job.")
        retry.add_argument("--delay", type=seconds(0), default=0.0, help="Seconds from now.")
        retry.add_argument(
            "--resign",
            action="store_true",
            help=(
                "Also re-drive entries that are not signed with this project's key "
                "(reason bad_signature), signing them anew: only after reading them "
                "(`list --json`), since this vouches for whatever they hold."
            ),
        )
        purge = actions.add_parser("purge", help="Delete failed jobs for good.")
        purge.add_argument("ids", nargs="*", metavar="ID")
        purge.add_argument("--all", action="store_true", help="Every failed job.")
        purge.add_argument("--yes", action="store_true", help="Do not ask for confirmation.")

    def handle(self, *args: Any, **options: Any) -> None:
        settings = command_settings()
        action = options["action"]
        try:
            if action == "list":
                self._list(
                    failures.list_failed(settings),
                    as_json=options["json"],
                    tracebacks=options["tracebacks"] or options["verbosity"] > 1,
                )
                return
            ids = self._ids(options)
            if action == "retry":
                outcome = failures.redrive(
                    settings, ids, options["delay"], resign=options["resign"]
                )
                verb = "re-queued"
            else:
                if not options["yes"]:
                    # Ask before taking anything: the entries stay visible to
                    # others, and no connection idles while the operator reads.
                    entries = failures.list_failed(settings)
                    chosen = [e for e in entries if ids is None or e.id in ids]
                    if chosen and not self._confirm(chosen):
                        self.stdout.write("Nothing purged.")
                        return
                    if ids is None:  # exactly what was confirmed, not what came since
                        ids = [e.id for e in chosen]
                outcome = failures.purge(settings, ids)
                verb = "purged"
        except BrokerError as exc:
            raise CommandError(str(exc)) from exc
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        self._report(outcome, verb)

    def _ids(self, options: dict[str, Any]) -> list[str] | None:
        if options["all"] and options["ids"]:
            raise CommandError("Give job ids or --all, not both.")
        if not options["all"] and not options["ids"]:
            raise CommandError("Give the ids of the jobs (see `list`), or --all.")
        return None if options["all"] else list(options["ids"])

    def _confirm(self, chosen: list[failures.FailedJob]) -> bool:
        if not sys.stdin.isatty():
            raise CommandError(
                f"Refusing to purge {len(chosen)} failed job{pluralize(len(chosen))} without "
                "confirmation: "
                "run it in a terminal, or add --yes."
            )
        answer = input(f"Purge {len(chosen)} failed job{pluralize(len(chosen))} for good? [y/N] ")
        return answer.strip().lower() in ("y", "yes")

    def _list(
        self, entries: list[failures.FailedJob], *, as_json: bool, tracebacks: bool = False
    ) -> None:
        """Each entry: a line for the job, then its whole error, indented; its traceback
        too with ``--tracebacks`` or ``-v 2`` (and in ``--json``)."""
        if as_json:
            self.stdout.write(json.dumps([e.to_json() for e in entries], indent=2))
            return
        if not entries:
            self.stdout.write("No failed jobs.")
            return
        for e in entries:
            self.stdout.write(
                f"{e.id}  {e.task or '?'}  {e.reason}  attempts={e.attempts or '?'}  "
                f"failed_at={e.failed_at or '?'}"
            )
            for line in (e.error or "(no error recorded)").splitlines():
                self.stdout.write(f"    {line}")
            if tracebacks and e.traceback:
                for line in e.traceback.rstrip().splitlines():
                    self.stdout.write(f"      {line}")
        more = "" if tracebacks else " Tracebacks: --tracebacks, or --json."
        self.stdout.write(f"{len(entries)} failed job{pluralize(len(entries))}.{more}")

    def _report(self, outcome: failures.Outcome, verb: str) -> None:
        if outcome.done:
            self.stdout.write(
                self.style.SUCCESS(f"{len(outcome.done)} job{pluralize(len(outcome.done))} {verb}.")
            )
            for job_id in outcome.done:
                self.stdout.write(f"  {job_id}")
        for job_id, why in outcome.skipped:
            self.stderr.write(f"Skipped {job_id}: {why}.")
        if outcome.missing:
            raise CommandError(f"Not in the failed queue: {', '.join(outcome.missing)}.")
        if not outcome.done and not outcome.skipped:
            self.stdout.write(f"Nothing {verb}.")
