"""Copies of one attempt: how a worker tells a delivery it must not run again.

A job's message can reach workers more than once: redelivered after a lost
connection, published twice (a publish retried after its confirm was lost,
or again by the keeper after a broker restart: :data:`COPY_HEADER`), or put
back carrying its delivery count on classic queues (:data:`DELIVERIES_HEADER`).
The pipeline (:mod:`deferred.worker.pipeline`) keys each attempt with
:func:`run_key`; the attempts this worker runs or ran are in its
:class:`~deferred.records.runs.RecentRuns`, and for the others the results
stream says whether the attempt ended elsewhere (:func:`ended_elsewhere`),
once a copy waited long enough for that run to be recorded (:func:`copy_wait`).
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta

from deferred.broker import COPY_HEADER, RESTART_COPY, BrokerError, Delivery
from deferred.conf import DeferredSettings
from deferred.core.jobs import Job, due_ms_of
from deferred.core.moves import MOVED_COPY, RACE_S
from deferred.records.recording import keeps_result
from deferred.records.result_format import CANCELLED, CLOCK_SLACK_S, FAILED, SUCCEEDED
from deferred.records.results import lookup as read_result
from deferred.records.results import lookup_from as read_result_from

logger = logging.getLogger("deferred.worker")

#: On classic ready queues: how many deliveries of this job ended without an ack.
DELIVERIES_HEADER = "x-deferred-deliveries"
#: How long a possible copy's look-up in the results may take before the job runs anyway.
ELSEWHERE_TIMEOUT_S = 2.0
#: How long a redelivered job waits before its look-up: the results writer of a worker
#: that ran it as its connection went tries again every second (deferred.broker.results).
REDELIVERED_WAIT_S = 2.0
#: How long a copy the keeper published after a broker restart waits before its look-up:
#: the results writer's linger and a job's "started" record (deferred.records.results), with room.
RESTART_COPY_WAIT_S = 0.5
#: How long a second copy of a publish waits before its look-up: the first copy's
#: run, if it was taken, is recorded within the results writer's linger by then.
COPY_WAIT_S = 2.0


def count_of(delivery: Delivery) -> int:
    """How many deliveries of this attempt ended without an ack so far, as a copy put
    back on a classic queue carries it (0 if it carries none)."""
    seen = delivery.headers.get(DELIVERIES_HEADER, 0)
    # Anyone may set a header: a value that is not a count counts as none.
    return seen if type(seen) is int and seen >= 0 else 0


def copy_wait(delivery: Delivery, job: Job) -> float:
    """How much longer to hold a copy (:data:`COPY_HEADER`) or a redelivery before it
    is looked up: long enough for a run of the other copy to be recorded. 0 for any
    other delivery, for a job that keeps no results, or once the wait is over. Only
    asked when results are on."""
    copy = delivery.headers.get(COPY_HEADER)
    if not (copy is not None or delivery.redelivered) or not keeps_result(job):
        return 0.0
    if copy is None:
        # Redelivered after a lost connection: a worker that ran it as the broker
        # went writes its record once the broker is back, and a look-up at once
        # would miss it.
        wait = REDELIVERED_WAIT_S
    elif copy == RESTART_COPY:
        # Published into the ready queue behind its job, if that survived: the job
        # has been handed to a worker by now, and only its record may be on its way.
        wait = RESTART_COPY_WAIT_S
    else:
        wait = COPY_WAIT_S
    return max(0.0, wait - (time.monotonic() - delivery.received))


def ended_elsewhere(settings: DeferredSettings, delivery: Delivery, job: Job) -> bool:
    """Whether another worker ended this attempt already, as the results stream says.

    Asked only of a delivery that may have run before (redelivered, or a copy
    carrying a delivery count) and of a job that keeps results: a read costs a
    few milliseconds, and a first delivery has run nowhere. A re-driven run is
    not looked up (its records share the id with the run before it). When the
    stream cannot say, the job runs: at least once. Only asked when results are on.
    """
    if not maybe_ran(delivery):
        return False
    if run_key(job) != first_run_key(job) or not keeps_result(job):
        return False
    try:
        if delivery.headers.get(COPY_HEADER) == MOVED_COPY and job.due < job.first_due:
            # Moved earlier: its other copy's run, if any, is recorded from the move on.
            since = job.due - timedelta(seconds=CLOCK_SLACK_S + RACE_S)
            found = read_result_from(settings, job.id, since, timeout=ELSEWHERE_TIMEOUT_S)
        else:
            found = read_result(settings, job.id, timeout=ELSEWHERE_TIMEOUT_S)
    except (BrokerError, ValueError) as exc:
        logger.info("job=%s could not be looked up in the results (%s); running it.", job.id, exc)
        return False
    if attempt_ended(found.state, found.outcome, found.attempts, job.attempt):
        return True
    # A second copy (of a retried publish, or published again after a broker
    # restart) whose attempt started from the other copy: the broker keeps that
    # one until it is acked, so this one is not needed, even if the run died.
    return (
        COPY_HEADER in delivery.headers
        and not delivery.redelivered
        and found.attempts >= job.attempt
    )


def maybe_ran(delivery: Delivery) -> bool:
    """Whether a delivery may be of an attempt that ran already: redelivered, a copy
    carrying a delivery count, or a second copy of a publish."""
    headers = delivery.headers
    return delivery.redelivered or DELIVERIES_HEADER in headers or COPY_HEADER in headers


def run_key(job: Job) -> str:
    """The attempt a delivery is of: the job id, its run (its first due time, which a
    re-drive from the failed list sets anew) and the attempt number."""
    return f"{job.id}/{math.floor(job.first_due.timestamp() * 1000)}/{job.attempt}"


def first_run_key(job: Job) -> str:
    """:func:`run_key` of the job's first run (its id carries that run's due time)."""
    return f"{job.id}/{due_ms_of(job.id)}/{job.attempt}"


def attempt_ended(state: str, outcome: str | None, attempts: int, attempt: int) -> bool:
    """Whether a job's result says that its attempt number ``attempt`` ended: the job
    ended (succeeded, failed, cancelled, dropped), or attempts up to this one started
    and the last ended in a retry. A job read as running or pending has not. Pure."""
    if state in (SUCCEEDED, FAILED, CANCELLED) or outcome == "dropped":
        return True
    return outcome == "retrying" and attempts >= attempt
