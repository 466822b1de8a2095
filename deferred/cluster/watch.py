"""The worker's watch over stuck dead-letters (see :mod:`deferred.cluster.stuck`).

A thread of the worker reads the management API every few seconds, logs
each stuck queue once per episode at ERROR, with the job count and the exact
repair, and, with ``DEFERRED['REPAIR_STUCK']`` on and the rights to do it,
forces the leader election itself (:mod:`deferred.cluster.repair`). The rights: a
management user with the ``administrator`` tag on RabbitMQ 3.13 and later,
or the cluster's Erlang cookie for ``rabbitmq-queues`` on this host. Without
them it keeps logging what an operator should run.

A queue is repaired only when two readings in a row find it stuck: a queue
under a heavy, steady flow of dead-letters can look stuck in one reading
(its count never falls to zero between samples although every message moves
on), and a needless election is itself a leader change.

Several workers may watch the same cluster. After a repair, each waits for
``STUCK_AFTER`` and the API's lag before it judges that queue again, and a second election of
a queue that was already released costs a moment of leadership, nothing else.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from django.template.defaultfilters import pluralize

from deferred.broker.http_api import ManagementAPI
from deferred.cluster import repair
from deferred.cluster.stuck import NO_COUNTS, Episodes, find_stuck
from deferred.conf import DeferredSettings

logger = logging.getLogger("deferred.watch")

#: The longest pause between two readings.
MAX_INTERVAL_S = 15.0
#: After a leader change the management API may report the old leader's
#: figures for a minute: a repaired queue is not judged again before this.
STATS_LAG_S = 90.0


class StuckWatch:
    """Reads the management API until stopped; a no-op when it never answers."""

    def __init__(self, settings: DeferredSettings, prefix: str, api: ManagementAPI) -> None:
        self.settings = settings
        self.prefix = prefix
        self.api = api
        self.interval_s = min(MAX_INTERVAL_S, settings.stuck_after_s / 2)
        self.episodes = Episodes()
        #: Queue -> monotonic time before which it is not repaired again.
        self._quiet_until: dict[str, float] = {}
        #: The queues the previous reading found stuck.
        self._previous: set[str] = set()
        #: Whether the missing message counts were logged (once per worker).
        self._told_uncounted = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deferred-stuck-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s * random.uniform(0.8, 1.2)):
            try:
                self.check()
            except Exception:  # the watch must never take the worker down
                logger.exception("Checking for stuck dead-letters failed; trying again later.")

    def check(self) -> list[repair.Repair]:
        """One reading: report new stuck queues and repair them if allowed; what was done."""
        queues = self.api.queues(self.prefix, history_s=self.settings.stuck_after_s)
        if queues is None:
            return []
        if self.api.counts_disabled():
            if not self._told_uncounted:
                logger.warning("The worker cannot watch its delay queues: %s.", NO_COUNTS)
                self._told_uncounted = True
            return []
        now = time.monotonic()
        stuck = [
            s
            for s in find_stuck(
                queues, repair.delay_queues(queues, self.prefix), self.settings.stuck_after_s
            )
            if self._quiet_until.get(s.queue, 0.0) <= now
        ]
        for s in self.episodes.new(stuck):
            logger.error(
                "%d job%s stuck in quorum queue %s: dead-lettered and not forwarded for "
                "%.0f s (a RabbitMQ bug after a leader change; leader %s). A leader election "
                "releases them: `python manage.py deferred_repair`, or run: %s",
                s.jobs,
                pluralize(s.jobs),
                s.queue,
                s.for_s,
                s.leader,
                " && ".join(repair.commands(s, self.api.vhost)),
            )
        confirmed = [s for s in stuck if s.queue in self._previous]
        self._previous = {s.queue for s in stuck}
        if not self.settings.repair_stuck:
            return []
        done = []
        for s in confirmed:
            self._previous.discard(s.queue)
            result = repair.repair(s, self.api)
            self._quiet_until[s.queue] = now + self.settings.stuck_after_s + STATS_LAG_S
            if result.done:
                logger.warning(
                    "Forced a leader election of %s (%s) to release %d stuck job%s%s.",
                    s.queue,
                    result.method,
                    s.jobs,
                    pluralize(s.jobs),
                    f"; but {result.problem}" if result.problem else "",
                )
            else:
                logger.error(
                    "Cannot repair %s from this worker (%s): run %s",
                    s.queue,
                    result.problem,
                    " && ".join(result.commands),
                )
            done.append(result)
        return done
