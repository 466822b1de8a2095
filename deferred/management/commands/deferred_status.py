"""Show what waits where: ready queues, delay levels, failed jobs, topology versions."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from deferred.broker import BrokerError
from deferred.conf import DeferredSettings
from deferred.management.arguments import command_settings, seconds
from deferred.operate import status, status_text
from deferred.records import results

#: ANSI: cursor home, then clear the screen (what ``watch`` does between frames).
CLEAR_SCREEN = "\x1b[H\x1b[2J"


class Command(BaseCommand):
    help = (
        "Jobs ready, running and failed per queue, jobs pending per delay level and how long "
        "they can still wait, and the topology versions alive. Reads the broker over AMQP "
        "(passive declares); unacked counts need RabbitMQ's management API."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the figures as JSON.")
        parser.add_argument(
            "--watch",
            type=seconds(0.1),
            metavar="SECONDS",
            help="Refresh every SECONDS until Ctrl-C (with --json: one document per line).",
        )
        parser.add_argument(
            "--job",
            metavar="JOB_ID",
            help="Print that job's result instead (deferred.result()): its state, attempts, "
            "times, worker, return value and errors.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        settings = command_settings()
        as_json, every = options["json"], options["watch"]
        if options["job"] is not None:
            self._job(options["job"], as_json)
            return
        if every is None:
            try:
                snapshot = status.collect(settings).snapshot
            except BrokerError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(
                json.dumps(snapshot.to_dict(), indent=2)
                if as_json
                else status_text.render_text(snapshot)
            )
            return
        # Ctrl-C (or SIGTERM) ends the loop even when the KeyboardInterrupt lands
        # inside pika's I/O loop, which can swallow it: a flag is checked too.
        stop = threading.Event()

        def interrupted(_signum: int, _frame: Any) -> None:
            stop.set()
            raise KeyboardInterrupt

        previous = {
            signum: signal.signal(signum, interrupted) for signum in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            while not stop.is_set():
                self._frame(settings, as_json)
                stop.wait(every)
        except KeyboardInterrupt:
            return
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _job(self, job_id: str, as_json: bool) -> None:
        try:
            found = results.result(job_id)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        except BrokerError as exc:
            raise CommandError(f"The results cannot be read: {exc}") from exc
        self.stdout.write(
            json.dumps(found.as_dict(), indent=2) if as_json else results.render_text(found)
        )

    def _frame(self, settings: DeferredSettings, as_json: bool) -> None:
        """One refresh of ``--watch``: a broker that is down is reported, not fatal."""
        try:
            snapshot = status.collect(settings).snapshot
        except BrokerError as exc:
            if as_json:
                self.stdout.write(json.dumps({"error": str(exc)}))
            else:
                self.stdout.write(CLEAR_SCREEN, ending="")
                self.stderr.write(str(exc))
            return
        if as_json:
            self.stdout.write(json.dumps(snapshot.to_dict()))
        else:
            self.stdout.write(CLEAR_SCREEN + status_text.render_text(snapshot))
        self.stdout.flush()
