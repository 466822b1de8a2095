"""The ledger's checkpoints: every pending job, sorted by due time, in pages.

Why: the ledger stream (:mod:`deferred.core.ledger`) holds every copy of every
job published within its retention, one message each. Reading it whole to
list what is pending costs about 70 µs a message in Python: 7 s for 100,000
jobs, and it grows with what was published, not with what waits. So the
keeper (:mod:`deferred.worker.keeper`) folds the ledger, from time to time,
into a checkpoint: the pending jobs as rows (:class:`Waiting`: what a listing
shows and where the job's newest record is), soonest due first,
:data:`ROWS_PER_PAGE` to a compressed message in the ``PREFIX.ledger-pages``
stream, and a head (:class:`Head`) in ``PREFIX.ledger-heads`` that says where
each page is, the due times it spans, and how far into the ledger and the
results the checkpoint saw.

A listing then reads the newest head, the pages its window needs (the first
page of a listing is one message), the ledger's tail after the checkpoint,
the cancels, and the results since the checkpoint for the jobs already due
(:func:`fold` is the same rule for the keeper and for a listing).

Finding one job: its id carries its first due time, and its row is on the first
two pages that may hold that time (rows due at one millisecond straddle two). A
row found no such way (a retry due later, a job moved, more than a page of jobs
due at one millisecond, an id without a due time) is written a second time, in
"away" pages sorted by id, which the head lists by their first and last ids
(:func:`away_rows`): a look-up reads one more page for them, and a checkpoint
costs one more row per such job.

Retention and compaction: a checkpoint is the compaction. Each one rewrites
what is still pending and nothing else, so the pages hold one row per pending
job whatever was published or ran before; the pages stream keeps
``LEDGER_PAGES_KEEP_MS`` (a few checkpoints), the heads stream likewise, and
old pages go with their segments. A job deferred for a year is in every
checkpoint of that year, and in the ledger stream only as long as its records
are carried (:func:`deferred.core.ledger.to_carry`). Without a checkpoint (a
topology where no worker has run yet) a listing reads the whole ledger.

What a row costs: about 35 bytes compressed on disk per pending job in each
checkpoint kept (rows of one task compress well), and nothing in broker
memory: a stream keeps its messages on disk.

Pure: the reads and writes are :mod:`deferred.records.checkpoints`'.
"""

from __future__ import annotations

import bisect
import heapq
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from deferred.core.pending_jobs import PREVIEW_BYTES, Filter, PendingJob, Starts, run_of

#: Rows in one page message: about 100 KB of JSON before compression.
ROWS_PER_PAGE = 1000
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Waiting:
    """One pending job as a checkpoint keeps it."""

    id: str
    due_ms: int
    task: str
    queue: str
    priority: int
    key: str | None
    enqueued_ms: int
    attempt: int
    #: The generation of its latest move (``deferred.core.moves``), if it was moved.
    gen: str | None
    #: Its run (``pending_jobs.run_of``): ``None`` for the first.
    run: int | None
    #: Its arguments as JSON, cut at ``PREVIEW_BYTES``; whole ones in ``args``/``kwargs``.
    preview: str
    args: list[Any] | None
    kwargs: dict[str, Any] | None
    #: The ledger offset of its newest record: the whole job, to publish it again.
    offset: int
    #: Whether it keeps results: without them nothing says it ran, and it is listed
    #: only until it is due.
    results: bool = True

    def wire(self) -> list[Any]:
        """The row as a page keeps it: its fields in order, ``results`` as 0 or 1."""
        return [*(getattr(self, name) for name in _NAMES[:-1]), int(self.results)]

    @classmethod
    def from_wire(cls, row: list[Any]) -> Waiting:
        """``ValueError`` for a row of another length."""
        if len(row) != len(_NAMES):
            raise ValueError(f"a ledger row has {len(_NAMES)} fields, not {len(row)}")
        values = dict(zip(_NAMES, row, strict=True))
        values["results"] = bool(values["results"])
        return cls(**values)

    def public(self) -> PendingJob:
        return PendingJob(
            id=self.id,
            task=self.task,
            queue=self.queue,
            priority=self.priority,
            key=self.key,
            due=_moment(self.due_ms),
            enqueued=_moment(self.enqueued_ms),
            attempt=self.attempt,
            args=self.args,
            kwargs=self.kwargs,
            preview=self.preview,
            moved=self.gen is not None,
        )

    def matches(self, where: Filter) -> bool:
        due = _moment(self.due_ms)
        return (
            (where.task is None or self.task == where.task)
            and (where.queue is None or self.queue == where.queue)
            and (where.key is None or self.key == where.key)
            and (where.due_after is None or due >= where.due_after)
            and (where.due_before is None or due < where.due_before)
        )

    @property
    def order(self) -> tuple[int, str]:
        return (self.due_ms, self.id)


#: A row's fields, in the order a page keeps them.
_NAMES = tuple(f.name for f in fields(Waiting))


def waiting_of(job: Any, offset: int, *, results: bool) -> Waiting:
    """The row of ``job`` (a :class:`deferred.core.jobs.Job`), whose record is at ``offset``."""
    call = json.dumps([list(job.args), job.kwargs], separators=(",", ":"), default=str)
    whole = len(call.encode()) <= PREVIEW_BYTES
    preview = call if whole else call.encode()[:PREVIEW_BYTES].decode(errors="ignore") + "…"
    return Waiting(
        id=job.id,
        due_ms=_ms(job.due),
        task=job.task,
        queue=job.queue,
        priority=job.priority,
        key=job.key,
        enqueued_ms=_ms(job.created),
        attempt=job.attempt,
        gen=job.gen,
        run=run_of(job),
        preview=preview,
        args=list(job.args) if whole else None,
        kwargs=dict(job.kwargs) if whole else None,
        offset=offset,
        results=results,
    )


@dataclass(frozen=True)
class PageRef:
    """Where one page is, and the due times of its first and last rows (ms)."""

    offset: int
    first_ms: int
    last_ms: int
    rows: int


@dataclass(frozen=True)
class AwayRef:
    """Where one "away" page is (rows sorted by id), and its first and last ids."""

    offset: int
    first_id: str
    last_id: str
    rows: int


@dataclass(frozen=True)
class Head:
    """One checkpoint: its pages, and how far it read the ledger and the results."""

    #: Which checkpoint: a page carries it, so that a page of another is never taken.
    token: str
    #: When its reads began (ms, the keeper's clock): results written from then on
    #: (less a margin) are for a listing to read.
    made_ms: int
    #: The last ledger offset folded in (-1: none).
    ledger_offset: int
    pages: tuple[PageRef, ...]
    #: The pages of the rows a look-up by due time does not find (:func:`away_rows`).
    away: tuple[AwayRef, ...] = ()

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pages)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "v": FORMAT_VERSION,
                "token": self.token,
                "made": self.made_ms,
                "ledger": self.ledger_offset,
                "pages": [[p.offset, p.first_ms, p.last_ms, p.rows] for p in self.pages],
                "away": [[a.offset, a.first_id, a.last_id, a.rows] for a in self.away],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, body: bytes) -> Head:
        """``ValueError`` for anything but a head of this format."""
        try:
            data = json.loads(body)
            if data.get("v") != FORMAT_VERSION:
                raise ValueError("not a ledger head of a known version")
            pages = tuple(PageRef(int(o), int(f), int(la), int(r)) for o, f, la, r in data["pages"])
            # A head written before away pages has none.
            away = tuple(
                AwayRef(int(o), str(f), str(la), int(r)) for o, f, la, r in data.get("away", ())
            )
            return cls(str(data["token"]), int(data["made"]), int(data["ledger"]), pages, away)
        except (AttributeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a ledger head: {exc}") from None

    def pages_of(self, first_due_ms: int | None) -> list[int]:
        """The indexes of the (at most two) pages a look-up of a job first due at
        ``first_due_ms`` reads; the rest of its rows are in the away pages."""
        if first_due_ms is None:
            return []
        start = bisect.bisect_left([p.last_ms for p in self.pages], first_due_ms)
        return list(range(start, min(start + 2, len(self.pages))))

    def away_page(self, job_id: str) -> int | None:
        """The index of the away page that may hold ``job_id``'s row, if any."""
        at = bisect.bisect_right([a.first_id for a in self.away], job_id) - 1
        if at >= 0 and job_id <= self.away[at].last_id:
            return at
        return None

    def pages_from(self, due_after_ms: int | None, due_before_ms: int | None) -> list[int]:
        """The indexes of the pages that may hold rows due in the window, in order."""
        return [
            i
            for i, p in enumerate(self.pages)
            if (due_after_ms is None or p.last_ms >= due_after_ms)
            and (due_before_ms is None or p.first_ms < due_before_ms)
        ]


def encode_page(token: str, number: int, rows: list[Waiting]) -> bytes:
    body = json.dumps(
        {"v": FORMAT_VERSION, "token": token, "n": number, "rows": [r.wire() for r in rows]},
        separators=(",", ":"),
        default=str,
    ).encode()
    return zlib.compress(body, 6)


def decode_page(body: bytes) -> tuple[str, int, list[Waiting]]:
    """``(token, number, rows)`` of a page; ``ValueError`` for anything else."""
    try:
        data = json.loads(zlib.decompress(body))
        if data.get("v") != FORMAT_VERSION:
            raise ValueError("not a ledger page of a known version")
        return data["token"], data["n"], [Waiting.from_wire(r) for r in data["rows"]]
    except (zlib.error, AttributeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a ledger page: {exc}") from None


def find_in_page(body: bytes, job_id: str) -> tuple[str, Waiting | None]:
    """``(token, row of job_id or None)`` of a page, without decoding its other rows (a
    look-up of one job reads one page: a thousand rows, 3 ms to decode whole).
    ``ValueError`` for anything but a page."""
    try:
        text = zlib.decompress(body).decode()
    except (zlib.error, UnicodeDecodeError) as exc:
        raise ValueError(f"not a ledger page: {exc}") from None
    head_end = text.find(',"rows":')
    try:
        meta = json.loads(text[:head_end] + "}") if head_end > 0 else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("v") != FORMAT_VERSION:
        raise ValueError("not a ledger page of a known version")
    token = str(meta.get("token"))
    needle = f'["{job_id}",'
    at = text.find(needle, head_end)
    while at >= 0:
        # A row starts the list or follows another; the same text inside a row's
        # arguments is no row of its own.
        if text[at - 1] in "[,":
            try:
                row, _end = json.JSONDecoder().raw_decode(text, at)
                found = Waiting.from_wire(row)
            except (TypeError, ValueError):
                found = None
            if found is not None and found.id == job_id:
                return token, found
        at = text.find(needle, at + 1)
    return token, None


def paginate(rows: list[Waiting]) -> list[list[Waiting]]:
    """Sorted rows, cut into pages."""
    return [rows[i : i + ROWS_PER_PAGE] for i in range(0, len(rows), ROWS_PER_PAGE)]


def away_rows(
    pages: list[list[Waiting]], first_due_of: Callable[[str], int | None]
) -> list[Waiting]:
    """The rows of ``pages`` (sorted by due time) that :meth:`Head.pages_of` their first
    due time (``first_due_of(id)``) does not point at, sorted by id: the away pages'."""
    lasts = [page[-1].due_ms for page in pages]
    away = []
    for index, page in enumerate(pages):
        for row in page:
            first = first_due_of(row.id)
            if first is None or not 0 <= index - bisect.bisect_left(lasts, first) < 2:
                away.append(row)
    away.sort(key=lambda r: r.id)
    return away


def newest(
    tail: Iterable[Waiting], stale: Callable[[str, str | None, int], bool]
) -> dict[str, Waiting]:
    """The newest row of each job among ``tail`` (in stream order): its latest record,
    or of a moved job its latest record of the latest move."""
    out: dict[str, Waiting] = {}
    for row in tail:
        if stale(row.id, row.gen, row.attempt):
            out.setdefault(row.id, row)
            continue
        out[row.id] = row
    return out


def fold(
    base: Iterable[Waiting],
    tail: dict[str, Waiting],
    *,
    starts: Starts,
    gone: Callable[[str], bool],
    stale: Callable[[str, str | None, int], bool],
    now_ms: int,
) -> Iterator[Waiting]:
    """The pending jobs, soonest first: ``base`` (a checkpoint's rows, sorted) with the
    rows of ``tail`` (:func:`newest`) in place of theirs, less every job that
    started, is ``gone`` (cancelled, superseded) or is a copy a move replaced."""
    kept = (r for r in base if r.id not in tail)
    added = sorted(tail.values(), key=lambda r: r.order)
    for row in heapq.merge(kept, added, key=lambda r: r.order):
        if gone(row.id) or stale(row.id, row.gen, row.attempt):
            continue
        if starts.highest(row.id, row.run) >= row.attempt:
            continue
        if not row.results and row.due_ms <= now_ms:
            continue
        yield row


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _moment(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)
