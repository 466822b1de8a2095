"""The worker: consume ready queues, run registered tasks, ack after they return.

Threads: the thread that calls :meth:`Worker.run` owns the broker connection
and only does I/O (deliveries, acks, heartbeats); jobs run in a thread pool,
so a long job never starves the heartbeats, and each job hands its ack back
to the I/O thread. Prefetch equals concurrency, across all its queues
(deferred.broker.consumer): this worker never holds more jobs than it can
start, and the rest stay available to others.

What happens to one delivery (cancel check, redelivery count, run, retry
or fail, log) is :mod:`deferred.worker.pipeline`; this module is the connection,
the loop and the threads. The metrics and the health file watch through
:class:`deferred.core.outcomes.Observer`.

The last mile: a job from a hold queue is due within ``HOLD_WINDOW``; the
pipeline says so (:class:`deferred.worker.pipeline.Hold`) and the
:class:`deferred.worker.holding.Holder` keeps it, unacked, until its due time, then
gives it back to the pool. Held jobs have their own prefetch
(``HOLD_PREFETCH``) and never take a running job's slot; on SIGTERM they go
back to their queue at once, as fresh messages, for the other workers.

Cancels: a reader thread follows the cancels stream (deferred.records.cancels); a
job found there is acked without running (``outcome=cancelled``), and a job
cancelled while it ran is not retried.

Time limits (:mod:`deferred.core.limits`): a watchdog raises
``TimeLimitExceeded`` in a job that runs past its limit; one still running
``TIME_LIMIT_GRACE`` later is settled by the worker (retried or failed as
``timed_out``, then acked), its thread given up, and the worker stops with
:attr:`Worker.exit_status` ``TIMED_OUT`` for a fresh process to replace it.
Recycling (:mod:`deferred.worker.recycling`) stops it the same way, ``RECYCLED``.

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
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Protocol

from django.template.defaultfilters import pluralize

from deferred.broker import (
    LOST_CONSUMER_TIMEOUT,
    BrokerError,
    BrokerUnavailable,
    Consumer,
    Delivery,
    TopologyNotDeclared,
    verify_topology,
)
from deferred.cluster.nodes import management_api
from deferred.cluster.watch import StuckWatch
from deferred.conf import DeferredSettings, get_settings
from deferred.core import notices
from deferred.core.jobs import Job
from deferred.core.limits import Watch, Watchdog
from deferred.core.outcomes import Observers, Outcome
from deferred.core.priorities import DEFAULT_LEVEL, top_of
from deferred.core.topology import Plan, plan_topology
from deferred.producer.publishing import note_verified
from deferred.records.cancels import cancel_route_missing
from deferred.records.recording import Recorder
from deferred.records.runs import End, RecentRuns
from deferred.records.schedules import scheduled_tasks
from deferred.worker.cancel_watch import CancelWatch
from deferred.worker.exits import WorkerExit
from deferred.worker.health import HealthFile
from deferred.worker.holding import Held, Holder
from deferred.worker.keeper import Keeper
from deferred.worker.metrics import WorkerMetrics
from deferred.worker.pipeline import Abandoned, Hold, Joined, Pipeline, Released, Running
from deferred.worker.pool import Pool
from deferred.worker.recycling import Recycling
from deferred.worker.scheduler import Scheduler

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
        recycling: Recycling | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        self.queues = names = _known_queues(self.settings, queues)
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}.")
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
            legacy_queues=_legacy(plan, names),
            forward=self._forward,
            heartbeat=self.settings.worker_heartbeat_s,
        )
        #: Set while the worker is consuming (tests and health checks wait on it).
        self.consuming = threading.Event()
        self._stopping = threading.Event()
        self._inflight = 0
        self._lock = threading.Lock()
        self._executor: Pool | None = None
        #: Jobs given up at their hard time limit, settled once the others are done.
        self._timed_out: list[Watch] = []
        #: Why the worker ended: STOPPED, or a planned exit (RECYCLED, TIMED_OUT).
        self.exit_status = WorkerExit.STOPPED
        #: When to make way for a fresh process (--max-jobs/memory-per-child).
        self.recycling = recycling
        #: Fires the time limits of the running jobs.
        self.watchdog = Watchdog(self._on_hard_limit)
        #: Knows the cancelled job ids: every job is checked against it before it runs.
        self.cancels = CancelWatch(self.settings)
        #: How many messages ended how, by outcome ("succeeded", "cancelled", ...).
        self.outcomes: Counter[str] = Counter()
        #: Prometheus metrics (``--metrics-port``), if asked for.
        self.metrics = metrics
        #: A file touched while consuming (``--health-file``), if asked for.
        self.health = health
        #: Writes each job's start and outcome to the results stream (``RESULTS``).
        self.results = Recorder(self.settings, self.worker_id) if self.settings.results else None
        #: Told what the worker does: the metrics, the health file and the results, if any.
        self.observer = Observers([metrics, health, self.results])
        #: What happens to each delivery, in the pool's threads.
        self.pipeline = Pipeline(
            self.settings,
            plan,
            cancels=self.cancels,
            holds=self.consumer.holds,
            observer=self.observer,
            worker_id=self.worker_id,
            watchdog=self.watchdog,
            results=self.results is not None,
            runs=RecentRuns(),
            settle=self._settle_copy,
        )
        #: Keeps the jobs due within the hold window until their time.
        self.holder = Holder(self._release, self._hand_back_late, stalled=self._stalled)
        #: When a pool thread last started a message (time.monotonic()).
        self._last_start = 0.0
        #: Competes to keep the ledger and repair broker restarts (``LEDGER``).
        self.keeper = Keeper(self.settings) if self.settings.ledger else None
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
            logger.warning(
                "%s again: still waiting for %d running job%s.",
                name,
                self._inflight,
                pluralize(self._inflight),
            )
        else:
            logger.warning(
                "%s received: finishing %d running job%s, then exiting.",
                name,
                self._inflight,
                pluralize(self._inflight),
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
        self._executor = Pool(self.concurrency)
        # The services the running jobs use (the cancels, the results writer) start
        # first and stop after the last job; those beside them (the stuck-queue
        # watch, the scheduler, the keeper) start last and stop before the jobs end.
        for_jobs = _present(self.cancels, self.results)
        beside = _present(self._stuck_watch(), self.scheduler, self.keeper)
        for service in for_jobs:
            service.start()
        self.holder.start_thread()
        for service in beside:
            service.start()
        wait_s = RECONNECT_FIRST_S

        def connected() -> None:  # the wait before a reconnection starts over
            nonlocal wait_s
            wait_s = RECONNECT_FIRST_S

        try:
            while not self._stopping.is_set():
                try:
                    self._consume(connected)
                except (BrokerUnavailable, TopologyNotDeclared) as exc:
                    if not self._wait_to_reconnect(exc, wait_s):
                        break
                    wait_s = min(wait_s * 2, RECONNECT_CAP_S)
        finally:
            self._shut_down(for_jobs, beside, previous)

    def _consume(self, connected: Callable[[], None]) -> None:
        """Connect, consume until :meth:`stop`, then hand back, drain and settle: one
        connection's life (``connected()`` once it consumes). ``BrokerUnavailable`` or
        ``TopologyNotDeclared`` if it ends early."""
        if not self.settings.declare:
            verify_topology(self.settings.broker_urls, self.plan)
            # Its retries and reschedules need not check again.
            note_verified(self.settings)
            self._check_cancel_route()
        self.consumer.start(self._on_delivery)
        self._consuming(True)
        notices.forget()
        logger.info(
            "Worker consuming %s at %s with concurrency %d.",
            ", ".join(self.consumer.queues),
            self.consumer.node.address if self.consumer.node else "?",
            self.concurrency,
        )
        connected()
        while not self._stopping.is_set():
            self.consumer.poll(self.poll_interval)
            self.observer.beat()
            self._check_recycling()
        self._consuming(False)
        self.consumer.cancel()
        self._hand_back_held()
        self._drain()
        self._settle_timed_out()

    def _wait_to_reconnect(
        self, exc: BrokerUnavailable | TopologyNotDeclared, wait_s: float
    ) -> bool:
        """Say why the connection ended and wait ``wait_s`` before the next one; whether
        to reconnect (not while stopping). Raises a missing topology with ``DECLARE``
        off: only the infrastructure can make it."""
        self._consuming(False)
        if isinstance(exc, TopologyNotDeclared) and not self.settings.declare:
            logger.critical("Worker stopping: %s", exc)
            raise exc
        if self._stopping.is_set():
            if isinstance(exc, TopologyNotDeclared):
                logger.debug("Stopping, with no topology: %s", exc)
            else:
                logger.error("Broker lost while stopping: %s", exc)
            return False
        if isinstance(exc, TopologyNotDeclared):
            notices.topology_missing(exc)
        else:
            logger.error(
                "RabbitMQ unavailable: %s. Running jobs go on; their messages "
                "will be redelivered. Reconnecting in %.1f s.",
                exc,
                wait_s,
            )
        self._stopping.wait(wait_s)
        return True

    def _shut_down(
        self,
        for_jobs: tuple[Service, ...],
        beside: tuple[Service, ...],
        previous: dict[int, Any],
    ) -> None:
        """Stop in order: the services beside the jobs, the jobs, then theirs."""
        self._consuming(False)
        self._hand_back_held()
        for service in beside:
            service.stop()
        # Every thread but one given up at a hard time limit: that one ends with the process.
        # A given-up job not settled went back to RabbitMQ with a lost connection: it
        # may run elsewhere now, so the stuck thread must end at once, and with it the
        # other running jobs, whose deliveries went back too.
        lost = bool(self._timed_out)
        if lost:
            logger.warning(
                "RabbitMQ took back %d job%s given up at the hard time limit with the "
                "lost connection: ending now, so that no copy runs beside the stuck "
                "thread (the running jobs go back too).",
                len(self._timed_out),
                pluralize(len(self._timed_out)),
            )
        assert self._executor is not None
        self._executor.shutdown(wait=not lost)
        self.watchdog.stop()
        for service in reversed(for_jobs):
            service.stop()
        self.consumer.close()
        self._restore_signals(previous)
        if self.exit_status == WorkerExit.STOPPED:
            logger.info("Worker stopped.")
        else:
            logger.warning(
                "Worker stopped for a fresh process (exit status %d, %s).",
                self.exit_status,
                self.exit_status.name,
            )

    def _end(self, status: WorkerExit, why: str) -> None:
        """Stop for a fresh process: ``status`` becomes the exit status (a time limit
        wins over recycling)."""
        with self._lock:
            first = self.exit_status == WorkerExit.STOPPED and not self._stopping.is_set()
            if status > self.exit_status:
                self.exit_status = status
        if status == WorkerExit.TIMED_OUT and self.keeper is not None:
            # A job given up at its hard limit was settled (its retry published): the
            # process must end now, before the retry starts elsewhere beside its thread.
            self.keeper.wait_on_stop = False
        self.stop()
        if first or status == WorkerExit.TIMED_OUT:
            logger.warning(
                "Worker stopping for a fresh process: %s. Finishing %d running job%s, "
                "handing back the held ones.",
                why,
                self._inflight,
                pluralize(self._inflight),
            )

    def _check_recycling(self) -> None:
        if self.recycling is None or self._stopping.is_set():
            return
        reason = self.recycling.reason(self.outcomes.total())
        if reason is not None:
            self._end(WorkerExit.RECYCLED, reason)

    def _on_hard_limit(self, watch: Watch) -> None:
        """On the watchdog's thread: a job still runs past its limit and grace.

        Its thread cannot be stopped, so the worker gives it up at once (should
        it return now, it takes no other job), stops taking jobs, and ends with
        ``TIMED_OUT``. The job itself is settled last, by
        :meth:`_settle_timed_out`, once the other running jobs are done: until
        the process ends its thread may still be running, and a retry
        published now could start on another worker beside it.
        """
        run: Running = watch.context
        self._end(
            WorkerExit.TIMED_OUT,
            f"job {run.job.id} ({run.job.task}) is still running {watch.grace_s:g} s after "
            f"its time limit of {watch.limit_s:g} s",
        )
        assert self._executor is not None
        self._executor.abandon(watch.thread_id)
        with self._lock:
            self._inflight -= 1
            self._timed_out.append(watch)

    def _settle_timed_out(self) -> None:
        """On the I/O thread, once nothing else runs: settle each job given up at its hard
        limit (retried, or failed as ``timed_out``), then ack it; the process ends next.

        If the outcome cannot be stored, the job is not acked: RabbitMQ delivers
        it again once this process has ended. If its connection was lost
        meanwhile, RabbitMQ has taken it back already: nothing is published
        for it, and it stays in ``_timed_out`` so that the process ends at once.
        """
        with self._lock:
            given_up, self._timed_out = self._timed_out, []
        for watch in given_up:
            run: Running = watch.context
            if not self.consumer.holds(run.delivery):
                with self._lock:
                    self._timed_out.append(watch)
                continue
            try:
                outcome = self.pipeline.timed_out(watch)
            except Exception as exc:  # noqa: BLE001 - the broker, or anything else: not acked
                logger.error(
                    "Could not record job %s as timed out (%s); RabbitMQ will deliver it "
                    "again once this process ends.",
                    run.job.id,
                    exc,
                )
                continue
            with self._lock:
                self.outcomes[outcome] += 1
            self.consumer.settle_threadsafe(run.delivery, ack=True)
        if given_up:
            self.consumer.settle_pending()
            self.consumer.poll(0)

    def _consuming(self, consuming: bool) -> None:
        """Say whether jobs are being taken: the event, and the observers."""
        if consuming:
            self.consuming.set()
        else:
            self.consuming.clear()
        self.observer.consuming(consuming)

    def _stuck_watch(self) -> StuckWatch | None:
        """On quorum queues, a watch over stuck dead-letters, if the management API may be asked."""
        if self.settings.delay_queue_type != "quorum" or not self.settings.management_urls:
            return None
        return StuckWatch(self.settings, self.plan.prefix, management_api(self.settings))

    def _drain(self) -> None:
        """Keep doing I/O (acks, heartbeats) until no job is running."""
        if self._inflight:
            logger.info(
                "Waiting for %d running job%s to finish.", self._inflight, pluralize(self._inflight)
            )
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
                if self.holder.hold(delivery, job, seconds, job.priority) is not None:
                    return
        with self._lock:
            self._inflight += 1
        assert self._executor is not None
        self._executor.submit(self._execute, delivery, job, priority=_rank(delivery, job))

    def _release(self, entries: list[Held]) -> None:
        """On the holder's thread: held jobs are due; run them in the pool, submitted
        together so that the highest priority starts first."""
        with self._lock:
            self._inflight += len(entries)
        assert self._executor is not None
        try:
            self._executor.submit_many(
                [(self._execute, (e.delivery, e.job, e), e.rank) for e in entries]
            )
        except RuntimeError:  # the pool is shut down: the holder hands them back
            with self._lock:
                self._inflight -= len(entries)
            raise

    def _stalled(self, seconds: float) -> bool:
        """Whether no pool thread has started a message for ``seconds``: every thread
        is taken by jobs that run long."""
        return time.monotonic() - self._last_start >= seconds

    def _forward(
        self, queue: str, body: bytes, message_id: str | None, headers: dict[str, Any]
    ) -> None:
        """On the I/O thread: a message of a replaced queue goes on to ``queue`` (confirmed)."""
        self.pipeline.line.forward(queue, body, message_id, headers)

    def _hand_back_late(self, entry: Held) -> None:
        """On the holder's thread: a due job found no free thread in time."""
        self._hand_back([(entry.delivery, entry.job)], "every thread is busy")

    def _hand_back_held(self) -> None:
        """Stopping: every job held and not started goes back at once."""
        left = sorted(self.holder.stop(), key=lambda e: -e.rank)  # highest priority first
        if left:
            self._hand_back([(e.delivery, e.job) for e in left], "the worker is stopping")

    def _hand_back(self, held: list[tuple[Delivery, Job]], why: str) -> None:
        """Give held jobs back to their queues for other workers (fresh, uncounted
        copies), then ack them; if that fails, requeue them (then they count)."""
        try:
            handed = self.pipeline.line.hand_back(held)
        except BrokerError as exc:
            logger.warning(
                "Could not hand back %d held job%s (%s); requeueing them instead.",
                len(held),
                pluralize(len(held)),
                exc,
            )
            for delivery, _ in held:
                self.consumer.settle_threadsafe(delivery, ack=False, requeue=True)
            return
        for delivery in handed:
            self.consumer.settle_threadsafe(delivery, ack=True)
        if handed:
            logger.info(
                "Handed back %d held job%s for another worker: %s.",
                len(handed),
                pluralize(len(handed)),
                why,
            )

    def _execute(
        self, delivery: Delivery, job: Job | None = None, entry: Held | None = None
    ) -> None:
        """In a pool thread: process one message, then ask the I/O thread to settle it.

        ``job`` and ``entry``: a held job, now due (handed back meanwhile if
        the holder took it back first).
        """
        ack = released = abandoned = False
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
            if self.holder.hold(delivery, hold.job, hold.seconds, hold.job.priority) is None:
                self._hand_back([(delivery, hold.job)], "the worker is stopping")
        except Abandoned as gone:
            # Past its hard time limit: settled and counted by _on_hard_limit already.
            logger.warning("Job %s ended after the worker gave up on it; ignored.", gone)
            released = abandoned = True
        except Joined:
            # A copy of a job running in another thread: settled when that run ends.
            released = True
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
            self._settle(delivery, ack, abandoned, released=released)

    def _settle(
        self, delivery: Delivery, ack: bool, abandoned: bool, *, released: bool = False
    ) -> None:
        """Ack (or hand back) a message its pool thread is done with, and count it out."""
        if not released and not self.consumer.settle_threadsafe(delivery, ack=ack, requeue=True):
            self._taken_back(delivery)
        if not abandoned:
            with self._lock:
                self._inflight -= 1

    def _taken_back(self, delivery: Delivery) -> None:
        """Say why a job that ran was not acked: RabbitMQ took its delivery back."""
        if self.consumer.why_lost(delivery.generation) == LOST_CONSUMER_TIMEOUT:
            # Only a job held longer than the broker's consumer timeout gets here.
            logger.warning(
                "job=%s from %s ran past RabbitMQ's consumer timeout, which took its delivery "
                "back: RabbitMQ delivers it again, and it runs again elsewhere. Jobs that run "
                "this long need a longer timeout: DEFERRED['CONSUMER_TIMEOUT'] for quorum "
                "queues, consumer_timeout in rabbitmq.conf for classic ones.",
                delivery.message_id,
                delivery.queue,
            )
        else:
            logger.info(
                "job=%s from %s ended after the connection that delivered it was lost, so "
                "its ack was too: RabbitMQ delivers it again; this worker acks that copy "
                "without running it (another worker does if the job's results say it ran).",
                delivery.message_id,
                delivery.queue,
            )

    def _settle_copy(self, delivery: Delivery, how: End) -> None:
        """A delivery that joined a run of its job, as that run ended ``how``: acked with
        a run that settled the job, handed back with one that did not, and processed
        anew after one that sent the job on with its delivery count (classic queues),
        for it may be that very copy: then it runs, and a stale one is acked."""
        if how is End.REQUEUED:
            with self._lock:
                self._inflight += 1
            assert self._executor is not None
            try:
                self._executor.submit(self._execute, delivery, priority=_rank(delivery, None))
            except RuntimeError:  # the pool is shut down: RabbitMQ gets it back
                with self._lock:
                    self._inflight -= 1
                self.consumer.settle_threadsafe(delivery, ack=False, requeue=True)
            return
        self.consumer.settle_threadsafe(delivery, ack=how is End.SETTLED, requeue=True)

    def process(self, delivery: Delivery, job: Job | None = None) -> Outcome:
        """Run or dispose of one message; return its outcome (:mod:`deferred.worker.pipeline`).

        Raises :class:`deferred.worker.pipeline.Hold` for a job due within the hold window.
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


class Service(Protocol):
    """What runs beside the jobs in a worker: a thread of its own, started and stopped
    with the worker."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def _present(*services: Service | None) -> tuple[Service, ...]:
    """The services this worker has (a feature that is off has none)."""
    return tuple(service for service in services if service is not None)


def _rank(delivery: Delivery, job: Job | None) -> int:
    """Where a delivery waits for a thread: by its job's priority (-100..100) once read
    (held jobs are), else the highest of its AMQP level's (a job published before
    priorities existed has none, and counts as the default)."""
    if job is not None:
        return job.priority
    return top_of(DEFAULT_LEVEL if delivery.priority is None else delivery.priority)


def _known_queues(settings: DeferredSettings, queues: Iterable[str] | None) -> list[str]:
    """``queues`` (default: all of ``DEFERRED['QUEUES']``); ``ValueError`` for one not there."""
    names = list(queues or settings.queues)
    unknown = [q for q in names if q not in settings.queues]
    if unknown:
        raise ValueError(
            f"Queue{pluralize(len(unknown))} {', '.join(unknown)} not in DEFERRED['QUEUES'] "
            f"{list(settings.queues)!r}."
        )
    return names


def _legacy(plan: Plan, names: list[str]) -> dict[str, str]:
    """The FIFO ready and hold queues of ``names`` that older topologies may still deliver
    to, when this topology's have priorities (:attr:`Plan.legacy_queues`), each with the
    queue its messages go on to."""
    ready, hold = plan.legacy_queues
    return {
        **{ready[n]: plan.ready_queues[n].name for n in names if n in ready},
        **{hold[n]: plan.hold_queues[n].name for n in names if n in hold},
    }
