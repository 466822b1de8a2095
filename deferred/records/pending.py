"""A job that has not started, found by its id in the ledger, from any process.

Why: until a worker starts a job, the results stream holds nothing of it, and
an id that names a job waiting for its due time reads the same as an unknown
one. Django's task framework asks more of a backend that supports
``get_result()``: a task enqueued by one process reads ``READY``, with its
task, arguments and queue, in any other, as soon as ``enqueue()`` returned.

Where from: the broker copies every job published into the ``PREFIX.ledger``
stream (:mod:`deferred.core.ledger`), under the same confirm, so the record is
there once ``defer()`` or ``enqueue()`` returned. A stream is read from a
timestamp, and a job's id says when the job was made (:func:`deferred.core.jobs.made_ms_of`,
to within a few milliseconds for a job due within a second, 22 minutes for one
due in a year): the read starts there, and its record is among the first
messages read. A job deferred inside ``atomic()`` is published at the commit,
later than it was made: the read goes on forward, to the end of the stream if
it must (an id nothing was published for), and within its timeout.

A record older than half the ledger's retention may have been written again
by the keeper (carried, :func:`deferred.core.ledger.to_carry`), later than the job
was made: for such a job the read starts where the newest carried record can
be (half the retention and two hours back), and may run out of time on a busy
ledger. A job due at once that still waits for a worker after half the
retention is not carried, and reads as not found.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from deferred import broker
from deferred.broker.results import ReadEnd
from deferred.conf import DeferredSettings
from deferred.core import signing
from deferred.core.jobs import BrokenMessage, Job, made_ms_of
from deferred.core.ledger import CARRY_EVERY_S, READ_TIMEOUT_S
from deferred.core.topology import LEDGER_KEEP_MS, LEDGER_ROUTING_KEY, plan_topology
from deferred.records.result_format import CLOCK_SLACK_S, encode_marker, marker_of

#: The messages the broker may send ahead of the acks: a read that must go on
#: past its job's place (a commit long after the job was made) reads many.
CREDIT = 200
#: How much older than half the retention the newest record of a carried job may be:
#: the keeper carries once an hour, a pass may take its whole read timeout, and a
#: keeper that just took the lease waits an hour before its first pass.
CARRY_SLACK_MS = int((2 * CARRY_EVERY_S + READ_TIMEOUT_S) * 1000)


@dataclass(frozen=True)
class Found:
    """What a read of the ledger found: the job as published (``None``: no record of
    it), and whether the read reached the end of the stream or the job (``complete``)."""

    job: Job | None
    complete: bool = True


def find(
    settings: DeferredSettings,
    job_id: str,
    *,
    now: datetime | None = None,
    timeout: float | None = None,
    newest: bool = False,
) -> Found:
    """The first record of ``job_id`` in the ledger: the job as it was published; with
    ``newest``, its newest record, the job as it now waits (a retry, a moved copy),
    read to the end of the stream.

    ``Found(None)`` for an id that does not say when it was made (ids made
    before this release, a schedule's runs), with ``LEDGER = False``, or
    when no record is found. Signed jobs are checked as the worker checks
    them: a record with a bad signature counts as none. Raises
    ``deferred.BrokerUnavailable`` if no broker node answers, and
    ``deferred.TopologyNotDeclared`` if there is no ledger stream.
    """
    made = made_ms_of(job_id)
    plan = plan_topology(settings)
    if made is None or plan.ledger_queue is None:
        return Found(None)
    now_ms = (now or datetime.now(UTC)).timestamp() * 1000
    since_ms = made[0] - CLOCK_SLACK_S * 1000
    if since_ms < now_ms - LEDGER_KEEP_MS // 2:
        # Carried: the newest record is at most half the retention (and the
        # keeper's pace) old.
        since_ms = max(since_ms, now_ms - LEDGER_KEEP_MS // 2 - CARRY_SLACK_MS)
    needle = f'"id":"{job_id}"'.encode()
    keys = settings.signing_keys if settings.signing else None
    found: list[Job] = []

    def on_message(body: bytes, headers: dict[str, Any]) -> bool:
        if needle not in body:
            return False
        try:
            job = Job.decode(body)
            if keys is not None:
                signing.verify(body, headers, keys)
        except (BrokenMessage, ValueError):
            return False
        if job.id != job_id:
            return False
        found[:] = [job]
        # The first record found is the job as enqueued; a later one (a carried
        # copy, a retry, a move) is the job as it waits now.
        return not newest

    reader = _reader(
        settings.broker_urls,
        plan.ledger_queue.name,
        plan.ingest_exchange,
        settings.publish_timeout_s,
        CREDIT,
    )
    end = reader.read(
        datetime.fromtimestamp(max(0.0, since_ms) / 1000, UTC),
        on_message,
        marker_body=encode_marker,
        is_marker=marker_of,
        timeout=settings.publish_timeout_s if timeout is None else timeout,
    )
    job = found[0] if found else None
    return Found(job, complete=end is not ReadEnd.OUT_OF_TIME)


@lru_cache(maxsize=8)
def _reader(
    urls: tuple[str, ...], stream: str, exchange: str, timeout: float, credit: int
) -> broker.ResultReader:
    # The read's end marker goes through the ingest exchange (LEDGER_ROUTING_KEY),
    # which the publisher user may write to, as the results reader's does.
    return broker.ResultReader(urls, stream, exchange, LEDGER_ROUTING_KEY, timeout, credit=credit)
