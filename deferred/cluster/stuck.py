"""Stuck dead-letters: quorum delay queues whose expired jobs never move on.

A quorum queue with at-least-once dead-lettering keeps each expired message
until the queue it is dead-lettered to confirms it. After a leader change (a
node killed or restarted), RabbitMQ sometimes never forwards some of them: the
queue keeps counting them in ``messages``, with none ready and none unacked,
for ever. Waiting does not release them, nor does publishing into the queue;
a new leader election of that one queue does, with nothing lost. This is a
known upstream bug class (rabbitmq-server PRs #7677, #15548, #16203 and issue
#16652, still open on 4.2.4), so every version users are likely to run can
show it.

Each job stuck there is a job that never runs, so the product must see it.
The management API keeps a few minutes of samples of each queue's figures,
from which the dead-lettered, not yet confirmed count is derived
(:attr:`deferred.broker.http_api.QueueInfo.dead_lettered_history`). In normal flow
such messages are confirmed within milliseconds, so a count that stayed above
zero in every sample for ``DEFERRED['STUCK_AFTER']`` (30 s by default) means
stuck. Reading the API's own history keeps this stateless: the one-off
status command and the worker apply the same rule to one request's answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deferred.broker.http_api import SAMPLE_EVERY_S, QueueInfo


@dataclass(frozen=True)
class StuckQueue:
    """A delay queue holding dead-lettered jobs that have not moved for a while."""

    queue: str
    #: The fewest dead-lettered messages in the samples: at least this many
    #: jobs are stuck (any more may be in normal flow).
    jobs: int
    #: How long (seconds) the samples show dead-lettered messages without a break.
    for_s: float
    #: The node leading the queue: the one whose leadership must move.
    leader: str | None
    members: tuple[str, ...]
    online: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "jobs": self.jobs,
            "for_s": round(self.for_s, 1),
            "leader": self.leader,
            "members": list(self.members),
            "online": list(self.online),
        }


#: Why stuck dead-letters cannot be seen when the API gives no message counts.
NO_COUNTS = (
    "stuck dead-letters cannot be detected: RabbitMQ's management API gives no message "
    "counts (the deprecated feature management_metrics_collection is denied: permit it with "
    "deprecated_features.permit.management_metrics_collection = true in rabbitmq.conf). By "
    "hand: `rabbitmqctl list_queues name messages messages_ready messages_unacknowledged`; a "
    "quorum delay queue whose messages stay above ready + unacked holds stuck jobs"
)


def stuck_queue(info: QueueInfo, stuck_after_s: float) -> StuckQueue | None:
    """``info``'s queue as stuck, or ``None`` if its dead-letters moved within ``stuck_after_s``.

    The samples must span ``stuck_after_s`` (a queue younger than that, or a
    broker that keeps no samples, is never called stuck) and all be above
    zero, and so must the current figure.
    """
    if info.dead_lettered <= 0 or not info.dead_lettered_history:
        return None
    newest = info.dead_lettered_history[-1][0]
    # The samples that matter: the window, plus one sampling interval of
    # slack, since the API's samples are taken on its own clock.
    window = [
        (at, count)
        for at, count in info.dead_lettered_history
        if at >= newest - stuck_after_s - SAMPLE_EVERY_S
    ]
    if newest - window[0][0] < stuck_after_s or any(count <= 0 for _at, count in window):
        return None
    return StuckQueue(
        queue=info.name,
        jobs=min(info.dead_lettered, *(count for _at, count in window)),
        for_s=newest - window[0][0],
        leader=info.leader,
        members=info.members,
        online=info.online,
    )


def find_stuck(
    queues: Mapping[str, QueueInfo], names: Iterable[str], stuck_after_s: float
) -> list[StuckQueue]:
    """The stuck queues among ``names`` (the delay queues), as read in ``queues``."""
    found = (stuck_queue(queues[name], stuck_after_s) for name in names if name in queues)
    return [stuck for stuck in found if stuck is not None]


class Episodes:
    """Which stuck queues were already reported: an ERROR once per queue and episode.

    An episode ends when a reading no longer finds the queue stuck.
    """

    def __init__(self) -> None:
        self._open: set[str] = set()

    def new(self, stuck: list[StuckQueue]) -> list[StuckQueue]:
        """Of ``stuck`` (one whole reading), the queues not reported in this episode yet."""
        now = {s.queue for s in stuck}
        fresh = [s for s in stuck if s.queue not in self._open]
        self._open = now
        return fresh
