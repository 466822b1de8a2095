"""The results stream's record format: what a record holds, the states and
events it names, and how records are packed, signed and read back.

Shared by the writing side (:mod:`deferred.records.recording`) and the reading
side (:mod:`deferred.records.results`), so that both speak one format.
"""

from __future__ import annotations

import json
import traceback
from datetime import UTC, datetime
from typing import Any

from deferred.core import signing
from deferred.core.jobs import due_ms_of

FORMAT_VERSION = 1
#: How far before a job's due time the reader starts. A worker starts an attempt
#: once its own clock reaches the due time (the instant the id carries; the
#: deferring host's clock does not enter into it), and the stream stamps the
#: record with the broker's clock. A worker whose clock runs ahead of the
#: broker's by ``d`` writes a record stamped up to ``d`` before the due time; the
#: slack covers ``d`` up to this much. A worker clock behind the broker's only
#: stamps records later, which costs nothing ("never early" asks clocks to
#: agree anyway). Every message stamped within the slack is read before the job's
#: own: at 100 jobs/s, 2 s of slack was about 160 messages and most of a look-up's
#: time, so the slack is what NTP-kept clocks need, with a wide margin.
CLOCK_SLACK_S = 0.25
#: A job shows "running" once it has run this long: the "started" record of an
#: attempt that ends sooner is folded into its final one (one record per job).
STARTED_AFTER_S = 0.2
#: The longest traceback kept with an error.
MAX_TRACEBACK_CHARS = 8000
#: The longest error message kept.
MAX_MESSAGE_CHARS = 2000

#: The states of a result.
PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    "pending",
    "running",
    "succeeded",
    "failed",
    "cancelled",
)
#: Record events that end a run of a job.
FINAL_EVENTS = frozenset({"succeeded", "failed", "cancelled", "superseded", "dropped"})
#: Final events no later run can follow, so the reader stops at one. A "failed" job
#: is in the failed list, and a re-drive runs it again under the same id: after
#: one, the reader reads on to the end of the stream.
LAST_EVENTS = FINAL_EVENTS - {"failed"}
STATE_OF = {
    "started": RUNNING,
    "retrying": PENDING,
    "succeeded": SUCCEEDED,
    "failed": FAILED,
    "dropped": FAILED,
    "cancelled": CANCELLED,
    "superseded": CANCELLED,
}


def encode(records: list[dict[str, Any]]) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, "r": records}, separators=(",", ":")).encode()


def decode(
    body: bytes, headers: dict[str, Any] | None, keys: tuple[str | bytes, ...] | None
) -> list[dict[str, Any]]:
    """The records of one stream message; none if it is not one, or (``keys`` given)
    its signature does not match: a forged record is never read."""
    if keys is not None:
        try:
            signing.verify(body, headers, keys)
        except signing.BadSignature:
            return []
    try:
        data = json.loads(body)
    except ValueError:
        return []
    if not isinstance(data, dict) or data.get("v") != FORMAT_VERSION:
        return []
    records = data.get("r")
    if not isinstance(records, list):
        return []
    return [r for r in records if isinstance(r, dict)]


def encode_marker(token: str) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, "marker": token}).encode()


def marker_of(body: bytes) -> str | None:
    if b'"marker"' not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    token = data.get("marker") if isinstance(data, dict) else None
    return token if isinstance(token, str) else None


def id_marker(job_id: str) -> bytes:
    return json.dumps(job_id).encode()


def iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def moment(value: Any) -> datetime | None:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
        return moment if moment.tzinfo is not None else None
    return None


def error_of(error: BaseException) -> dict[str, str]:
    """An exception as a record carries it: class path, message, traceback (cut)."""
    kind = type(error)
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the outcome
        message = f"<{kind.__name__} whose message cannot be printed>"
    try:
        tb = "".join(traceback.format_exception(error))
    except Exception:  # noqa: BLE001
        tb = ""
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "msg": message[:MAX_MESSAGE_CHARS],
        "tb": tb[-MAX_TRACEBACK_CHARS:],
    }


def value_record(value: Any, max_bytes: int) -> dict[str, Any]:
    """``{"value": v}`` if JSON carries ``value`` in ``max_bytes``, else ``{"kept": False}``."""
    if value is None and max_bytes >= 4:  # most tasks return nothing: "null", at no cost
        return {"value": None}
    try:
        text = json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return {"kept": False}
    if len(text.encode()) > max_bytes:
        return {"kept": False}
    return {"value": json.loads(text)}


# ---------------------------------------------------------------------- writing


def signed(body: bytes, keys: tuple[str | bytes, ...]) -> tuple[bytes, dict[str, Any]]:
    return body, signing.sign(body, keys)


def id_ms(job_id: str) -> int:
    """The due time ``job_id`` carries, in ms (0 for what is not a job id): its first
    48 bits, as :func:`deferred.core.jobs.new_job_id` lays them out."""
    return due_ms_of(job_id) or 0
