"""Signed messages: an HMAC-SHA256 of each body, in a header, checked before anything is read.

Anyone who may publish to the vhost could otherwise make the worker run any
registered task with any arguments. Django signs what it hands to clients the
same way: a key derived from ``SECRET_KEY`` with a salt of our own
(``salted_hmac``), and ``SECRET_KEY_FALLBACKS`` accepted when verifying, so
that a key rotation drains the jobs signed with the old key.
``DEFERRED['SIGNING_KEY']`` and ``['SIGNING_KEY_FALLBACKS']`` replace both for
fleets whose web and worker processes must not share ``SECRET_KEY``.

The body is not touched: the signature travels in the ``x-deferred-signature``
header, which RabbitMQ keeps through dead-lettering, so a job arrives with
the signature it was published with however many delay queues it went through.
"""

from __future__ import annotations

from typing import Any

from django.utils.crypto import constant_time_compare, salted_hmac

#: The message header that carries the signature.
HEADER = "x-deferred-signature"
#: Our own salt: a signature made for another purpose with the same secret
#: (a session, a password reset token) is never valid here.
SALT = "deferred.core.signing.message"
#: Prefixed to the hex digest, so that another algorithm can follow.
SCHEME = "hmac-sha256:"


class BadSignature(ValueError):
    """A message that is not signed, or not with any key this process accepts."""


def signature(body: bytes, key: str | bytes) -> str:
    """The header value for ``body`` signed with ``key``."""
    return SCHEME + salted_hmac(SALT, body, secret=key, algorithm="sha256").hexdigest()


def sign(body: bytes, keys: tuple[str | bytes, ...]) -> dict[str, Any]:
    """The headers that sign ``body`` with the first of ``keys`` (none if there is no key)."""
    if not keys:
        return {}
    return {HEADER: signature(body, keys[0])}


def verify(body: bytes, headers: dict[str, Any] | None, keys: tuple[str | bytes, ...]) -> None:
    """Return if ``body`` is signed with one of ``keys``; else raise ``BadSignature``.

    Every key is tried (the current one, then the fallbacks), each compared in
    constant time, so how far a forged signature got does not leak.
    """
    value = (headers or {}).get(HEADER)
    if value is None:
        raise BadSignature("the message is not signed (no x-deferred-signature header)")
    if isinstance(value, bytes):  # AMQP long strings may arrive as bytes
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise BadSignature("the signature header is not text") from None
    if not isinstance(value, str) or not value.startswith(SCHEME):
        raise BadSignature(f"the signature header is not {SCHEME}<hex>")
    if not keys:
        raise BadSignature("no signing key is configured to verify it with")
    matched = False
    for key in keys:
        matched |= constant_time_compare(value, signature(body, key))
    if not matched:
        raise BadSignature(
            "the signature does not match: the message was altered, or signed with a key "
            "that is neither the current one nor a fallback"
        )
