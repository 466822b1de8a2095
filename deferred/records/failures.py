"""The failed queue: what goes in, and how to read it back.

A failed job is never dropped. The worker stores a record with the whole job
(or the raw body when it could not even be read), the reason and the
exception with its traceback. Two other kinds of message reach the failed
queue through RabbitMQ itself, as the bare job: a delayed job that found no
route after its first hop (alternate exchange) and a job dead-lettered by a
quorum ready queue past its delivery limit. :func:`parse_failed` reads all
three the same way.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from deferred import broker
from deferred.conf import DeferredSettings
from deferred.core import signing
from deferred.core.delays import delay_ms
from deferred.core.intake import BAD_SIGNATURE as BAD_SIGNATURE
from deferred.core.intake import TOO_LARGE as TOO_LARGE
from deferred.core.jobs import INVALID as INVALID
from deferred.core.jobs import UNDECODABLE as UNDECODABLE
from deferred.core.jobs import BrokenMessage, Job, looks_like_id, new_job_id, utcnow
from deferred.core.retries import RETRIES_EXHAUSTED as RETRIES_EXHAUSTED
from deferred.core.retries import TASK_ERROR as TASK_ERROR
from deferred.core.topology import plan_topology
from deferred.producer.publishing import publish
from deferred.records.recording import record_redrive

# Why a job is in the failed queue: TASK_ERROR and RETRIES_EXHAUSTED (decided by
# the retry policy), UNDECODABLE and INVALID (by the job format), TOO_LARGE and
# BAD_SIGNATURE (by the worker's intake, before anything is read), imported above
# from where they are decided, and these:

#: No task is registered under the job's name in this worker.
UNKNOWN_TASK = "unknown_task"
#: Delivered too many times without being acked: it keeps killing workers.
DELIVERY_LIMIT = "delivery_limit"
#: The attempt ran past its time limit and was not retried (``deferred.core.limits``).
TIMED_OUT = "timed_out"
#: A delayed job found no route after its first hop (e.g. an undeclared queue).
UNROUTABLE = "unroutable"
#: How much of a body that is not kept whole (too large) the record keeps.
BODY_HEAD_BYTES = 512

logger = logging.getLogger("deferred.failures")

REASON_HEADER = "x-deferred-reason"


def describe(error: BaseException) -> str:
    """``str(error)``, even for an exception whose ``__str__`` itself fails."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the job
        return f"<{type(error).__name__} whose message cannot be printed>"


def _traceback(error: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(error))
    except Exception:  # noqa: BLE001
        return f"<traceback of {type(error).__name__} cannot be printed>"


def failure_record(
    *,
    reason: str,
    job: Job | None,
    body: bytes,
    error: BaseException | None = None,
    detail: str | None = None,
    message_id: str | None = None,
    keep_body: bool = True,
) -> dict[str, Any]:
    """The JSON document the worker stores in the failed queue.

    A job keeps its id; a body that was not read takes the message's id when
    it looks like a job id, else a new one, so that it can be purged by id.
    ``keep_body=False`` (a body too large) keeps its size and first bytes only.
    """
    if job is not None:
        entry_id = job.id
    elif message_id is not None and looks_like_id(message_id):
        entry_id = message_id
    else:
        entry_id = new_job_id()
    record: dict[str, Any] = {
        "id": entry_id,
        "task": job.task if job else None,
        "reason": reason,
        "detail": detail or (describe(error) if error else reason),
        "failed_at": utcnow().isoformat(),
        "worker": f"{socket.gethostname()}:{os.getpid()}",
        "job": job.to_dict() if job else None,
        "attempts": job.attempt if job else None,
        # When the job was first due; a retried job's last attempt was due later.
        "due": job.first_due.isoformat() if job else None,
        "error": None,
    }
    if error is not None:
        record["error"] = {
            "type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": describe(error),
            "traceback": _traceback(error),
        }
    if job is None and not keep_body:
        record["raw_body_bytes"] = len(body)
        record["raw_body_head_base64"] = base64.b64encode(body[:BODY_HEAD_BYTES]).decode()
    elif job is None:
        try:
            record["raw_body"] = body.decode()
        except UnicodeDecodeError:
            record["raw_body_base64"] = base64.b64encode(body).decode()
    return record


def store_failure(settings: DeferredSettings, record: dict[str, Any]) -> None:
    """Publish ``record`` to the failed queue, confirmed, before the job is acked.

    Signed like a job: a re-drive runs what the record holds, so a record
    anyone could have written there needs ``--resign`` to be run.
    """
    plan = plan_topology(settings)
    body = json.dumps(record, default=repr).encode()
    broker.publisher_for(settings).publish(
        "",
        plan.failed_queue.name,
        body,
        message_id=record["id"],
        headers={REASON_HEADER: record["reason"], **signing.sign(body, settings.signing_keys)},
    )


@dataclass(frozen=True)
class FailedJob:
    """One entry of the failed queue, whatever put it there."""

    id: str
    task: str | None
    reason: str
    attempts: int | None
    #: ``"module.Type: message"``, or a description of what went wrong.
    error: str | None
    traceback: str | None
    due: str | None
    failed_at: str | None
    #: The job itself, when it can be run again.
    job: Job | None
    #: The job's body as it arrived, when it was not read (a bad signature).
    raw: bytes | None = None
    #: Whether the entry is signed with a key this process accepts (always
    #: ``True`` when it was not checked): a re-drive runs only trusted entries.
    trusted: bool = True

    @property
    def failed_at_time(self) -> datetime | None:
        """``failed_at`` as an aware datetime, for pages that format times their own way.

        ``None`` when missing or unreadable: a record from another tool may hold anything.
        """
        try:
            when = datetime.fromisoformat(self.failed_at) if self.failed_at else None
        except ValueError:
            return None
        if when is not None and when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return when

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task,
            "reason": self.reason,
            "attempts": self.attempts,
            "error": self.error,
            "traceback": self.traceback,
            "due": self.due,
            "failed_at": self.failed_at,
            "queue": self.job.queue if self.job else None,
            "args": list(self.job.args) if self.job else None,
            "kwargs": self.job.kwargs if self.job else None,
            # The body as it arrived, when it was not read as a job (to be
            # inspected before a `retry --resign`).
            "raw_body": self.raw.decode(errors="replace") if self.raw is not None else None,
        }


def parse_failed(
    body: bytes,
    headers: dict[str, Any],
    message_id: str | None,
    keys: tuple[str | bytes, ...] | None = None,
) -> FailedJob:
    """Read one message of the failed queue; with ``keys``, check its signature too.

    A worker's record is signed by the worker that wrote it; a bare job
    (put there by RabbitMQ) carries the signature it was published with.
    """
    entry = _parse_failed(body, headers, message_id)
    if keys is None:
        return entry
    try:
        signing.verify(body, headers, keys)
    except signing.BadSignature:
        return replace(entry, trusted=False)
    return entry


def _parse_failed(body: bytes, headers: dict[str, Any], message_id: str | None) -> FailedJob:
    # Whatever is in the failed queue is shown, never raised on: the page
    # and the commands must work on the entries they are there to fix.
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and "reason" in data and "job" in data:
        return _from_record(data)
    try:
        job = Job.from_dict(data) if isinstance(data, dict) else Job.decode(body)
    except BrokenMessage as exc:
        return FailedJob(
            id=message_id or "",
            task=None,
            reason=INVALID,
            attempts=None,
            error=str(exc),
            traceback=None,
            due=None,
            failed_at=None,
            job=None,
        )
    deaths = headers.get("x-death") if isinstance(headers, dict) else None
    first = deaths[0] if isinstance(deaths, list) and deaths else None
    death_reason = str(first.get("reason", "")) if isinstance(first, dict) else ""
    # A bare job moved to another broker (deferred_transfer) was dead-lettered
    # again on the way: the reason it failed travels in our own header.
    carried = headers.get(REASON_HEADER) if isinstance(headers, dict) else None
    if isinstance(carried, bytes):
        carried = carried.decode(errors="replace")
    if death_reason == "delivery_limit" or carried == DELIVERY_LIMIT:
        reason, error = DELIVERY_LIMIT, "delivered too many times without an ack (worker crashes?)"
    else:
        reason, error = UNROUTABLE, "no route to its ready queue (run declare_delay_topology)"
    return FailedJob(
        id=job.id,
        task=job.task,
        reason=reason,
        attempts=job.attempt,
        error=error,
        traceback=None,
        due=job.due.isoformat(),
        failed_at=None,
        job=job,
    )


def _from_record(data: dict[str, Any]) -> FailedJob:
    job = None
    if isinstance(data.get("job"), dict):
        try:
            job = Job.from_dict(data["job"])
        except BrokenMessage:
            job = None
    error = data.get("error")
    error_text: str | None
    if isinstance(error, dict):
        error_text = f"{error.get('type')}: {error.get('message')}"
        trace = _text(error.get("traceback"))
    else:
        error_text, trace = _text(data.get("detail")), None
    raw = None
    if isinstance(data.get("raw_body"), str):
        raw = data["raw_body"].encode(errors="replace")
    elif isinstance(data.get("raw_body_base64"), str):
        try:
            raw = base64.b64decode(data["raw_body_base64"], validate=True)
        except ValueError:
            raw = None
    return FailedJob(
        raw=raw,
        id=_text(data.get("id")) or (job.id if job else ""),
        task=_text(data.get("task")) or (job.task if job else None),
        reason=_text(data["reason"]) or INVALID,
        attempts=data["attempts"] if type(data.get("attempts")) is int else None,
        error=error_text,
        traceback=trace,
        due=_text(data.get("due")),
        failed_at=_text(data.get("failed_at")),
        job=job,
    )


def _text(value: Any) -> str | None:
    """A record's field as text, if it is text (an entry may have been written by anyone)."""
    return value if isinstance(value, str) else None


# --------------------------------------------------------------------------- operations


@dataclass
class Outcome:
    """What a re-drive or purge did, by job id."""

    done: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def list_failed(settings: DeferredSettings) -> list[FailedJob]:
    """Every entry of the failed queue, oldest first; the queue is left as it was."""
    plan = plan_topology(settings)
    with broker.admin_channel(settings.broker_urls) as admin:
        if not admin.queue_exists(plan.failed_queue.name):
            raise broker.TopologyNotDeclared(
                f"The failed queue {plan.failed_queue.name!r} does not exist. "
                "Run `python manage.py declare_delay_topology`."
            )
        with admin.take_all(plan.failed_queue.name) as (_channel, taken):
            return [parse_failed(t.body, t.headers, t.message_id) for t in taken]


def _select(
    settings: DeferredSettings,
    ids: list[str] | None,
    act: Callable[[FailedJob], str | None],
) -> Outcome:
    """Apply ``act`` to the chosen entries (``ids``, or all if ``None``), acking each
    one only after ``act`` succeeded for it. ``act`` returns a reason to skip, or None.

    Entries not acked go back to the queue when the channel closes, so a
    crash at any point leaves each job either still failed or handled.
    """
    plan = plan_topology(settings)
    outcome = Outcome()
    wanted = None if ids is None else set(ids)
    with broker.admin_channel(settings.broker_urls) as admin:
        with admin.take_all(plan.failed_queue.name) as (channel, taken):
            chosen = []
            for message in taken:
                entry = parse_failed(
                    message.body,
                    message.headers,
                    message.message_id,
                    settings.signing_keys if settings.signing else None,
                )
                if wanted is None or entry.id in wanted:
                    chosen.append((message, entry))
            for message, entry in chosen:
                skip = act(entry)
                if skip:
                    outcome.skipped.append((entry.id, skip))
                    continue
                channel.basic_ack(message.tag)
                outcome.done.append(entry.id)
    found = set(outcome.done) | {entry_id for entry_id, _ in outcome.skipped}
    outcome.missing = sorted((wanted or set()) - found)
    return outcome


def redrive(
    settings: DeferredSettings,
    ids: list[str] | None,
    delay_s: float = 0,
    *,
    resign: bool = False,
) -> Outcome:
    """Defer the chosen failed jobs again, after ``delay_s``, as a fresh first attempt.

    The job keeps its id, and ``deferred.result()`` shows the new run: its first
    due time is set anew, which its result records carry as their run, and a
    later run supersedes the failure (:func:`deferred.records.results.fold`); a
    duplicate delivery of the failed run, which keeps the old first due time,
    does not. A record of the new run is written at once, so the job reads
    ``pending`` (``retrying``) until the new run starts.

    Each one is published (and confirmed) before its failed entry is acked,
    signed with the current key. An entry that is not signed with a key this
    process accepts (reason ``bad_signature``, or a record anyone could have
    put in the failed queue) is skipped unless ``resign``: signing it anew
    vouches for whatever it holds.
    """

    # A bad delay is refused before any entry is touched. A number of
    # seconds gives the same wait whenever it is asked, so once is enough.
    wait_ms = delay_ms(
        delay_s,
        now=utcnow(),
        resolution_ms=settings.resolution_ms,
        max_delay_ms=settings.max_delay_ms,
    )

    def act(entry: FailedJob) -> str | None:
        untrusted = entry.reason == BAD_SIGNATURE or not entry.trusted
        if untrusted and not resign:
            return (
                "it is not signed with a key this project accepts (reason "
                f"{entry.reason}), so it may not be ours: read it (`list --json`), and "
                "if it is to run, retry it with --resign"
            )
        found = entry.job
        if found is None and untrusted and entry.raw is not None:
            try:
                found = Job.decode(entry.raw)
            except BrokenMessage as exc:
                return f"its body is not a job ({exc})"
        if found is None:
            return "its body could not be read, so there is nothing to run"
        if found.queue not in settings.queues:
            return f"its queue {found.queue!r} is not in DEFERRED['QUEUES']"
        if resign and untrusted:
            logger.warning(
                "job=%s task=%s re-driven with --resign: signed anew with this project's key.",
                found.id,
                found.task,
            )
        now = utcnow()
        # first_due_at=None: its first due time is now this one, which marks a new
        # run in the results (a later one than the run that failed).
        job = replace(
            found,
            attempt=1,
            due=now + timedelta(milliseconds=wait_ms),
            first_due_at=None,
            workers=(),
        )
        publish(job, wait_ms, settings=settings)
        try:
            record_redrive(settings, job)
        except broker.BrokerError as exc:
            logger.warning(
                "job=%s re-driven, but the results stream could not be told (%s): it "
                "reads failed until its new run starts.",
                job.id,
                exc,
            )
        return None

    return _select(settings, ids, act)


def purge(settings: DeferredSettings, ids: list[str] | None) -> Outcome:
    """Delete the chosen failed jobs (all of them if ``ids`` is ``None``)."""
    return _select(settings, ids, lambda entry: None)
