"""The worker: consume ready queues, run registered tasks, ack after they return.

Threads: the thread that calls :meth:`Worker.run` owns the broker connection
and only does I/O (deliveries, acks, heartbeats); jobs run in a thread pool,
so a long job never starves the heartbeats, and each job hands its ack back
to the I/O thread. Prefetch equals concurrency, across all its queues
(deferred.broker.consumer): this worker never holds more jobs than it can
start, and the rest stay available to others.

Cancels: a reader thread follows the cancels stream (deferred.cancels); a
job found there is acked without running (``outcome=cancelled``), and a job
cancelled while it ran is not retried.

Shutdown (SIGTERM/SIGINT, or :meth:`stop`): cancel the consumers first so no
new job arrives, let the running jobs finish while the I/O thread goes on
acking and heart-beating, then close and return.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from types import FrameType
from typing import Any

from django.db import close_old_connections

from deferred import failures, intake, signing, tracing
from deferred.broker import (
    BrokerError,
    BrokerUnavailable,
    Consumer,
    Delivery,
    TopologyNotDeclared,
    publisher,
    verify_topology,
)
from deferred.cancels import CancelWatch, cancel_route_missing
from deferred.cluster import management_api
from deferred.conf import DeferredSettings, get_settings
from deferred.delays import capped_delay_ms
from deferred.health import HealthFile
from deferred.jobs import Job, utcnow
from deferred.metrics import UNKNOWN as UNKNOWN_TASK_LABEL
from deferred.metrics import WorkerMetrics
from deferred.publishing import note_verified, publish
from deferred.retries import Decision
from deferred.runnable import resolve
from deferred.scheduler import Scheduler, scheduled_tasks
from deferred.tasks import UnknownTask, get_task
from deferred.topology import plan_topology
from deferred.watch import StuckWatch

logger = logging.getLogger("deferred.worker")

#: Reconnection waits double from the first to the last, then stay there.
RECONNECT_FIRST_S = 0.5
RECONNECT_CAP_S = 30.0
#: How long to wait before handing back a job whose failure could not be stored.
REQUEUE_PAUSE_S = 2.0
#: Log level of the per-job line by outcome; anything else is a failure (ERROR).
_OUTCOME_LEVELS = {
    "succeeded": logging.INFO,
    "rescheduled": logging.INFO,
    "retrying": logging.WARNING,
    "cancelled": logging.INFO,
}
#: The worker's line per job (logger ``deferred.worker``), then ``key=value`` extras:
#: ``reason=`` and ``error=`` for a failure, ``retry_in_ms=`` for a retry,
#: ``early_by_ms=`` or ``wait_for_cancels_ms=`` for a reschedule.
JOB_LINE = "job=%s task=%s attempt=%d lateness_ms=%.1f outcome=%s duration_ms=%.1f%s"
#: How long a job waits for the cancels to be read before it goes back to wait,
CANCELS_TIMEOUT_S = 10.0
#: and how long it then waits in the delay queues before it is tried again.
CANCELS_RETRY_S = 5.0
#: On classic ready queues: how many deliveries of this job ended without an ack.
DELIVERIES_HEADER = "x-deferred-deliveries"


class _Released(Exception):
    """The connection that delivered a job went while it waited: it is not ours any more."""


class Worker:
    """Runs jobs from the ready queues of ``queues`` until stopped."""

    def __init__(
        self,
        *,
        queues: Iterable[str] | None = None,
        concurrency: int = 1,
        settings: DeferredSettings | None = None,
        install_signal_handlers: bool = True,
        poll_interval: float = 0.2,
        schedules: bool = True,
        metrics: WorkerMetrics | None = None,
        health: HealthFile | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        names = list(queues or self.settings.queues)
        unknown = [q for q in names if q not in self.settings.queues]
        if unknown:
            raise ValueError(
                f"Queue(s) {', '.join(unknown)} not in DEFERRED['QUEUES'] "
                f"{list(self.settings.queues)!r}."
            )
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}.")
        self.queues = names
        #: Names this worker in django.tasks results (``worker_ids``) and in retried jobs.
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        #: Quorum queues count deliveries themselves (x-delivery-limit).
        self.count_redeliveries = self.settings.queue_type == "classic"
        self.concurrency = concurrency
        self.install_signal_handlers = install_signal_handlers
        self.poll_interval = poll_interval
        plan = plan_topology(self.settings)
        self.plan = plan
        self.consumer = Consumer(
            self.settings.broker_urls,
            [plan.ready_queues[q].name for q in names],
            prefetch=concurrency,
        )
        #: Set while the worker is consuming (tests and health checks wait on it).
        self.consuming = threading.Event()
        self._stopping = threading.Event()
        self._inflight = 0
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        #: Knows the cancelled job ids: every job is checked against it before it runs.
        self.cancels = CancelWatch(self.settings)
        #: How many messages ended how, by outcome ("succeeded", "cancelled", ...).
        self.outcomes: Counter[str] = Counter()
        #: Prometheus metrics (``--metrics-port``), if asked for.
        self.metrics = metrics
        #: A file touched while consuming (``--health-file``), if asked for.
        self.health = health
        #: Task names resolved here: the only task labels the metrics use.
        self._known_tasks: set[str] = set()
        #: Competes to schedule the recurring jobs (if there are any and ``schedules``).
        self.scheduler = (
            Scheduler(self.settings, self.worker_id)
            if schedules and scheduled_tasks(self.settings)
            else None
        )

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask the worker to stop taking jobs and return once the running ones are done.

        Safe to call from any thread and from a signal handler.
        """
        self._stopping.set()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._stopping.is_set():
            logger.warning("%s again: still waiting for %d running job(s).", name, self._inflight)
        else:
            logger.warning(
                "%s received: finishing %d running job(s), then exiting.", name, self._inflight
            )
        self.stop()

    def run(self) -> None:
        """Consume until :meth:`stop` or a signal; reconnect whenever the broker goes away.

        With ``DECLARE`` off, every (re)connection first checks that the whole
        topology exists, and a missing part raises ``TopologyNotDeclared``
        instead of a retry: nothing this worker does can create it, and a
        worker that waits in silence hides a deploy that forgot the
        infrastructure.
        """
        previous = self._install_signals()
        self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="deferred-job")
        self.cancels.start()
        watch = self._stuck_watch()
        if watch is not None:
            watch.start()
        if self.scheduler is not None:
            self.scheduler.start()
        wait_s = RECONNECT_FIRST_S
        try:
            while not self._stopping.is_set():
                try:
                    if not self.settings.declare:
                        verify_topology(self.settings.broker_urls, self.plan)
                        # Its retries and reschedules need not check again.
                        note_verified(self.settings)
                        self._check_cancel_route()
                    self.consumer.start(self._on_delivery)
                    self._consuming(True)
                    logger.info(
                        "Worker consuming %s at %s with concurrency %d.",
                        ", ".join(self.consumer.queues),
                        self.consumer.node.address if self.consumer.node else "?",
                        self.concurrency,
                    )
                    wait_s = RECONNECT_FIRST_S
                    while not self._stopping.is_set():
                        self.consumer.poll(self.poll_interval)
                        if self.health is not None:
                            self.health.beat()
                    self._consuming(False)
                    self.consumer.cancel()
                    self._drain()
                except (BrokerUnavailable, TopologyNotDeclared) as exc:
                    self._consuming(False)
                    if isinstance(exc, TopologyNotDeclared) and not self.settings.declare:
                        logger.critical("Worker stopping: %s", exc)
                        raise
                    if self._stopping.is_set():
                        logger.error("Broker lost while stopping: %s", exc)
                        break
                    logger.error(
                        "RabbitMQ unavailable: %s. Running jobs go on; their messages will be "
                        "redelivered. Reconnecting in %.1f s.",
                        exc,
                        wait_s,
                    )
                    self._stopping.wait(wait_s)
                    wait_s = min(wait_s * 2, RECONNECT_CAP_S)
        finally:
            self._consuming(False)
            if watch is not None:
                watch.stop()
            if self.scheduler is not None:
                self.scheduler.stop()
            self._executor.shutdown(wait=True)
            self.cancels.stop()
            self.consumer.close()
            self._restore_signals(previous)
            logger.info("Worker stopped.")

    def _consuming(self, consuming: bool) -> None:
        """Say whether jobs are being taken: the event, the health file and the gauge."""
        if consuming:
            self.consuming.set()
        else:
            self.consuming.clear()
        if self.health is not None:
            if consuming:
                self.health.beat(force=True)
            else:
                self.health.remove()
        if self.metrics is not None:
            self.metrics.up.set(1 if consuming else 0)

    def _stuck_watch(self) -> StuckWatch | None:
        """On quorum queues, a watch over stuck dead-letters, if the management API may be asked."""
        if self.settings.queue_type != "quorum" or not self.settings.management_urls:
            return None
        return StuckWatch(self.settings, self.plan.prefix, management_api(self.settings))

    def _drain(self) -> None:
        """Keep doing I/O (acks, heartbeats) until no job is running."""
        if self._inflight:
            logger.info("Waiting for %d running job(s) to finish.", self._inflight)
        while self._inflight:
            self.consumer.poll(0.05)
        self.consumer.poll(0)  # deliver the last acks

    def _install_signals(self) -> dict[int, Any]:
        if (
            not self.install_signal_handlers
            or threading.current_thread() is not threading.main_thread()
        ):
            return {}
        previous: dict[int, Any] = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, self._on_signal)
        return previous

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    # ------------------------------------------------------------------ jobs

    def _on_delivery(self, delivery: Delivery) -> None:
        """On the I/O thread: hand the message to the pool, or back if stopping."""
        if self._stopping.is_set():
            self.consumer.settle_threadsafe(delivery, ack=False, requeue=True)
            return
        with self._lock:
            self._inflight += 1
        assert self._executor is not None
        self._executor.submit(self._execute, delivery)

    def _execute(self, delivery: Delivery) -> None:
        """In a pool thread: process one message, then ask the I/O thread to settle it."""
        ack = released = False
        try:
            if not self.consumer.holds(delivery):
                raise _Released
            outcome = self.process(delivery)
            with self._lock:
                self.outcomes[outcome] += 1
            ack = True
        except _Released:
            # Its connection is gone, so RabbitMQ has already redelivered it:
            # running it here too would only make a duplicate.
            logger.info("Skipping a job delivered on a lost connection; it was redelivered.")
            released = True
        except BrokerError as exc:
            logger.error(
                "Could not record the outcome of a message from %s (%s); handing it back "
                "to RabbitMQ in %.0f s.",
                delivery.queue,
                exc,
                REQUEUE_PAUSE_S,
            )
            self._stopping.wait(REQUEUE_PAUSE_S)
        except BaseException:
            logger.exception(
                "Unexpected error handling a message from %s; handing it back to RabbitMQ "
                "in %.0f s.",
                delivery.queue,
                REQUEUE_PAUSE_S,
            )
            self._stopping.wait(REQUEUE_PAUSE_S)
        finally:
            if not released and not self.consumer.settle_threadsafe(
                delivery, ack=ack, requeue=True
            ):
                # A connection lost, or the broker's consumer timeout: a job
                # held longer than it is taken back and run by another worker.
                logger.warning(
                    "The delivery of this job from %s was taken back while it ran (a lost "
                    "connection, or the broker's consumer timeout); RabbitMQ will redeliver "
                    "it, so it may run again. Jobs that run this long need a longer timeout: "
                    "DEFERRED['CONSUMER_TIMEOUT'] for quorum queues, consumer_timeout in "
                    "rabbitmq.conf for classic ones.",
                    delivery.queue,
                )
            with self._lock:
                self._inflight -= 1

    def process(self, delivery: Delivery) -> str:
        """Run or dispose of one message; return its outcome.

        Raises ``BrokerError`` only when the outcome (a retry, a failure
        record) could not be made durable: the message must then not be acked.
        """
        job = intake.read(delivery.body, delivery.headers, self.settings)
        if isinstance(job, intake.Refused):
            return self._refuse(delivery, job)

        # Read every cancel confirmed before the job came due first: a cancel
        # issued a moment before must win (clocks agreeing, as for "never early").
        try:
            cancelled = self.cancels.is_cancelled(
                job.id, CANCELS_TIMEOUT_S, due=job.due.timestamp()
            )
        except BrokerUnavailable as exc:
            self._check_held(delivery)
            # Not run on a guess, and not handed back either (each hand-back
            # counts towards DELIVERY_LIMIT): it waits in the delay queues.
            return self._wait_for_cancels(job, delivery, exc)
        # The wait may have been long enough for the delivering node to go.
        self._check_held(delivery)
        if cancelled:
            self._log(job, (utcnow() - job.due).total_seconds() * 1000, "cancelled", 0.0)
            return "cancelled"

        if delivery.redelivered and self.count_redeliveries:
            outcome = self._count_redelivery(delivery, job)
            if outcome:
                return outcome

        started = utcnow()
        lateness_ms = (started - job.due).total_seconds() * 1000
        if lateness_ms < 0:
            return self._reschedule_early(job, delivery, started)
        try:
            task = resolve(job)
            self._known_tasks.add(job.task)
        except UnknownTask as exc:
            if job.occurrence is not None:
                # Planned before its task left the code: the schedule is gone too.
                logger.warning(
                    "Dropping occurrence %s of schedule %s: no such task any more.",
                    job.occurrence.isoformat(),
                    job.task,
                )
                self._count(job, "dropped")
                return "dropped"
            self._fail(job, delivery, failures.UNKNOWN_TASK, exc)
            self._log(job, lateness_ms, "failed", 0.0, "reason=unknown_task")
            return "failed"

        clock = time.monotonic()
        error: BaseException | None = None
        if self.metrics is not None:
            self.metrics.running.inc()
        try:
            close_old_connections()
            with tracing.consumer_span(job, delivery.headers, job.queue, lateness_ms):
                task.run(job, self.worker_id)
        except BaseException as exc:  # noqa: BLE001 - any failure is retried or recorded
            error = exc
        finally:
            close_old_connections()
            if self.metrics is not None:
                self.metrics.running.dec()
        duration_ms = (time.monotonic() - clock) * 1000
        if error is None:
            self._log(job, lateness_ms, "succeeded", duration_ms, ran=True)
            return "succeeded"
        if self._cancelled_while_running(job):
            # Cancelled while it ran: it finished, and is neither retried nor kept as failed.
            self._log(
                job,
                lateness_ms,
                "cancelled",
                duration_ms,
                f"error={type(error).__name__}: {failures.describe(error)}",
                ran=True,
            )
            return "cancelled"

        decision = task.retry_policy(self.settings).decide(error, job.attempt)
        if decision.retry:
            try:
                return self._retry(job, delivery, decision.delay, lateness_ms, duration_ms, error)
            except (TypeError, ValueError) as bad_delay:  # e.g. Retry(delay=-1)
                error = bad_delay
                decision = Decision(False, reason=failures.TASK_ERROR)
        self._fail(job, delivery, decision.reason, error)
        self._log(
            job,
            lateness_ms,
            "failed",
            duration_ms,
            f"reason={decision.reason} error={type(error).__name__}: {failures.describe(error)}",
            ran=True,
        )
        return "failed"

    def _check_cancel_route(self) -> None:
        """Log, once per connection, a topology whose cancels cannot be routed.

        Jobs still run (the worker reads the stream directly); ``cancel()``
        raises until the infrastructure applies this version's definitions.
        """
        missing = cancel_route_missing(self.settings)
        if missing:
            logger.error(
                "The topology lacks the %s: cancel() raises TopologyNotDeclared until the "
                "definitions of this version are applied (declare_delay_topology --format "
                "definitions, or run declare_delay_topology).",
                missing,
            )

    def _refuse(self, delivery: Delivery, refused: intake.Refused) -> str:
        """Send a message that is not a job to run to the failed queue, as it came.

        Logged with its message id and why: a body that failed the size or
        signature check was not read, and its content (a forged job's
        arguments could be anything) is not shown.
        """
        record = failures.failure_record(
            reason=refused.reason,
            job=None,
            body=delivery.body,
            detail=refused.detail,
            message_id=delivery.message_id,
            keep_body=refused.keep_body,
        )
        failures.store_failure(self.settings, record)
        logger.error(
            "job=%s queue=%s outcome=failed reason=%s detail=%s",
            record["id"],
            delivery.queue,
            refused.reason,
            refused.detail,
        )
        if self.metrics is not None:
            self.metrics.outcome(UNKNOWN_TASK_LABEL, self._target_of(delivery.queue), "failed")
        return "failed"

    def _check_held(self, delivery: Delivery) -> None:
        """Raise ``_Released`` if ``delivery``'s connection went while the job waited.

        Waiting for the cancels can take seconds when a node dies; the
        message is then redelivered elsewhere, and running (or re-publishing)
        this copy would duplicate it.
        """
        if not self.consumer.holds(delivery):
            raise _Released

    def _cancelled_while_running(self, job: Job) -> bool:
        """Whether a job whose attempt just failed was cancelled meanwhile.

        If the cancels cannot be read now, what is known decides: the retry,
        if any, is checked again when it comes due.
        """
        try:
            return self.cancels.is_cancelled(job.id, CANCELS_TIMEOUT_S)
        except BrokerUnavailable:
            return job.id in self.cancels.view

    def _wait_for_cancels(self, job: Job, delivery: Delivery, error: BrokerError) -> str:
        """Send a due job back for a short wait while the cancels cannot be read."""
        wait_ms = capped_delay_ms(
            CANCELS_RETRY_S,
            now=utcnow(),
            resolution_ms=self.settings.resolution_ms,
            max_delay_ms=self.settings.max_delay_ms,
        )
        publish(job, wait_ms, settings=self.settings, headers=tracing.carried(delivery.headers))
        self._log(
            job,
            (utcnow() - job.due).total_seconds() * 1000,
            "rescheduled",
            0.0,
            f"wait_for_cancels_ms={wait_ms} error={error}",
        )
        return "rescheduled"

    def _fail(self, job: Job, delivery: Delivery, reason: str, error: BaseException) -> None:
        record = failures.failure_record(reason=reason, job=job, body=delivery.body, error=error)
        failures.store_failure(self.settings, record)

    def _retry(
        self,
        job: Job,
        delivery: Delivery,
        delay: Any,
        lateness_ms: float,
        duration_ms: float,
        error: BaseException,
    ) -> str:
        """Publish the next attempt through the delay topology (confirmed) before the ack.

        The worker never sleeps on a retry and never holds the message: the
        wait happens in the broker, like any other delay.
        """
        now = utcnow()
        wait_ms = capped_delay_ms(
            delay,
            now=now,
            resolution_ms=self.settings.resolution_ms,
            max_delay_ms=self.settings.max_delay_ms,
        )
        publish(
            job.next_attempt(now + timedelta(milliseconds=wait_ms), worker=self.worker_id),
            wait_ms,
            settings=self.settings,
            headers=tracing.carried(delivery.headers),
        )
        self._log(
            job,
            lateness_ms,
            "retrying",
            duration_ms,
            f"retry_in_ms={wait_ms} error={type(error).__name__}: {failures.describe(error)}",
            ran=True,
        )
        return "retrying"

    def _count_redelivery(self, delivery: Delivery, job: Job) -> str | None:
        """Classic queues do not count deliveries, so the worker does.

        A redelivered message was delivered before without an ack: the worker
        running it crashed (or lost its connection). Rather than run it here,
        put a copy carrying the count back in the ready queue (confirmed) and
        ack this one; past DELIVERY_LIMIT the job goes to the failed queue, so
        a job that kills every worker cannot loop forever.
        """
        seen = delivery.headers.get(DELIVERIES_HEADER, 0)
        # Anyone may set a header: a value that is not a count counts as none.
        count = (seen if type(seen) is int and seen >= 0 else 0) + 1
        if count > self.settings.delivery_limit:
            error = RuntimeError(
                f"delivered {count} times without an ack: it may crash the worker "
                f"(DEFERRED['DELIVERY_LIMIT'] is {self.settings.delivery_limit})"
            )
            self._fail(job, delivery, failures.DELIVERY_LIMIT, error)
            self._log(job, 0.0, "failed", 0.0, f"reason=delivery_limit deliveries={count}")
            return "failed"
        publisher(self.settings.broker_urls, self.settings.publish_timeout_s).publish(
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
        )
        logger.warning(
            "job=%s task=%s was redelivered (%d unacked deliveries so far); requeued with "
            "its count.",
            job.id,
            job.task,
            count,
        )
        self._count(job, "requeued")
        return "requeued"

    def _reschedule_early(self, job: Job, delivery: Delivery, now: datetime) -> str:
        """A job that arrived before its due time (e.g. the clocks of two hosts differ)
        goes back to wait for the rest: never early."""
        # At most MAX_DELAY at a time: a job due further out (deferred under a
        # larger MAX_DELAY) simply comes back and waits again.
        wait_ms = capped_delay_ms(
            job.due,
            now=now,
            resolution_ms=self.settings.resolution_ms,
            max_delay_ms=self.settings.max_delay_ms,
        )
        publish(job, wait_ms, settings=self.settings, headers=tracing.carried(delivery.headers))
        self._log(
            job,
            (now - job.due).total_seconds() * 1000,
            "rescheduled",
            0.0,
            f"early_by_ms={wait_ms}",
        )
        return "rescheduled"

    def _log(
        self,
        job: Job,
        lateness_ms: float,
        outcome: str,
        duration_ms: float,
        extra: str = "",
        *,
        ran: bool = False,
    ) -> None:
        """The job's log line, and its count in the metrics (with its timings if it ran)."""
        logger.log(
            _OUTCOME_LEVELS.get(outcome, logging.ERROR),
            JOB_LINE,
            job.id,
            job.task,
            job.attempt,
            lateness_ms,
            outcome,
            duration_ms,
            f" {extra}" if extra else "",
        )
        self._count(
            job,
            outcome,
            lateness_s=lateness_ms / 1000 if ran else None,
            duration_s=duration_ms / 1000 if ran else None,
        )

    def _count(
        self,
        job: Job,
        outcome: str,
        *,
        lateness_s: float | None = None,
        duration_s: float | None = None,
    ) -> None:
        if self.metrics is None:
            return
        label = job.task if self._knows(job) else UNKNOWN_TASK_LABEL
        self.metrics.outcome(
            label, job.queue, outcome, lateness_s=lateness_s, duration_s=duration_s
        )

    def _knows(self, job: Job) -> bool:
        """Whether ``job.task`` names a task of this worker (a bounded label)."""
        if job.task in self._known_tasks:
            return True
        if job.backend is not None:
            return False
        try:
            get_task(job.task)
        except UnknownTask:
            return False
        return True

    def _target_of(self, ready_queue: str) -> str:
        """The ``DEFERRED['QUEUES']`` name of a ready queue (for a message that is no job)."""
        for name, queue in self.plan.ready_queues.items():
            if queue.name == ready_queue:
                return name
        return UNKNOWN_TASK_LABEL
