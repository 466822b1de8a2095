"""What happens to one delivery, top to bottom, in a pool thread of the worker.

:meth:`Pipeline.process` reads as the path a message takes:

1. **intake**: the size and signature checks, then the job itself; a message
   that is no job to run goes to the failed queue as it came;
   **hold**: a job due within the hold window raises :class:`Hold`, and the
   worker keeps it unacked until it is due (:mod:`deferred.worker.holding`), then
   hands it here again, past this step;
2. **cancels**: every cancel confirmed before the job came due is read first,
   so that a cancel issued a moment before wins; when they cannot be read,
   the job waits a little in the delay queues rather than run on a guess;
3. **redelivery count** (classic queues): a job redelivered after a worker
   died goes back to its ready queue carrying its count, so that
   ``DELIVERY_LIMIT`` holds where the queue does not count;
4. **never early**: a job that arrived before its due time goes back to wait;
5. **run** the task, timed and traced, under its time limit
   (:mod:`deferred.core.limits`);
6. **retry or fail**: the retry policy decides; a retry is published through
   the delay queues, a failure stored in the failed queue, both confirmed
   before the worker acks (every way back onto the broker is in
   :mod:`deferred.worker.delay_line`);
7. **log** the job's line and tell the observers its :class:`Outcome`.

The worker (:mod:`deferred.worker`) owns the connection and the threads: it
hands each delivery here and acks it once :meth:`Pipeline.process` returns.
Three exceptions tell it not to: :class:`Released` (the delivering connection
went while the job waited, so RabbitMQ already gave the message to another
worker), :class:`Abandoned` (the attempt ran past its hard time limit, and the
worker settled it meanwhile: :meth:`Pipeline.timed_out`) and ``BrokerError``
(an outcome could not be made durable, so the message must go back). A
fourth, :class:`Hold`, tells it to wait, and a fifth, :class:`Joined`, that the
delivery is a copy of an attempt this worker is running: it is settled when
that run ends.

**Copies** (:mod:`deferred.worker.copies`, :mod:`deferred.records.runs`): once a
job is due and not cancelled (step 3 on), a delivery of an attempt this worker
ran lately is acked without running (``outcome=duplicate``), and one of an
attempt it is running joins that run.
A delivery that may have run elsewhere (redelivered, or a copy carrying a
delivery count) is looked up in the results stream first, when the job keeps
results: if its attempt ended there, it is acked without running too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import close_old_connections

from deferred.broker import BrokerError, BrokerUnavailable, Delivery
from deferred.conf import DeferredSettings
from deferred.core import intake, tracing
from deferred.core.jobs import Job, utcnow
from deferred.core.limits import TimeLimitExceeded, Watch, Watchdog
from deferred.core.outcomes import JOB_LINE, Observer, Outcome
from deferred.core.retries import Decision
from deferred.core.topology import Plan
from deferred.producer.tasks import UnknownTask, get_task
from deferred.records import failures
from deferred.records.runs import Claim, End, RecentRuns
from deferred.worker import copies
from deferred.worker.cancel_watch import CancelWatch
from deferred.worker.delay_line import DelayLine
from deferred.worker.metrics import UNKNOWN as UNKNOWN_TASK_LABEL
from deferred.worker.runnable import Runnable, resolve

logger = logging.getLogger("deferred.worker")

#: How long a job waits for the cancels to be read before it goes back to wait,
CANCELS_TIMEOUT_S = 10.0
#: and how long it then waits in the delay queues before it is tried again.
CANCELS_RETRY_S = 5.0


#: On top of the hold window: how early a job may be and still be held rather than
#: sent back through the topology (the producer's clock may run ahead of ours).
CLOCK_SLACK_MS = 1000


class Released(Exception):
    """The connection that delivered a job went while it waited: it is not ours any more."""


class Abandoned(Exception):
    """The attempt ended after its hard time limit: the worker settled the job already."""


class Joined(Exception):
    """A copy of an attempt this worker is running: settled when that run ends."""


@dataclass(frozen=True)
class Running:
    """An attempt under way, as the watchdog keeps it: what settling it needs."""

    job: Job
    delivery: Delivery
    task: Runnable
    lateness_ms: float
    started: float


class Hold(Exception):
    """The job is due within the hold window: keep it unacked until then."""

    def __init__(self, job: Job, seconds: float) -> None:
        super().__init__(job.id, seconds)
        self.job = job
        #: How long until it is due, on this worker's clock.
        self.seconds = seconds


class Pipeline:
    """Runs or disposes of one delivery at a time; shared by the worker's pool threads."""

    def __init__(
        self,
        settings: DeferredSettings,
        plan: Plan,
        *,
        cancels: CancelWatch,
        holds: Callable[[Delivery], bool],
        observer: Observer,
        worker_id: str,
        watchdog: Watchdog | None = None,
        results: bool = False,
        runs: RecentRuns[Delivery] | None = None,
        settle: Callable[[Delivery, End], None] | None = None,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.cancels = cancels
        #: Whether the worker's connection still holds a delivery (its consumer's).
        self.holds = holds
        self.observer = observer
        self.worker_id = worker_id
        #: Fires the attempts' time limits; without one, nothing is limited.
        self.watchdog = watchdog
        #: Whether results are written (by an observer): copies are then looked up in them.
        self.results = results
        #: The attempts this worker runs or ran lately; ``None``: copies are not looked for.
        self.runs = runs
        #: Settles a delivery that joined a run, as the run ended (:meth:`_run_once`).
        self.settle = settle
        #: Publishes jobs back: to wait, to their ready queue, or on (:mod:`.delay_line`).
        self.line = DelayLine(settings, plan, worker_id, holds)
        #: Quorum queues count deliveries themselves (x-delivery-limit).
        self.count_redeliveries = settings.queue_type == "classic"
        #: Task names resolved here: the only task labels the metrics use.
        self._known_tasks: set[str] = set()
        #: Jobs early by up to this are held, not sent back through the topology.
        self.hold_limit_ms = settings.hold_window_ms + CLOCK_SLACK_MS

    def process(self, delivery: Delivery, job: Job | None = None) -> Outcome:
        """Run or dispose of one message; return its outcome.

        Raises ``BrokerError`` only when the outcome (a retry, a failure
        record) could not be made durable, and :class:`Released` when the
        delivery's connection went: the message must then not be acked.
        Raises :class:`Hold` for a job due within the hold window; ``job`` is
        that job, read already, when the worker hands it back here at its time.
        """
        if job is None:
            read = intake.read(delivery.body, delivery.headers, self.settings)
            if isinstance(read, intake.Refused):
                return self._refuse(delivery, read)
            job = read
        seconds = self.hold_seconds(job) or (
            copies.copy_wait(delivery, job) if self.results else 0.0
        )
        if seconds:
            raise Hold(job, seconds)

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
            return self._log(job, _lateness_ms(job), Outcome.CANCELLED, 0.0)
        # Read up to the same point: a later job of its key confirmed before
        # this one came due replaces it (deferred.core.keys).
        # A copy a later run_now() or reschedule() replaced (deferred.core.moves).
        if self.cancels.view.moves.is_stale(job.id, job.gen, job.attempt):
            # Its "moved" record says where the run's records are (deferred.core.moves).
            to_s = self.cancels.view.moves.due(job.id)
            to_ms = None if to_s is None else math.floor(to_s * 1000)
            return self._log(job, _lateness_ms(job), Outcome.MOVED, 0.0, value=to_ms)
        if job.key is not None and self.cancels.view.keys.is_superseded(job.id):
            return self._log(job, _lateness_ms(job), Outcome.SUPERSEDED, 0.0, f"key={job.key!r}")
        if self.runs is None:
            return self._run(delivery, job)
        return self._run_once(self.runs, delivery, job)

    def _run_once(self, runs: RecentRuns[Delivery], delivery: Delivery, job: Job) -> Outcome:
        """:meth:`_run`, unless this worker runs or ran the same attempt (a copy joins
        that run, or is acked without running) or the results say another one did."""
        key = copies.run_key(job)
        count = self._count_of(delivery)
        claim = runs.claim(key, delivery, count)
        if claim is Claim.JOINED:
            first = runs.first(key)
            if (
                first is not None
                and delivery.redelivered
                and first.generation == delivery.generation
                and self._count_of(first) == count
            ):
                # Taken back while its connection stayed up: the queue's consumer
                # timeout (quorum queues on RabbitMQ 4.3 return the message).
                logger.warning(
                    "job=%s ran past its queue's consumer timeout, which took it back; this "
                    "worker runs it on and acks the copy it was handed again. Jobs that run "
                    "this long need a longer timeout: DEFERRED['CONSUMER_TIMEOUT'] for "
                    "quorum queues, consumer_timeout in rabbitmq.conf for classic ones.",
                    job.id,
                )
            raise Joined(job.id)
        if claim is Claim.DONE:
            return self._duplicate(job, "here")
        how = End.FORGOTTEN
        #: How the copies that joined this run are settled as it ends; None: not at all.
        others: End | None = End.FORGOTTEN
        try:
            if self.results and copies.ended_elsewhere(self.settings, delivery, job):
                outcome = self._duplicate(job, "elsewhere")
            else:
                outcome = self._run(delivery, job)
            how = _END_OF.get(outcome, End.SETTLED)
            # Sent back to wait, its confirmed copy is in the delay queues: the copies
            # that joined are acked, though the attempt is not remembered as run.
            others = End.SETTLED if how is End.FORGOTTEN else how
            return outcome
        except Abandoned:
            # Given up at its hard time limit: the worker settles it once its other jobs
            # are done, if its delivery is still held, and then ends. The copies that
            # joined stay unacked until then, and go back to RabbitMQ with the process:
            # one of them may be all that is left of the job.
            others = None
            raise
        finally:
            joined = runs.end(key, how, count + 1)
            if joined and self.settle is not None and others is not None:
                for copy in joined:
                    try:
                        self.settle(copy, others)
                    except Exception:  # the run's own outcome stands
                        logger.exception("Could not settle a copy of job %s.", job.id)

    def _run(self, delivery: Delivery, job: Job) -> Outcome:
        """:meth:`process` from the redelivery count on: the job is due, not cancelled."""
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
                return self._log(
                    job,
                    lateness_ms,
                    Outcome.DROPPED,
                    0.0,
                    f"reason=unknown_task occurrence={job.occurrence.isoformat()}",
                )
            self._fail(job, delivery, failures.UNKNOWN_TASK, exc)
            return self._log(
                job,
                lateness_ms,
                Outcome.FAILED,
                0.0,
                "reason=unknown_task",
                error=exc,
                reason=failures.UNKNOWN_TASK,
            )

        clock = time.monotonic()
        error: BaseException | None = None
        value: Any = None
        self.observer.started()
        self.observer.attempt_started(job, started, redelivered=delivery.redelivered)
        watch = self._watch(job, delivery, task, lateness_ms, clock)
        owned = True
        try:
            close_old_connections()
            with tracing.consumer_span(job, delivery.headers, job.queue, lateness_ms):
                try:
                    value = task.run(job, self.worker_id, watch=watch, started=started)
                finally:
                    # At once: a soft limit passing now must not reach the code below.
                    if watch is not None:
                        watch.finish()
        except BaseException as exc:  # noqa: BLE001 - any failure is retried or recorded
            error = exc
        finally:
            owned = watch is None or watch.finish()
            if owned:  # else the job is the watchdog's: touch nothing of it
                close_old_connections()
                self.observer.finished()
        if not owned:
            raise Abandoned(job.id)
        duration_ms = (time.monotonic() - clock) * 1000
        if error is None:
            return self._log(
                job, lateness_ms, Outcome.SUCCEEDED, duration_ms, ran=True, value=value
            )
        if self._cancelled_while_running(job):
            # Cancelled while it ran: it finished, and is neither retried nor kept as failed.
            return self._log(
                job,
                lateness_ms,
                Outcome.CANCELLED,
                duration_ms,
                f"error={type(error).__name__}: {failures.describe(error)}",
                ran=True,
                error=error,
            )

        timed_out = watch is not None and watch.fired
        if timed_out:
            self.observer.timed_out(self._label(job), job.queue, hard=False)
        return self._retry_or_fail(
            job, delivery, task, error, lateness_ms, duration_ms, timed_out=timed_out
        )

    def timed_out(self, watch: Watch) -> Outcome:
        """Settle an attempt still running past its hard limit: retried as its policy
        says, or kept as failed with the reason ``timed_out``.

        Its thread cannot be stopped. The worker calls this once its other
        jobs are done, acks the job and ends the process; what the thread
        does meanwhile is ignored (:class:`Abandoned`).
        """
        run: Running = watch.context
        self.observer.finished()
        self.observer.timed_out(self._label(run.job), run.job.queue, hard=True)
        error = TimeLimitExceeded(
            f"still running {watch.grace_s:g} s after its time limit of {watch.limit_s:g} s; "
            "its worker process was ended"
        )
        duration_ms = (time.monotonic() - run.started) * 1000
        if run.job.id in self.cancels.view:
            return self._log(
                run.job,
                run.lateness_ms,
                Outcome.CANCELLED,
                duration_ms,
                "reason=timed_out",
                ran=True,
                error=error,
            )
        return self._retry_or_fail(
            run.job, run.delivery, run.task, error, run.lateness_ms, duration_ms, timed_out=True
        )

    def _watch(
        self, job: Job, delivery: Delivery, task: Runnable, lateness_ms: float, started: float
    ) -> Watch | None:
        """The time limit of this attempt, watched from now; ``None`` if it has none."""
        if self.watchdog is None:
            return None
        return self.watchdog.watch(
            task.time_limit(self.settings),
            self.settings.time_limit_grace_s,
            Running(job, delivery, task, lateness_ms, started),
        )

    def _retry_or_fail(
        self,
        job: Job,
        delivery: Delivery,
        task: Runnable,
        error: BaseException,
        lateness_ms: float,
        duration_ms: float,
        *,
        timed_out: bool,
    ) -> Outcome:
        """A failed attempt: retried as the task's policy says, or kept as failed."""
        decision = task.retry_policy(self.settings).decide(error, job.attempt)
        if decision.retry:
            try:
                return self._retry(job, delivery, decision.delay, lateness_ms, duration_ms, error)
            except (TypeError, ValueError) as bad_delay:  # e.g. Retry(delay=-1)
                error = bad_delay
                decision = Decision(False, reason=failures.TASK_ERROR)
        reason = failures.TIMED_OUT if timed_out else decision.reason
        self._fail(job, delivery, reason, error)
        return self._log(
            job,
            lateness_ms,
            Outcome.FAILED,
            duration_ms,
            f"reason={reason} error={type(error).__name__}: {failures.describe(error)}",
            ran=True,
            error=error,
            reason=reason,
        )

    def read(self, delivery: Delivery) -> Job | None:
        """The job of a delivery, checked (size, signature), or ``None`` if it is none:
        :meth:`process` then refuses it. Cheap: the worker's I/O thread reads the hold
        queues' deliveries with it, so that holding a job never waits for a thread."""
        read = intake.read(delivery.body, delivery.headers, self.settings)
        return None if isinstance(read, intake.Refused) else read

    def hold_seconds(self, job: Job) -> float | None:
        """How long to hold ``job`` before it is due: 0 if it is due, ``None`` if it is
        too far off to hold (it then goes back through the topology)."""
        early_ms = (job.due - utcnow()).total_seconds() * 1000
        return max(0.0, early_ms / 1000) if early_ms <= self.hold_limit_ms else None

    # ------------------------------------------------------------------ the steps

    def _count_of(self, delivery: Delivery) -> int:
        """On classic queues, how many deliveries of this attempt ended without an ack
        so far, as its copy carries it (0 on quorum queues, which count themselves)."""
        return copies.count_of(delivery) if self.count_redeliveries else 0

    def _duplicate(self, job: Job, where: str) -> Outcome:
        """A copy of an attempt that ran: acked without running."""
        return self._log(job, _lateness_ms(job), Outcome.DUPLICATE, 0.0, f"ran={where}")

    def _refuse(self, delivery: Delivery, refused: intake.Refused) -> Outcome:
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
            "job=%s queue=%s outcome=%s reason=%s detail=%s",
            record["id"],
            delivery.queue,
            Outcome.FAILED,
            refused.reason,
            refused.detail,
        )
        self.observer.outcome(UNKNOWN_TASK_LABEL, self._target_of(delivery.queue), Outcome.FAILED)
        return Outcome.FAILED

    def _check_held(self, delivery: Delivery) -> None:
        """Raise :class:`Released` if ``delivery``'s connection went while the job waited.

        Waiting for the cancels can take seconds when a node dies; the
        message is then redelivered elsewhere, and running (or re-publishing)
        this copy would duplicate it.
        """
        if not self.holds(delivery):
            raise Released

    def _cancelled_while_running(self, job: Job) -> bool:
        """Whether a job whose attempt just failed was cancelled meanwhile.

        If the cancels cannot be read now, what is known decides: the retry,
        if any, is checked again when it comes due.
        """
        try:
            return self.cancels.is_cancelled(job.id, CANCELS_TIMEOUT_S)
        except BrokerUnavailable:
            return job.id in self.cancels.view

    def _wait_for_cancels(self, job: Job, delivery: Delivery, error: BrokerError) -> Outcome:
        """Send a due job back for a short wait while the cancels cannot be read."""
        wait_ms = self.line.send_back(job, delivery, CANCELS_RETRY_S, utcnow())
        return self._log(
            job,
            _lateness_ms(job),
            Outcome.RESCHEDULED,
            0.0,
            f"wait_for_cancels_ms={wait_ms} error={error}",
        )

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
    ) -> Outcome:
        """Publish the next attempt through the delay topology (confirmed) before the ack.

        The worker never sleeps on a retry and never holds the message: the
        wait happens in the broker, like any other delay.
        """
        wait_ms = self.line.send_back(job, delivery, delay, utcnow(), next_attempt=True)
        return self._log(
            job,
            lateness_ms,
            Outcome.RETRYING,
            duration_ms,
            f"retry_in_ms={wait_ms} error={type(error).__name__}: {failures.describe(error)}",
            ran=True,
            error=error,
        )

    def _count_redelivery(self, delivery: Delivery, job: Job) -> Outcome | None:
        """Classic queues do not count deliveries, so the worker does.

        A redelivered message was delivered before without an ack: the worker
        running it crashed (or lost its connection). Rather than run it here,
        put a copy carrying the count back in the ready queue (confirmed) and
        ack this one; past DELIVERY_LIMIT the job goes to the failed queue, so
        a job that kills every worker cannot loop forever.
        """
        count = self._count_of(delivery) + 1
        if count > self.settings.delivery_limit:
            error = RuntimeError(
                f"delivered {count} times without an ack: it may crash the worker "
                f"(DEFERRED['DELIVERY_LIMIT'] is {self.settings.delivery_limit})"
            )
            self._fail(job, delivery, failures.DELIVERY_LIMIT, error)
            extra = f"reason=delivery_limit deliveries={count}"
            return self._log(
                job, 0.0, Outcome.FAILED, 0.0, extra, error=error, reason=failures.DELIVERY_LIMIT
            )
        self.line.requeue(delivery, job, count)
        return self._log(job, _lateness_ms(job), Outcome.REQUEUED, 0.0, f"deliveries={count}")

    def _reschedule_early(self, job: Job, delivery: Delivery, now: datetime) -> Outcome:
        """A job that arrived before its due time (e.g. the clocks of two hosts differ)
        goes back to wait for the rest: never early."""
        # At most MAX_DELAY at a time: a job due further out (deferred under a
        # larger MAX_DELAY) simply comes back and waits again.
        wait_ms = self.line.send_back(job, delivery, job.due, now)
        return self._log(
            job,
            (now - job.due).total_seconds() * 1000,
            Outcome.RESCHEDULED,
            0.0,
            f"early_by_ms={wait_ms}",
        )

    # ------------------------------------------------------------------ telling

    def _log(
        self,
        job: Job,
        lateness_ms: float,
        outcome: Outcome,
        duration_ms: float,
        extra: str = "",
        *,
        ran: bool = False,
        value: Any = None,
        error: BaseException | None = None,
        reason: str | None = None,
    ) -> Outcome:
        """The job's log line and its outcome told to the observers: the job with what it
        returned or raised (the results recorder writes it), then the outcome with its
        timings if it ran (the metrics count it); returns ``outcome``.

        The job is acked as soon as this returns: its result record goes out
        within the results writer's ``LINGER_S``, with other jobs' records
        (:mod:`deferred.records.results` says what that costs and what it risks).
        """
        self.observer.job_ended(job, outcome, utcnow(), value=value, error=error, reason=reason)
        logger.log(
            outcome.level,
            JOB_LINE,
            job.id,
            job.task,
            job.attempt,
            lateness_ms,
            outcome,
            duration_ms,
            f" {extra}" if extra else "",
        )
        self.observer.outcome(
            self._label(job),
            job.queue,
            outcome,
            lateness_s=lateness_ms / 1000 if ran else None,
            duration_s=duration_ms / 1000 if ran else None,
        )
        return outcome

    def _label(self, job: Job) -> str:
        """``job.task`` if it names a task of this worker, else ``unknown`` (a bounded label)."""
        return job.task if self._knows(job) else UNKNOWN_TASK_LABEL

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


def _lateness_ms(job: Job) -> float:
    return (utcnow() - job.due).total_seconds() * 1000


#: What an outcome means for later copies of its attempt (the rest: settled).
_END_OF = {
    # Sent back to wait: the copy it published must run.
    Outcome.RESCHEDULED: End.FORGOTTEN,
    # Sent on carrying its delivery count: copies with a lower count are stale.
    Outcome.REQUEUED: End.REQUEUED,
}
