"""Run the deferred-jobs worker until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from deferred.broker import BrokerError
from deferred.conf import get_settings
from deferred.worker import Worker
from deferred.worker.exits import WorkerExit
from deferred.worker.health import HealthFile
from deferred.worker.metrics import MetricsError, WorkerMetrics, prometheus_client
from deferred.worker.recycling import Recycling
from deferred.worker.supervisor import Liveness, Supervisor, child_command

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def _default_logging(level: int, verbosity: int) -> None:
    """Log to stderr, with timestamps, when the project's ``LOGGING`` says nothing of
    where records go: the worker's lines and the tasks' own (``logger.info()`` in a
    task shows, where Python's last-resort handler would print warnings alone, bare).

    The root logger gets the handler, at INFO (DEBUG is ``deferred``'s alone with
    ``-v 2``: other libraries' debug lines would drown it); pika stays at WARNING,
    its INFO lines being one per connection and channel. A project that configured
    a root or ``deferred`` handler keeps its own; ``-v`` still sets ``deferred``'s level.
    """
    deferred = logging.getLogger("deferred")
    root = logging.getLogger()
    if not deferred.handlers and not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
        root.setLevel(max(level, logging.INFO))
        deferred.setLevel(level)
        pika = logging.getLogger("pika")
        if pika.level == logging.NOTSET:
            pika.setLevel(logging.WARNING)
        # Django's default LOGGING gives "django" a console handler of its own (shown
        # with DEBUG on): its lines must not come out twice.
        django_logger = logging.getLogger("django")
        if django_logger.handlers:
            django_logger.propagate = False
            # ... but the task framework's own lines (Django 6's "django.tasks": "Task
            # id=... state=RUNNING") are the tasks', shown whatever DEBUG says.
            framework = logging.getLogger("django.tasks")
            if not framework.handlers:
                framework.addHandler(handler)
                framework.propagate = False
    elif verbosity != 1:
        deferred.setLevel(level)


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _liveness_s(grace_s: float) -> float:
    """How long a child may run no Python code before its parent kills it: twice the
    time limits' grace, at least 10 s (the child's own watchdog acts within the grace,
    when it can run at all)."""
    return max(10.0, 2 * grace_s)


def _recycling(options: dict[str, Any]) -> Recycling | None:
    jobs, memory = options["max_jobs_per_child"], options["max_memory_per_child"]
    if jobs is None and memory is None:
        return None
    return Recycling(max_jobs=jobs, max_memory_mib=memory)


def _port(value: str) -> int:
    number = _positive_int(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {number}")
    return number


class Command(BaseCommand):
    help = (
        "Consume the ready queues and run deferred jobs. SIGTERM/SIGINT finish the running "
        "jobs, then exit 0. A worker that makes way for a fresh process exits 3 (recycled: "
        "--max-jobs-per-child, --max-memory-per-child) or 4 (a job ran past its hard time "
        "limit)."
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
            "--processes",
            type=_positive_int,
            default=1,
            help="Worker processes under this one, each with --concurrency threads, for "
            "CPU-bound tasks; a process that dies is started again (default 1: no parent).",
        )
        parser.add_argument(
            "--max-jobs-per-child",
            type=_positive_int,
            metavar="J",
            help="Make way for a fresh process after J jobs: finish the running ones, hand "
            "back the held ones, exit 3 (the --processes parent starts another at once; "
            "default: never).",
        )
        parser.add_argument(
            "--max-memory-per-child",
            type=_positive_int,
            metavar="MB",
            help="Make way for a fresh process once it holds more than MB MiB of resident "
            "memory, as --max-jobs-per-child does (default: never).",
        )
        parser.add_argument(
            "--metrics-port",
            type=_port,
            metavar="PORT",
            help="Serve Prometheus metrics on this port at /metrics (needs "
            "the prometheus extra; default: off).",
        )
        parser.add_argument(
            "--metrics-address",
            default="0.0.0.0",
            metavar="ADDRESS",
            help="The address the metrics port listens on (default 0.0.0.0: every interface).",
        )
        parser.add_argument(
            "--health-file",
            metavar="PATH",
            help="Touch this file every 2 s while connected and consuming; removed when not "
            "(for a Kubernetes exec probe).",
        )
        parser.add_argument(
            "--no-schedules",
            action="store_true",
            help="Never schedule the recurring jobs (other workers do; default: compete for it).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        _default_logging(_LEVELS.get(options["verbosity"], logging.INFO), options["verbosity"])
        if options["processes"] > 1:
            self._supervise(options)
            return
        metrics = None
        Liveness.from_environment()  # under --processes: tell the parent this child runs
        try:
            settings = get_settings()
            health = HealthFile(options["health_file"]) if options["health_file"] else None
            if options["metrics_port"] is not None:
                metrics = WorkerMetrics(settings.queues)
            worker = Worker(
                queues=options["queues"],
                concurrency=options["concurrency"],
                schedules=not options["no_schedules"],
                metrics=metrics,
                health=health,
                recycling=_recycling(options),
            )
            if metrics is not None:
                metrics.serve(options["metrics_port"], options["metrics_address"])
        except (ImproperlyConfigured, ValueError, MetricsError) as exc:
            raise CommandError(str(exc)) from exc
        try:
            worker.run()
        except BrokerError as exc:
            # A missing topology with DECLARE off, or the broker refusing the
            # check (e.g. permissions): configuration errors, not outages,
            # which the worker rides out by reconnecting.
            raise CommandError(str(exc)) from exc
        finally:
            if metrics is not None:
                metrics.close()
        if worker.exit_status == WorkerExit.TIMED_OUT:
            # The thread given up still runs, and may hold others the interpreter
            # would wait for at exit (an async task's event loop): end at once.
            logging.shutdown()
            os._exit(int(worker.exit_status))
        if worker.exit_status != WorkerExit.STOPPED:
            # A planned exit: its own status, for the parent, systemd or Kubernetes.
            raise SystemExit(int(worker.exit_status))

    def _supervise(self, options: dict[str, Any]) -> None:
        """``--processes N``: check what every child would check, then start and watch them."""
        try:
            settings = get_settings()
            if options["metrics_port"] is not None:
                prometheus_client()
                if options["metrics_port"] + options["processes"] - 1 > 65535:
                    raise CommandError("--metrics-port: the ports of every process pass 65535.")
            if options["health_file"]:
                HealthFile(options["health_file"])
            Worker(queues=options["queues"], concurrency=options["concurrency"], schedules=False)
        except (ImproperlyConfigured, ValueError, MetricsError) as exc:
            raise CommandError(str(exc)) from exc
        argv = ["--concurrency", str(options["concurrency"]), "-v", str(options["verbosity"])]
        for queue in options["queues"] or ():
            argv += ["--queue", queue]
        if options["no_schedules"]:
            argv.append("--no-schedules")
        for option in ("max_jobs_per_child", "max_memory_per_child"):
            if options[option] is not None:
                argv += [f"--{option.replace('_', '-')}", str(options[option])]
        if options["metrics_port"] is not None:
            argv += ["--metrics-address", options["metrics_address"]]
        code = Supervisor(
            options["processes"],
            child_command(argv),
            metrics_port=options["metrics_port"],
            health_file=options["health_file"],
            liveness_s=_liveness_s(settings.time_limit_grace_s),
        ).run()
        if code:
            raise CommandError("A worker process did not finish cleanly.", returncode=code)
