"""Reading and writing the ledger's checkpoints (:mod:`deferred.core.ledger_index`).

What a listing reads (:func:`read_state`): the newest head, then the pages
it needs, the ledger's tail after the checkpoint, the cancels, and the
results since the checkpoint for the jobs already due. What the keeper writes
(:func:`write`): the same fold over every page, as the next checkpoint.

Freshness: a listing sees every job whose ``defer()`` returned before it
began (the ledger's tail is read to a marker published as the read began),
and every cancel, key and move confirmed before then. A job leaves the list
once its start is in the results stream: ``STARTED_AFTER_S`` after it began
(or as it ended, for a shorter one), plus the results writer's linger.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from deferred import broker
from deferred.broker import ledger_index as io
from deferred.conf import DeferredSettings
from deferred.core import signing
from deferred.core.jobs import BrokenMessage, Job, due_ms_of
from deferred.core.ledger_index import (
    AwayRef,
    Head,
    PageRef,
    Waiting,
    away_rows,
    decode_page,
    encode_page,
    find_in_page,
    fold,
    newest,
    paginate,
    waiting_of,
)
from deferred.core.pending_jobs import Starts
from deferred.core.topology import (
    CANCEL_ROUTING_KEY,
    LEDGER_ROUTING_KEY,
    Plan,
    plan_topology,
)
from deferred.records import cancels as cancel_records
from deferred.records import result_format
from deferred.records.cancels import CancelView
from deferred.records.recording import keeps_result
from deferred.records.results import each_record

logger = logging.getLogger("deferred.ledger")

#: How long a read of the heads waits for the newest before it takes the stream for
#: empty (a topology no worker has run on yet).
HEAD_WAIT_S = 0.3
#: How long an incremental read waits for the message it saw last: a stream deleted
#: and declared again (shorter) sends nothing from there, and is read whole instead.
KNOWN_WAIT_S = 1.0
#: How far before a checkpoint's reads a listing reads the results again: a start
#: is recorded up to STARTED_AFTER_S and the writer's linger after it happened.
RESULTS_MARGIN_MS = 5_000


class Stale(broker.BrokerUnavailable):
    """What this process kept of a topology's ledger is not what the broker holds (its
    streams were deleted and declared again): read again without it."""


@dataclass
class State:
    """What one read found: the newest checkpoint (or none), the ledger's tail after
    it, the cancels, keys and moves in force, and the results read so far."""

    head: Head | None
    tail: dict[str, Waiting]
    tail_end: int
    view: CancelView
    starts: Starts
    #: From when the results were read (ms), or ``None``: not yet.
    results_from_ms: int | None = None


def _plan(settings: DeferredSettings) -> Plan:
    plan = plan_topology(settings)
    if plan.ledger_queue is None or plan.ledger_pages_queue is None:
        raise broker.TopologyNotDeclared(
            "The ledger is off (DEFERRED['LEDGER'] = False): there is no record of pending jobs."
        )
    return plan


def latest_head(settings: DeferredSettings, session: io.StreamSession) -> Head | None:
    """The newest checkpoint's head, or ``None`` when there is none.

    Only the keeper writes the heads stream, a head per publish: its last chunk
    is the newest head. An empty stream answers nothing, so "none" costs
    :data:`HEAD_WAIT_S`."""
    plan = _plan(settings)
    assert plan.ledger_heads_queue is not None
    bodies = session.read_last(plan.ledger_heads_queue.name, wait_s=HEAD_WAIT_S)
    heads = []
    for body in bodies:
        try:
            heads.append(Head.decode(body))
        except ValueError:
            pass
    return heads[-1] if heads else None


def read_pages(
    settings: DeferredSettings, session: io.StreamSession, head: Head, indexes: list[int]
) -> Iterator[list[Waiting]]:
    """The rows of the pages ``indexes`` (in order) of ``head``'s checkpoint, a page at
    a time. ``BrokerUnavailable`` if one of them is gone (the stream's retention)."""
    plan = _plan(settings)
    assert plan.ledger_pages_queue is not None
    run: list[int] = []
    for index in indexes:
        if run and index != run[-1] + 1:
            yield from _read_run(session, plan, head, run)
            run = []
        run.append(index)
    if run:
        yield from _read_run(session, plan, head, run)


def _read_run(
    session: io.StreamSession, plan: Plan, head: Head, run: list[int]
) -> Iterator[list[Waiting]]:
    refs: list[PageRef] = [head.pages[i] for i in run]
    # A few at a time: a listing usually needs the first page only.
    for start in range(0, len(refs), 8):
        batch = refs[start : start + 8]
        span = batch[-1].offset - batch[0].offset + 1
        assert plan.ledger_pages_queue is not None
        got = session.read_at(plan.ledger_pages_queue.name, batch[0].offset, span)
        pages = {offset: body for offset, body, _headers in got}
        for ref in batch:
            body = pages.get(ref.offset)
            if body is None:
                raise Stale(
                    f"A page of the ledger's checkpoint {head.token} is gone (offset {ref.offset})."
                )
            token, _number, rows = decode_page(body)
            if token != head.token:
                raise Stale(f"Offset {ref.offset} holds no page of checkpoint {head.token}.")
            yield rows


def find_row(
    settings: DeferredSettings,
    session: io.StreamSession,
    head: Head,
    job_id: str,
    due_ms: int | None,
) -> Waiting | None:
    """The row of ``job_id`` in ``head``'s checkpoint: on the pages that may hold a job
    due at ``due_ms`` (rows due at one millisecond may straddle two), else on the away
    page of its id (``deferred.core.ledger_index.away_rows``; only there for an id
    without a due time, ``due_ms`` None)."""
    plan = _plan(settings)
    assert plan.ledger_pages_queue is not None
    offsets = [head.pages[i].offset for i in head.pages_of(due_ms)]
    away = head.away_page(job_id)
    if away is not None:
        offsets.append(head.away[away].offset)
    for at in offsets:
        for offset, body, _headers in session.read_at(plan.ledger_pages_queue.name, at, 1):
            if offset != at:
                continue
            token, row = find_in_page(body, job_id)
            if token != head.token:
                raise Stale(f"Offset {at} holds no page of checkpoint {head.token}.")
            if row is not None:
                return row
    return None


def find_row_alone(
    settings: DeferredSettings, head: Head, job_id: str, due_ms: int | None, timeout: float
) -> Waiting | None:
    """:func:`find_row` on a connection of its own."""
    with io.StreamSession(settings.broker_urls, timeout=timeout) as session:
        return find_row(settings, session, head, job_id, due_ms)


def read_tail(
    settings: DeferredSettings,
    session: io.StreamSession,
    after: int,
    *,
    known: Known | None = None,
    pace: Callable[[], None] | None = None,
) -> tuple[list[Waiting], Known | None]:
    """The job records of the ledger after offset ``after`` (-1: all), in stream order, as
    rows; and the last message read (``known`` if none). With ``known`` (the last
    message an earlier read saw), the read starts at it, and returns ``None`` in place
    of the rows if it is not there any more (the stream was deleted and declared again).
    ``pace``: called at each message (a checkpoint's reads keep to a rate with it)."""
    plan = _plan(settings)
    assert plan.ledger_queue is not None
    keys = settings.signing_keys if settings.signing else None
    results_on = settings.results
    rows: list[Waiting] = []
    reader = _Reader(known)

    def on_message(offset: int, body: bytes, headers: dict[str, Any]) -> bool:
        if pace is not None:
            pace()
        if not reader.see(offset, body):
            return reader.gone
        if not body or body[:1] != b"{":
            return False
        try:
            job = Job.decode(body)
            if keys is not None:
                signing.verify(body, headers, keys)
        except (BrokenMessage, ValueError):
            return False  # a marker, or a record a worker would not run either
        rows.append(waiting_of(job, offset, results=results_on and keeps_result(job)))
        return False

    token = uuid.uuid4().hex
    if not session.read_to_now(
        plan.ledger_queue.name,
        reader.start(after),
        on_message,
        marker=(plan.ingest_exchange, LEDGER_ROUTING_KEY, result_format.encode_marker(token)),
        is_marker=result_format.marker_of,
        first_within=None if after < 0 and known is None else KNOWN_WAIT_S,
        # Paced, in small bursts: the broker sends a read's credit at once.
        credit=2000 if pace is None else PACED_CREDIT,
    ):
        reader.gone = True
    return (None if reader.gone else rows), reader.last  # type: ignore[return-value]


@dataclass(frozen=True)
class Known:
    """The last message a read saw: its offset and a checksum of its body."""

    offset: int
    crc: int


class _Reader:
    """Where an incremental read starts, and whether the stream is still the one read
    before: it starts at the last message seen, which must be there, unchanged."""

    def __init__(self, known: Known | None) -> None:
        self.known = known
        self.last = known
        self.gone = False
        self._checked = known is None

    def start(self, after: int) -> int | str:
        if self.known is not None:
            return self.known.offset
        return "first" if after < 0 else after + 1

    def see(self, offset: int, body: bytes) -> bool:
        """Whether to take this message (the first one of an incremental read is the
        one seen before: checked, not taken again)."""
        if not self._checked:
            self._checked = True
            assert self.known is not None
            if offset != self.known.offset or zlib.crc32(body) != self.known.crc:
                self.gone = True
            return False
        if self.last is None or offset > self.last.offset:
            self.last = Known(offset, zlib.crc32(body))
        return True


def read_cancels(settings: DeferredSettings, session: io.StreamSession) -> CancelView:
    """The cancels, keys and moves in force: the cancels stream, read to now."""
    view = CancelView(settings.cancel_margin_ms / 1000)
    read_cancels_into(settings, session, view, None)
    return view


def read_cancels_into(
    settings: DeferredSettings,
    session: io.StreamSession,
    view: CancelView,
    known: Known | None,
) -> tuple[bool, Known | None]:
    """Apply to ``view`` the cancels stream from after ``known`` (``None``: all), read to
    now; return whether the stream was still the one read before, and the last message
    read. Nothing is applied when it was not."""
    plan = _plan(settings)
    now = time.time()
    keys = settings.signing_keys if settings.signing else None
    reader = _Reader(known)
    records: list[Any] = []

    def on_message(offset: int, body: bytes, headers: dict[str, Any]) -> bool:
        if not reader.see(offset, body):
            return reader.gone
        try:
            record = cancel_records.decode_record(body)
            if keys is not None:
                signing.verify(body, headers, keys)
        except ValueError:  # BadSignature too: what a worker would ignore
            return False
        records.append(record)
        return False

    token = uuid.uuid4().hex
    if not session.read_to_now(
        plan.cancels_queue.name,
        reader.start(-1),
        on_message,
        marker=(
            plan.ingest_exchange,
            CANCEL_ROUTING_KEY,
            cancel_records.encode_marker(token),
        ),
        is_marker=cancel_records.marker_of,
        first_within=None if known is None else KNOWN_WAIT_S,
    ):
        reader.gone = True
    if reader.gone:
        return False, None
    for record in records:
        view.apply(record, now)
    return True, reader.last


def read_state(
    settings: DeferredSettings,
    session: io.StreamSession,
    *,
    cached: bool = True,
    whole: bool = False,
    pace: Callable[[], None] | None = None,
) -> State:
    """The newest checkpoint's head, the ledger's tail after it, and the cancels (read at
    the same time, on a connection of their own).

    ``cached``: what this process read last time is kept (:class:`_Follow`): a
    head for :data:`HEAD_TTL_S` (an older head is as right, with a longer tail),
    and the tail and the cancels up to where they were read, so that the next
    read is of what came since. A look-up of one job is then two markers' round
    trips and a page."""
    plan = _plan(settings)
    if not cached or whole:
        # ``whole``: without the checkpoint (its pages gone), the ledger from its start.
        cancels = in_parallel(read_cancels_alone, settings, session.timeout)
        head = None if whole else latest_head(settings, session)
        tail, last = read_tail(
            settings, session, -1 if head is None else head.ledger_offset, pace=pace
        )
        view = cancels.result()
        if tail is None:
            raise Stale("The ledger has nothing where its newest checkpoint says it read to.")
        end = -1 if head is None else head.ledger_offset
        return State(
            head,
            newest(tail, view.moves.is_stale),
            end if last is None else last.offset,
            view,
            Starts(),
        )
    key = (settings.broker_urls, plan.prefix, settings.signing_keys if settings.signing else None)
    with _follows_lock:
        follow = _follows.get(key)
        if follow is None:
            follow = _follows[key] = _Follow(CancelView(settings.cancel_margin_ms / 1000))
    with follow.lock:
        cancels = in_parallel(follow.read_cancels, settings, session.timeout)
        try:
            return _read_followed(settings, session, follow, cancels)
        finally:
            # Never two reads of one view at once: this one ends before the lock goes.
            cancels.exception()


def _read_followed(
    settings: DeferredSettings,
    session: io.StreamSession,
    follow: _Follow,
    cancels: Future[CancelView],
) -> State:
    if follow.head is None or time.monotonic() - follow.head_at > HEAD_TTL_S:
        head = latest_head(settings, session)
        if head is None or follow.head is None or head.token != follow.head.token:
            follow.head, follow.rows, follow.tail = head, [], None
        follow.head_at = time.monotonic()
    after = -1 if follow.head is None else follow.head.ledger_offset
    rows, last = read_tail(settings, session, after, known=follow.tail)
    if rows is None:
        # Not the ledger read before (declared again): this process forgets it all.
        cancels.exception()
        forget(settings)
        raise Stale("The ledger's streams are not the ones this process read before.")
    follow.rows.extend(rows)
    follow.tail = last
    view = cancels.result()
    return State(
        follow.head,
        newest(follow.rows, view.moves.is_stale),
        after if last is None else last.offset,
        view,
        Starts(),
    )


def forget(settings: DeferredSettings) -> None:
    """Drop what this process kept of the ledger of ``settings``' topology."""
    plan = _plan(settings)
    key = (settings.broker_urls, plan.prefix, settings.signing_keys if settings.signing else None)
    with _follows_lock:
        _follows.pop(key, None)


def cached_head(settings: DeferredSettings) -> Head | None:
    """The head this process read last for these settings, if any (it may be older
    than the newest: still right, with a longer tail)."""
    plan = _plan(settings)
    key = (settings.broker_urls, plan.prefix, settings.signing_keys if settings.signing else None)
    follow = _follows.get(key)
    return None if follow is None else follow.head


#: Messages a paced read of the ledger lets the broker send ahead of its acks.
PACED_CREDIT = 100

#: How long a process takes the head it read for the newest.
HEAD_TTL_S = 5.0


@dataclass
class _Follow:
    """What this process read of one topology's ledger: the head it took, the tail since
    (rows, and the last message read), and the cancels' view (and its last message)."""

    view: CancelView
    head: Head | None = None
    head_at: float = 0.0
    rows: list[Waiting] = field(default_factory=list)
    tail: Known | None = None
    cancels: Known | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read_cancels(self, settings: DeferredSettings, timeout: float) -> CancelView:
        with io.StreamSession(settings.broker_urls, timeout=timeout) as session:
            same, last = read_cancels_into(settings, session, self.view, self.cancels)
            if not same:  # the stream was declared again: read it all
                self.view = CancelView(settings.cancel_margin_ms / 1000)
                same, last = read_cancels_into(settings, session, self.view, None)
            self.cancels = last
        self.view.sweep(time.time())
        return self.view


_follows: dict[tuple[Any, ...], _Follow] = {}
_follows_lock = threading.Lock()


def read_cancels_alone(settings: DeferredSettings, timeout: float) -> CancelView:
    """:func:`read_cancels` on a connection of its own."""
    with io.StreamSession(settings.broker_urls, timeout=timeout) as session:
        return read_cancels(settings, session)


def in_parallel(call: Callable[..., T], *args: Any) -> Future[T]:
    """``call(*args)`` on a thread of its own: a look-up's reads that do not wait for
    each other overlap (each is mostly a wait on the broker).

    A daemon thread, not an executor's: Python waits for an executor's threads at
    exit, and a read blocked on a connection that went (a worker paused with
    SIGSTOP, then stopped) would hold the process up to its timeout."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name="deferred-ledger-read", daemon=True).start()
    return future


T = TypeVar("T")


def read_results(
    settings: DeferredSettings,
    state: State,
    since_ms: int,
    *,
    timeout: float,
    pace: Callable[[], None] | None = None,
) -> None:
    """Add to ``state`` the results written from ``since_ms`` on (not earlier than the
    checkpoint saw them, less a margin); nothing for a read already as early."""
    if not settings.results:
        return
    if state.head is not None:
        since_ms = max(since_ms, state.head.made_ms - RESULTS_MARGIN_MS)
    if state.results_from_ms is not None and state.results_from_ms <= since_ms:
        return
    since = datetime.fromtimestamp(since_ms / 1000, UTC)
    if not each_record(settings, since, state.starts.add, timeout=timeout, pace=pace):
        raise broker.BrokerUnavailable(
            f"Reading the results from {since.isoformat()} took more than {timeout:g} s."
        )
    state.results_from_ms = since_ms


def pending_rows(
    settings: DeferredSettings,
    state: State,
    base: Iterator[Waiting],
    *,
    timeout: float,
    started_from_ms: int | None,
    pace: Callable[[], None] | None = None,
) -> Iterator[Waiting]:
    """The pending rows, soonest first: ``base`` (a checkpoint's rows in order, or none)
    folded with ``state``. ``started_from_ms``: the earliest due time among the rows
    that may have started, for the results read (``None``: none is due yet)."""
    if started_from_ms is not None:
        read_results(settings, state, started_from_ms, timeout=timeout, pace=pace)
    view = state.view
    return fold(
        base,
        state.tail,
        starts=state.starts,
        gone=lambda job_id: job_id in view or view.keys.is_superseded(job_id),
        stale=view.moves.is_stale,
        now_ms=int(time.time() * 1000),
    )


def write(
    settings: DeferredSettings, *, timeout: float, pace: Callable[[], None] | None = None
) -> Head:
    """Fold the newest checkpoint, the ledger's tail and the other streams into the next
    checkpoint, and write it (the keeper's, every ``CHECKPOINT_EVERY_S`` or so).

    ``pace``: called at each ledger and results message read, to keep the
    reads to a rate (``deferred.worker.checkpointing``): the broker sends a stream
    as fast as it is read, and a burst of it delays the jobs' own traffic."""
    deadline = _Deadline(timeout)
    made_ms = int(time.time() * 1000)
    with io.StreamSession(settings.broker_urls, timeout=timeout) as session:
        return _write(settings, session, deadline, made_ms, pace)


def _write(
    settings: DeferredSettings,
    session: io.StreamSession,
    deadline: _Deadline,
    made_ms: int,
    pace: Callable[[], None] | None,
) -> Head:
    try:
        state = read_state(settings, session, cached=False, pace=pace)
    except Stale:
        # The checkpoint's pages are gone (retention) or were never there: from the
        # whole ledger.
        state = read_state(settings, session, cached=False, whole=True, pace=pace)
    plan = _plan(settings)
    assert plan.ledger_pages_queue is not None and plan.ledger_heads_queue is not None
    head = state.head

    def base() -> Iterator[Waiting]:
        if head is None:
            return
        for rows in read_pages(settings, session, head, list(range(len(head.pages)))):
            yield from rows

    # Which of them may have started: the results from the earliest due time among the
    # jobs due by now, or from where the last checkpoint read them.
    due_now = [r.due_ms for r in state.tail.values() if r.due_ms <= made_ms]
    earliest = min(due_now, default=None)
    if head is not None and head.pages and head.pages[0].first_ms <= made_ms:
        earliest = min(head.pages[0].first_ms, earliest or head.pages[0].first_ms)
    rows = list(
        pending_rows(
            settings,
            state,
            base(),
            timeout=deadline.left(),
            started_from_ms=None if earliest is None else earliest - RESULTS_MARGIN_MS,
            pace=pace,
        )
    )
    token = uuid.uuid4().hex
    pages = paginate(rows)
    away = paginate(away_rows(pages, due_ms_of))
    bodies = [encode_page(token, n, page) for n, page in enumerate(pages + away)]

    def head_for(offsets: list[int]) -> bytes:
        refs = tuple(
            PageRef(offset, page[0].due_ms, page[-1].due_ms, len(page))
            for offset, page in zip(offsets[: len(pages)], pages, strict=True)
        )
        away_refs = tuple(
            AwayRef(offset, page[0].id, page[-1].id, len(page))
            for offset, page in zip(offsets[len(pages) :], away, strict=True)
        )
        return Head(token, made_ms, state.tail_end, refs, away_refs).encode()

    offsets = io.write_checkpoint(
        settings.broker_urls,
        plan.ledger_pages_queue.name,
        plan.ledger_heads_queue.name,
        token,
        bodies,
        head_for,
        timeout=deadline.left(),
    )
    written = Head.decode(head_for(offsets))
    logger.info(
        "Wrote the ledger's checkpoint: %d pending job%s in %d page%s (%.1f s).",
        written.rows,
        "" if written.rows == 1 else "s",
        len(pages),
        "" if len(pages) == 1 else "s",
        (time.time() * 1000 - made_ms) / 1000,
    )
    return written


class _Deadline:
    """What is left of one operation's time, for each of its reads."""

    def __init__(self, timeout: float) -> None:
        self._end = time.monotonic() + timeout

    def left(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise broker.BrokerUnavailable("The ledger's read ran out of time.")
        return left
