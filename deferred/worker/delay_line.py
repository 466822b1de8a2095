"""The worker's ways of putting a job back on the broker, all confirmed before the ack.

Back into the delay line (:meth:`DelayLine.send_back`: a retry, a job that came
early, one waiting for the cancels), back to its ready queue (a hand-back of
held jobs, a redelivery carrying its count on classic queues), or on to the
queue that replaced its own (:meth:`DelayLine.forward`). Each is a fresh,
confirmed publish: the caller acks the delivery it came from only after it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from deferred.broker import Delivery, Outgoing, publisher_for
from deferred.conf import DeferredSettings
from deferred.core import signing, tracing
from deferred.core.delays import capped_delay_ms
from deferred.core.jobs import Job, body_level, utcnow
from deferred.core.topology import Plan
from deferred.producer.publishing import publish
from deferred.worker.copies import DELIVERIES_HEADER


class DelayLine:
    """Publishes jobs back for one worker (``worker_id``), under its settings and plan."""

    def __init__(
        self,
        settings: DeferredSettings,
        plan: Plan,
        worker_id: str,
        holds: Callable[[Delivery], bool],
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.worker_id = worker_id
        #: Whether the worker's connection still holds a delivery (its consumer's).
        self.holds = holds

    def send_back(
        self, job: Job, delivery: Delivery, delay: Any, now: datetime, *, next_attempt: bool = False
    ) -> int:
        """Publish ``job`` back into the delay line, ``delay`` from ``now`` (seconds, a
        ``timedelta`` or a due time; at most ``MAX_DELAY`` at a time), confirmed, with
        the delivery's trace headers, and return the wait in ms: the one way a worker
        sends a job back to wait (a retry, with ``next_attempt``; a job that came
        early; one waiting for the cancels). The caller acks the delivery after."""
        wait_ms = capped_delay_ms(
            delay,
            now=now,
            resolution_ms=self.settings.resolution_ms,
            max_delay_ms=self.settings.max_delay_ms,
        )
        if next_attempt:
            job = job.next_attempt(now + timedelta(milliseconds=wait_ms), worker=self.worker_id)
        publish(job, wait_ms, settings=self.settings, headers=tracing.carried(delivery.headers))
        return wait_ms

    def requeue(self, delivery: Delivery, job: Job, count: int) -> None:
        """Put a copy of a redelivered job back in its ready queue carrying ``count``,
        its deliveries so far (classic queues do not count them themselves)."""
        publisher_for(self.settings).publish(
            "",
            delivery.queue,
            delivery.body,
            message_id=job.id,
            # The job's own signature goes with it: the body is the same.
            headers={
                **tracing.carried(delivery.headers),
                **{k: v for k, v in delivery.headers.items() if k == signing.HEADER},
                DELIVERIES_HEADER: count,
            },
            priority=delivery.priority,
        )

    def hand_back(self, held: list[tuple[Delivery, Job]]) -> list[Delivery]:
        """Put held jobs back in their queues for other workers, as fresh messages
        (confirmed, in one round trip); return the deliveries to ack.

        A fresh copy, not a requeue: the hand-back of a worker that stops, or
        whose threads are all taken, is no failed delivery, so it must not
        count towards ``DELIVERY_LIMIT`` (a requeued message comes back marked
        redelivered, and quorum queues count it). The body, its signature and
        the count so far go as they came. A delivery whose connection went is
        left out: RabbitMQ has it back already.
        """
        ours = [(d, job) for d, job in held if self.holds(d)]
        now = utcnow()
        if ours:
            publisher_for(self.settings).publish_many(
                [
                    # A due job goes to its ready queue, where only a worker with a
                    # free slot takes it; one not due yet to be held again.
                    Outgoing(
                        "",
                        self._ready_for(d.queue) if job.due <= now else d.queue,
                        d.body,
                        job.id,
                        d.headers,
                        d.priority,
                    )
                    for d, job in ours
                ]
            )
        return [d for d, _ in ours]

    def forward(
        self, queue: str, body: bytes, message_id: str | None, headers: dict[str, Any]
    ) -> None:
        """Publish a message of a queue left from before PRIORITIES changed (FIFO, or
        with priorities) to ``queue``, the queue that replaced it, as it came (body,
        signature, counts), with the priority its job asks for; confirmed, so that
        the caller may ack the old copy."""
        # A body that is no job goes as it is: the worker of the new queue refuses it.
        publisher_for(self.settings).publish(
            "",
            queue,
            body,
            message_id=message_id or "",
            headers=headers,
            priority=body_level(body),
        )

    def _ready_for(self, queue: str) -> str:
        """The ready queue beside hold queue ``queue`` (``queue`` itself if it is none)."""
        for name, hold in self.plan.hold_queues.items():
            if hold.name == queue:
                return self.plan.ready_queues[name].name
        return queue
