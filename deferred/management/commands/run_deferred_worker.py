"""Run the deferred-jobs worker until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from deferred.broker import BrokerError
from deferred.worker import Worker

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


class Command(BaseCommand):
    help = (
        "Consume the ready queues and run deferred jobs. SIGTERM/SIGINT finish the running "
        "jobs, then exit 0."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="NAME",
            help="A queue of DEFERRED['QUEUES'] to consume (repeatable; default: all of them).",
        )
        parser.add_argument(
            "--concurrency",
            type=_positive_int,
            default=1,
            help="Jobs run at once, in threads (default 1).",
        )
        parser.add_argument(
            "--no-schedules",
            action="store_true",
            help="Never schedule the recurring jobs (other workers do; default: compete for it).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        logger = logging.getLogger("deferred")
        level = _LEVELS.get(options["verbosity"], logging.INFO)
        if not logger.handlers and not logging.getLogger().handlers:
            # Nothing in LOGGING for us: log to stderr so the worker is never silent.
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            logger.addHandler(handler)
            logger.setLevel(level)
        elif options["verbosity"] != 1:
            logger.setLevel(level)
        try:
            worker = Worker(
                queues=options["queues"],
                concurrency=options["concurrency"],
                schedules=not options["no_schedules"],
            )
        except (ImproperlyConfigured, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        try:
            worker.run()
        except BrokerError as exc:
            # A missing topology with DECLARE off, or the broker refusing the
            # check (e.g. permissions): configuration errors, not outages,
            # which the worker rides out by reconnecting.
            raise CommandError(str(exc)) from exc
