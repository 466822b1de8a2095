"""Cancel jobs by id, from a shell or a deploy script."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import pluralize

from deferred.broker import BrokerError
from deferred.management.arguments import command_settings
from deferred.records import cancels


class Command(BaseCommand):
    help = (
        "Cancel jobs by id (what defer() returned, or the id in the worker's log): a job "
        "waiting for its run or a retry will not run. `-` reads ids from standard input, one "
        "per line. An unknown or finished id is accepted quietly: nothing can tell it apart."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("ids", nargs="+", metavar="ID", help="Job ids, or - for stdin.")

    def handle(self, *args: Any, **options: Any) -> None:
        command_settings()  # a bad DEFERRED setting is a CommandError, not a traceback
        ids: list[str] = []
        for value in options["ids"]:
            if value == "-":
                ids += [line.strip() for line in sys.stdin if line.strip()]
            else:
                ids.append(value)
        try:
            cancels.cancel_many(ids)
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        except BrokerError as exc:
            raise CommandError(
                f"The cancel may not have been taken: {exc} Cancelling twice is harmless: "
                "run the command again."
            ) from exc
        self.stdout.write(
            self.style.SUCCESS(
                f"Cancelled {len(ids)} job{pluralize(len(ids))}: the workers drop "
                f"{pluralize(len(ids), 'it,them')} when "
                f"{pluralize(len(ids), 'it comes,they come')} due."
            )
        )
