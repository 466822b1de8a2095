"""The worker: consume ready queues, run registered tasks, ack after they return.

Threads: the thread that calls :meth:`Worker.run` owns the broker connection
and only does I/O (deliveries, acks, heartbeats); jobs run in a thread pool,
so a long job never starves the heartbeats, and each job hands its ack back
to the I/O thread. Prefetch equals concurrency, across all its queues
(deferred.broker.consumer): this worker never holds more jobs than it can
start, and the rest stay available to others.

What happens to one delivery (cancel check, redelivery count, run, retry
or fail, log) is :mod:`deferred.pipeline`; this module is the connection,
the loop and the threads. The metrics and the health file watch through
:class:`deferred.outcomes.Observer`.

The last mile: a job from a hold queue is due within ``HOLD_WINDOW``; the
pipeline says so (:class:`deferred.pipeline.Hold`) and the
:class:`deferred.holding.Holder` keeps it, unacked, until its due time, then
gives it back to the pool. Held jobs have their own prefetch
(``HOLD_PREFETCH``) and never take a running job's slot; on SIGTERM they go
back to their queue at once, as fresh messages, for the other workers.

Cancels: a reader thread follows the cancels stream (deferred.cancels); a
job found there is acked without running (``outcome=cancelled``), and a job
cancelled while it ran is not retried.

Shutdown (SIGTERM/SIGINT, or :meth:`stop`): cancel the consumers first so no
new job arrives, hand the held jobs back, let the running jobs finish while the I/O thread goes on
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
from types import FrameType
from typing import Any

from deferred.broker import (
    BrokerError,
    BrokerUnavailable,
    Consumer,
    Delivery,
    TopologyNotDeclared,
    verify_topology,
)
from deferred.cancels import CancelWatch, cancel_route_missing
from deferred.cluster import management_api
from deferred.conf import DeferredSettings, get_settings
from deferred.health import HealthFile
from deferred.holding import Held, Holder
from deferred.jobs import Job
from deferred.metrics import WorkerMetrics
from deferred.outcomes import Observers, Outcome
from deferred.pipeline import Hold, Pipeline, Released
from deferred.publishing import note_verified
from deferred.scheduler import Scheduler, scheduled_tasks
from deferred.topology import plan_topology
from deferred.watch import StuckWatch

logger = logging.getLogger("deferred.worker")

#: Reconnection waits double from the first to the last, then stay there.
RECONNECT_FIRST_S = 0.5
RECONNECT_CAP_S = 30.0
#: How long to wait before handing back a job whose failure could not be stored.
REQUEUE_PAUSE_S = 2.0


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
        self.concurrency = concurrency
        self.install_signal_handlers = install_signal_handlers
        self.poll_interval = poll_interval
        plan = plan_topology(self.settings)
        self.plan = plan
        self.consumer = Consumer(
            self.settings.broker_urls,
            [plan.ready_queues[q].name for q in names],
            prefetch=concurrency,
            hold_queues=[plan.hold_queues[q].name for q in names],
            hold_prefetch=self.settings.hold_prefetch,
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
        #: Told what the worker does: the metrics and the health file, if any.
        self.observer = Observers([metrics, health])
        #: What happens to each delivery, in the pool's threads.
        self.pipeline = Pipeline(
            self.settings,
            plan,
            cancels=self.cancels,
            holds=self.consumer.holds,
            observer=self.observer,
            worker_id=self.worker_id,
        )
        #: Keeps the jobs due within the hold window until their time.
        self.holder = Holder(self._release, self._hand_back_late, stalled=self._stalled)
        #: When a pool thread last started a message (time.monotonic()).
        self._last_start = 0.0
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
        self.holder.start_thread()
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
                        self.observer.beat()
                    self._consuming(False)
                    self.consumer.cancel()
                    self._hand_back_held()
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
            self._hand_back_held()
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
        """Say whether jobs are being taken: the event, and the observers."""
        if consuming:
            self.consuming.set()
        else:
            self.consuming.clear()
        self.observer.consuming(consuming)

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
        self.consumer.settle_pending()  # the last acks, sent now
        self.consumer.poll(0)

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
        """On the I/O thread: hand the message to the pool, or back if stopping.

        A delivery from a hold queue goes to the pool even then: it is read,
        and handed back as a fresh message, which a requeue would not be.
        """
        if self._stopping.is_set() and not delivery.hold:
            self.consumer.settle_threadsafe(delivery, ack=False, requeue=True)
            return
        job = None
        if delivery.hold:
            # Read here, not in the pool: a worker whose threads are all busy
            # must still hold the job, and hand it back if it comes due so.
            # A due one goes through the holder too (for 0 s): if no thread
            # takes it in time, it goes to its ready queue for a free worker.
            job = self.pipeline.read(delivery)
            seconds = None if job is None else self.pipeline.hold_seconds(job)
            if job is not None and seconds is not None and not self._stopping.is_set():
                if self.holder.hold(delivery, job, seconds) is not None:
                    return
        with self._lock:
            self._inflight += 1
        assert self._executor is not None
        self._executor.submit(self._execute, delivery, job)

    def _release(self, entry: Held) -> None:
        """On the holder's thread: a held job is due; run it in the pool."""
        with self._lock:
            self._inflight += 1
        assert self._executor is not None
        try:
            self._executor.submit(self._execute, entry.delivery, entry.job, entry)
        except RuntimeError:  # the pool is shut down: the holder hands it back
            with self._lock:
                self._inflight -= 1
            raise

    def _stalled(self, seconds: float) -> bool:
        """Whether no pool thread has started a message for ``seconds``: every thread
        is taken by jobs that run long."""
        return time.monotonic() - self._last_start >= seconds

    def _hand_back_late(self, entry: Held) -> None:
        """On the holder's thread: a due job found no free thread in time."""
        self._hand_back([(entry.delivery, entry.job)], "every thread is busy")

    def _hand_back_held(self) -> None:
        """Stopping: every job held and not started goes back at once."""
        left = self.holder.stop()
        if left:
            self._hand_back([(e.delivery, e.job) for e in left], "the worker is stopping")

    def _hand_back(self, held: list[tuple[Delivery, Job]], why: str) -> None:
        """Give held jobs back to their queues for other workers (fresh, uncounted
        copies), then ack them; if that fails, requeue them (then they count)."""
        try:
            handed = self.pipeline.hand_back(held)
        except BrokerError as exc:
            logger.warning(
                "Could not hand back %d held job(s) (%s); requeueing them instead.",
                len(held),
                exc,
            )
            for delivery, _ in held:
                self.consumer.settle_threadsafe(delivery, ack=False, requeue=True)
            return
        for delivery in handed:
            self.consumer.settle_threadsafe(delivery, ack=True)
        if handed:
            logger.info("Handed back %d held job(s) for another worker: %s.", len(handed), why)

    def _execute(
        self, delivery: Delivery, job: Job | None = None, entry: Held | None = None
    ) -> None:
        """In a pool thread: process one message, then ask the I/O thread to settle it.

        ``job`` and ``entry``: a held job, now due (handed back meanwhile if
        the holder took it back first).
        """
        ack = released = False
        self._last_start = time.monotonic()
        if entry is not None and not self.holder.start(entry):
            with self._lock:
                self._inflight -= 1
            return
        try:
            if not self.consumer.holds(delivery):
                raise Released
            outcome = self.process(delivery, job)
            with self._lock:
                self.outcomes[outcome] += 1
            ack = True
        except Hold as hold:
            released = True  # not settled now: held, or handed back
            if self.holder.hold(delivery, hold.job, hold.seconds) is None:
                self._hand_back([(delivery, hold.job)], "the worker is stopping")
        except Released:
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

    def process(self, delivery: Delivery, job: Job | None = None) -> Outcome:
        """Run or dispose of one message; return its outcome (:mod:`deferred.pipeline`).

        Raises :class:`deferred.pipeline.Hold` for a job due within the hold window.
        """
        return self.pipeline.process(delivery, job)

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
