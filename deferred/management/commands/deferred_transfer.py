"""Move every pending job, failed job and cancel to another broker (blue-green upgrades)."""

from __future__ import annotations

import argparse
import signal
from types import FrameType
from typing import Any

import pika
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import pluralize

from deferred.broker import BrokerError, safe_url
from deferred.management.arguments import command_settings
from deferred.operate.transfer import BATCH, Transfer, TransferError
from deferred.operate.transfer_plan import Progress, Summary


def _amqp_url(value: str) -> str:
    """An argparse ``type``: an amqp:// or amqps:// URL that pika can read."""
    if not value.startswith(("amqp://", "amqps://")):
        raise argparse.ArgumentTypeError(
            f"{safe_or_raw(value)} is not an amqp:// or amqps:// URL "
            "(e.g. amqp://user:password@host:5672/%2F)"
        )
    try:
        pika.URLParameters(value)
    except Exception as exc:  # noqa: BLE001 - pika raises whatever its parsing meets
        raise argparse.ArgumentTypeError(f"not a broker URL pika can read: {exc}") from None
    return value


def safe_or_raw(value: str) -> str:
    """The URL without its password when it can be read, for error messages."""
    try:
        return safe_url(value)
    except Exception:  # noqa: BLE001
        return "the value given"


def _batch(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if not 1 <= number <= 10_000:
        raise argparse.ArgumentTypeError(f"must be between 1 and 10000, got {number}")
    return number


class Command(BaseCommand):
    help = (
        "Move every pending job, failed job and cancel from the broker of "
        "DEFERRED['BROKER_URL'] (or --from) to another broker (--to): the blue-green way to "
        "a new RabbitMQ cluster. Each job keeps its id and due time, and runs once: a "
        "transfer interrupted at any point (SIGINT, SIGTERM, SIGKILL, a lost connection) "
        "and run again moves the rest and doubles nothing. The new broker gets the "
        "topology of these settings if it lacks it (with DECLARE on), and is refused if "
        "its topology differs. Stop the old broker's workers first; point producers at the "
        "new broker. The old scheduler's record goes too, unless the new broker has one: "
        "start the new workers with --no-schedules until the transfer has begun. Prints "
        "its progress every second (-v 0: only the summary). SIGINT or SIGTERM end it "
        "after the batch in hand, with exit status 1."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--to",
            action="append",
            required=True,
            type=_amqp_url,
            metavar="URL",
            help="The new broker (repeat it for each node of a cluster). amqps:// URLs take "
            "pika's ssl_options query argument; DEFERRED['TLS_*'] apply to BROKER_URL only.",
        )
        parser.add_argument(
            "--from",
            dest="source",
            action="append",
            type=_amqp_url,
            metavar="URL",
            help="The old broker (repeatable; default: DEFERRED['BROKER_URL']).",
        )
        parser.add_argument(
            "--batch",
            type=_batch,
            default=BATCH,
            metavar="N",
            help=f"Messages staged, acked and moved together (default {BATCH}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        settings = command_settings()
        verbosity = options["verbosity"]
        transfer = Transfer(
            settings,
            source=options["source"] or settings.broker_urls,
            target=options["to"],
            batch=options["batch"],
            on_progress=self._progress if verbosity >= 1 else None,
        )
        previous = _install_signals(transfer)
        try:
            summary = transfer.run()
        except (TransferError, BrokerError) as exc:
            raise CommandError(
                f"{exc}\nNothing is lost or doubled by stopping here: what was moved is on "
                "the new broker, the rest still on the old one. Run the same command again."
            ) from exc
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self._summary(summary)
        if summary.interrupted:
            raise CommandError(
                "Interrupted: run the same command again to move the rest (nothing is moved twice)."
            )

    def _progress(self, progress: Progress) -> None:
        self.stdout.write(f"Transfer: {progress.line()}")

    def _summary(self, summary: Summary) -> None:
        p = summary.progress
        lines = [
            f"Moved {p.jobs:,} pending job{pluralize(p.jobs)} and {p.failed:,} failed "
            f"job{pluralize(p.failed)} in "
            f"{p.elapsed_s:.1f} s ({p.rate:,.0f}/s).",
        ]
        if p.unroutable:
            lines.append(
                f"{p.unroutable:,} job{pluralize(p.unroutable)} for a queue not in "
                "DEFERRED['QUEUES'] went to the "
                "failed queue (reason unroutable), as they would have on the old broker."
            )
        if p.resumed:
            lines.append(f"{p.resumed:,} of them were staged by an interrupted earlier run.")
        lines.append(
            f"Cancels: {summary.cancels_copied:,} "
            f"record{pluralize(summary.cancels_copied)} copied, "
            f"{summary.cancels_present:,} already there, {summary.cancels_expired:,} no longer "
            "in force left behind."
        )
        if summary.schedules_kept:
            lines.append(
                "Schedules: the new broker's scheduler has a record of its own already; the "
                "old one's was not copied (re-pause there what was paused on the old broker)."
            )
        elif summary.schedules:
            paused = [name for name, is_paused in summary.schedules.items() if is_paused]
            lines.append(
                f"Schedules: the old scheduler's record ({len(summary.schedules)} "
                f"schedule{pluralize(len(summary.schedules))}"
                + (f"; paused: {', '.join(paused)}" if paused else "")
                + ") was copied: the new broker's first scheduling worker goes on from it."
            )
        if summary.schedule_commands:
            lines.append(
                f"{summary.schedule_commands} "
                f"schedule command{pluralize(summary.schedule_commands)} "
                f"sent to the old broker {pluralize(summary.schedule_commands, 'was,were')} "
                "never applied and not copied: send them again (deferred_schedules)."
            )
        if summary.staging_kept:
            lines.append(
                f"The staging queue {summary.staging_kept} stays on the new broker: delete it "
                "once the management UI shows it empty, with no dead-letters in flight."
            )
        style = self.style.WARNING if summary.interrupted else self.style.SUCCESS
        self.stdout.write(style("\n".join(lines)))


def _install_signals(transfer: Transfer) -> dict[int, Any]:
    """SIGINT and SIGTERM end the transfer after its batch in hand (main thread only)."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        transfer.stop()

    previous: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, on_signal)
    except ValueError:  # not the main thread (call_command from a thread)
        pass
    return previous
