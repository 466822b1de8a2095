"""List the recurring jobs, or pause, resume or run one of them."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from deferred.broker import BrokerError
from deferred.management.arguments import command_settings
from deferred.records import schedules as scheduler


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


class Command(BaseCommand):
    help = (
        "List each recurring job (schedule, next run, last run, the worker scheduling), or "
        "`pause NAME`, `resume NAME`, `run NAME` (now, once). Commands are kept in the broker "
        "and applied by the worker that schedules, so they survive restarts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "action", nargs="?", choices=["list", *scheduler.COMMANDS], default="list"
        )
        parser.add_argument("name", nargs="?", help="The schedule (its task's name).")
        parser.add_argument("--json", action="store_true", help="Print the list as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        settings = command_settings()
        action, name = options["action"], options["name"]
        try:
            if action != "list":
                if not name:
                    raise CommandError(f"`deferred_schedules {action}` needs a schedule's name.")
                try:
                    scheduler.send_command(settings, action, name)
                except LookupError as exc:
                    raise CommandError(str(exc)) from None
                self.stdout.write(
                    f"{action.capitalize()} of {name} sent; the worker that schedules applies "
                    "it within a second (or when one starts)."
                )
                return
            seen = scheduler.overview(settings)
        except BrokerError as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(seen.to_dict(), indent=2))
            return
        if not seen.schedules:
            self.stdout.write(
                "No recurring jobs: no @task(schedule=...) nor DEFERRED['SCHEDULES']."
            )
            return
        self.stdout.write(
            f"Scheduling worker: {seen.leader or 'none yet'} (record written {_when(seen.written)})"
        )
        for s in seen.schedules:
            state = "paused" if s.paused else f"next {_when(s.next_run)}"
            waiting = f" (waiting: {', '.join(s.waiting)})" if s.waiting else ""
            self.stdout.write(
                f"  {s.name}: {s.rule}, misfire {s.misfire}; {state}; last {_when(s.last_run)}"
                f"{waiting}"
            )
