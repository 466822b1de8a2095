"""What the worker checks of a message before it trusts any of it: size, signature, format.

In that order, and nothing more is read once a check fails: a body over the
limit is not even parsed, and a body that is not signed with one of our keys
is not decoded (its task is not looked up, its arguments are never shown). Pure
and total: whatever the bytes and headers, :func:`read` returns a job or the
reason it is refused, and never raises, so that no message can stop a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from deferred.core import signing
from deferred.core.jobs import BrokenMessage, Job

#: Failure reason: the message is larger than ``MAX_MESSAGE_BYTES``; not read.
TOO_LARGE = "too_large"
#: Failure reason: not signed, or not with a key this process accepts; never run.
BAD_SIGNATURE = "bad_signature"


class IntakeSettings(Protocol):
    """What :func:`read` needs of the settings (``deferred.conf``'s ``DeferredSettings``;
    a protocol, so that this pure module does not import the settings)."""

    @property
    def max_message_bytes(self) -> int: ...

    @property
    def signing(self) -> bool: ...

    @property
    def signing_keys(self) -> tuple[str | bytes, ...]: ...


@dataclass(frozen=True)
class Refused:
    """Why a message is not a job to run, for the failed queue."""

    reason: str
    detail: str
    #: Whether the failed record may keep the whole body (not when it is too large).
    keep_body: bool = True


def read(body: bytes, headers: dict[str, Any] | None, settings: IntakeSettings) -> Job | Refused:
    """The job in a message, or why it is refused; never raises."""
    if len(body) > settings.max_message_bytes:
        return Refused(
            TOO_LARGE,
            f"{len(body):,} bytes, more than DEFERRED['MAX_MESSAGE_BYTES'] "
            f"({settings.max_message_bytes:,}); not read",
            keep_body=False,
        )
    if settings.signing:
        try:
            signing.verify(
                body, headers if isinstance(headers, dict) else None, settings.signing_keys
            )
        except signing.BadSignature as exc:
            return Refused(BAD_SIGNATURE, str(exc))
    try:
        return Job.decode(body)
    except BrokenMessage as exc:
        return Refused(exc.reason, str(exc))
