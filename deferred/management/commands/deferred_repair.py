"""Release stuck dead-letters: force a leader election of each stuck quorum delay queue."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.defaultfilters import pluralize

from deferred.cluster import repair
from deferred.cluster.nodes import management_api
from deferred.cluster.stuck import find_stuck
from deferred.core.topology import plan_topology
from deferred.management.arguments import command_settings, seconds

#: Stuck queues repaired at the same time.
PARALLEL_REPAIRS = 4


class Command(BaseCommand):
    help = (
        "Find quorum delay queues whose dead-lettered jobs have not moved for STUCK_AFTER "
        "(a RabbitMQ bug after a leader change), force a leader election of each (management "
        "API on RabbitMQ 3.13+, else rabbitmq-queues on this host, else print the commands), "
        "then report how many jobs moved on. Needs RabbitMQ's management API to find them."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Only list stuck queues and the commands."
        )
        parser.add_argument(
            "--queue",
            action="append",
            default=[],
            metavar="NAME",
            help="Repair this delay queue even if it does not look stuck (repeatable).",
        )
        parser.add_argument(
            "--wait",
            type=seconds(0),
            default=30.0,
            metavar="SECONDS",
            help="How long to watch the repaired queues release their jobs (default 30).",
        )
        parser.add_argument(
            "--no-cli", action="store_true", help="Never run rabbitmq-queues on this host."
        )
        parser.add_argument("--json", action="store_true", help="Print the outcome as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        settings = command_settings()
        plan = plan_topology(settings)
        api = management_api(settings)
        queues = api.queues(plan.prefix, history_s=settings.stuck_after_s)
        if queues is None:
            raise CommandError(
                "RabbitMQ's management API does not answer (DEFERRED['MANAGEMENT_URL']): it "
                "is what shows stuck dead-letters. Without it, look for quorum delay queues "
                "with messages but none ready or unacked: `rabbitmqctl list_queues -p VHOST "
                "name messages messages_ready messages_unacknowledged leader`, and for each "
                "run `rabbitmq-queues delete_member -p VHOST QUEUE LEADER` then "
                "`rabbitmq-queues add_member -p VHOST QUEUE LEADER`."
            )
        unknown = [name for name in options["queue"] if name not in queues]
        if unknown:
            raise CommandError(f"No such queue under prefix {plan.prefix!r}: {', '.join(unknown)}")
        stuck = find_stuck(queues, repair.delay_queues(queues, plan.prefix), settings.stuck_after_s)
        chosen = {s.queue for s in stuck}
        stuck += [repair.forced(queues[n]) for n in options["queue"] if n not in chosen]
        if not stuck:
            self._say(options, [], "No stuck dead-letters: nothing to repair.")
            return
        use_cli = not options["no_cli"]
        if options["dry_run"]:
            rows = [{**s.to_dict(), "commands": list(repair.commands(s, api.vhost))} for s in stuck]
            lines = []
            for row in rows:
                lines.append(
                    f"{row['queue']}: {row['jobs']} job{pluralize(row['jobs'])} stuck for "
                    f"{row['for_s']:.0f} s, "
                    f"leader {row['leader']}"
                )
                lines += [f"  {command}" for command in row["commands"]]
            self._say(options, rows, "\n".join(lines))
            return
        # Each repair is a few CLI or API calls of its own: several at once.
        with ThreadPoolExecutor(PARALLEL_REPAIRS) as pool:
            repairs = list(pool.map(lambda s: repair.repair(s, api, use_cli=use_cli), stuck))
        done = [(r, queues[s.queue].dead_lettered) for r, s in zip(repairs, stuck, strict=True)]
        # rabbitmqctl asks a node that leads none of the repaired queues now.
        online = [n for s in stuck for n in s.online if n != s.leader]
        outcomes = repair.watch_release(
            api,
            plan.prefix,
            done,
            options["wait"],
            cli_node=None if options["no_cli"] or not online else online[0],
        )
        lines = []
        for outcome in outcomes:
            r = outcome.repair
            if r.done:
                moved = (
                    f"{outcome.released} of {outcome.before} job{pluralize(outcome.before)} "
                    "moved on, "
                    f"{outcome.after} still dead-lettered"
                    if outcome.after is not None
                    else "the queue could not be read afterwards"
                )
                lines.append(f"{r.queue}: new leader elected ({r.method}); {moved}.")
            else:
                lines.append(f"{r.queue}: NOT repaired: {r.problem}. Run:")
                lines += [f"  {command}" for command in r.commands]
            if r.done and r.problem:
                lines.append(f"  but: {r.problem}")
        self._say(options, [o.to_dict() for o in outcomes], "\n".join(lines))
        if any(not o.repair.done for o in outcomes):
            raise CommandError("Some stuck queues were not repaired: see above.")

    def _say(self, options: dict[str, Any], rows: list[dict[str, Any]], text: str) -> None:
        if options["json"]:
            self.stdout.write(json.dumps(rows, indent=2))
        else:
            self.stdout.write(text)
