"""What a valid value is, one kind of setting at a time.

Each parser takes the setting's name as the reader wrote it (``DEFERRED['RADIX']``,
or ``TASKS['default']['OPTIONS']['MAX_RETRIES']`` for the django.tasks backend)
and the raw value, and returns the value the code uses, or raises
``ImproperlyConfigured`` naming that setting: the same rules and the same words
wherever a setting can be given. ``deferred.conf`` holds the table of settings
that picks one parser per key.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

from deferred.core.limits import parse_time_limit
from deferred.core.retries import parse_backoff, validate_max_retries
from deferred.core.schedule import Schedule
from deferred.core.topology import MAX_TTL_MS

#: A parser: the setting's name and its raw value in, the value the code uses out.
Parser = Callable[[str, Any], Any]

QUEUE_TYPES = ("classic", "quorum")

# Exchange and queue names: AMQP allows up to 255 bytes of any characters, but
# a conservative alphabet keeps them usable in shells, URLs and rabbitmqctl.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
# Target queue names become one word of a routing key, so no dots (a topic
# pattern "#.b" also matches "a.b") and nothing a topic pattern treats specially.
_QUEUE_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def validate_queue_name(queue: object) -> None:
    """Raise ``ValueError`` unless ``queue`` can be a target queue name."""
    if not isinstance(queue, str) or not _QUEUE_RE.match(queue) or len(queue) > 100:
        raise ValueError(
            "A queue name must be 1-100 letters, digits, '_' or '-' (no dots: the name "
            f"is one word of a routing key); got {queue!r}."
        )


# --------------------------------------------------------------------------- building blocks


def duration_ms(name: str, value: Any) -> float:
    """A ``timedelta`` or a number of seconds, in milliseconds."""
    if isinstance(value, timedelta):
        return value / timedelta(milliseconds=1)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ImproperlyConfigured(
            f"{name} must be a timedelta or a number of seconds, got {value!r}."
        )
    if not math.isfinite(value):
        raise ImproperlyConfigured(f"{name} must be finite, got {value!r}.")
    return value * 1000


def flag(name: str, value: Any) -> bool:
    """True or False, and nothing that merely looks like one (0, "no", None)."""
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"{name} must be True or False, got {value!r}.")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """A whole number of at least 1."""
    if not _is_int(value) or value < 1:
        raise ImproperlyConfigured(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def masked(value: Any) -> str:
    """``repr(value)`` with the password of any URL in it replaced: for error messages."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(masked(v) for v in value) + "]"
    if not isinstance(value, str):
        return repr(value)
    try:
        parts = urllib.parse.urlsplit(value)
        password = parts.password
    except ValueError:
        return "<a URL that cannot be parsed>"
    if password is None:
        return repr(value)
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return repr(urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}")))


def wrapping(parse: Callable[[Any], Any], *errors: type[Exception]) -> Parser:
    """A parser from a function of the value alone that raises ``errors``
    (``ValueError``...): its message is prefixed with the setting's name."""

    def parser(name: str, value: Any) -> Any:
        try:
            return parse(value)
        except errors as exc:
            raise ImproperlyConfigured(f"{name}: {exc}") from exc

    return parser


# --------------------------------------------------------------------------- the broker


#: A defer() that may take longer than this is a hung web request, not a timeout.
MAX_PUBLISH_TIMEOUT_S = 300.0


def broker_urls(name: str, value: Any) -> tuple[str, ...]:
    """One amqp(s):// URL, or a non-empty list of them (one per node, same vhost)."""
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list | tuple) or not urls:
        raise ImproperlyConfigured(
            f"{name} must be an amqp:// or amqps:// URL, or a non-empty list "
            f"of them (one per cluster node); got {masked(value)}."
        )
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
            raise ImproperlyConfigured(
                f"{name} must hold amqp:// or amqps:// URLs, got {masked(url)}."
            )
    if len(set(urls)) != len(urls):
        raise ImproperlyConfigured(f"{name} lists a URL twice: {masked(list(urls))}.")
    vhosts = {urllib.parse.unquote(urllib.parse.urlsplit(url).path[1:]) or "/" for url in urls}
    if len(vhosts) > 1:
        raise ImproperlyConfigured(
            f"{name}: every URL must name the same virtual host (they are "
            f"nodes of one cluster); got {masked(list(urls))}."
        )
    return tuple(urls)


def tls_path(name: str, value: Any) -> str | None:
    """A file that exists (``TLS_*_FILE``), or None."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ImproperlyConfigured(f"{name} must be a path or None; got {value!r}.")
    if not os.path.isfile(value):
        raise ImproperlyConfigured(f"{name}: no such file: {value}.")
    return os.fspath(value)


def host_name(name: str, value: Any) -> str | None:
    """A host name (``TLS_SERVER_NAME``), or None."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ImproperlyConfigured(f"{name} must be a host name or None; got {value!r}.")
    return value


#: The management plugin's default ports, plain and TLS.
MANAGEMENT_PORT = 15672
MANAGEMENT_TLS_PORT = 15671


def management_urls(name: str, value: Any) -> tuple[str, ...] | None:
    """http(s):// URLs to try in order, () for False (never ask), or None: the
    broker's hosts, which :func:`management_urls_of` derives once they are known."""
    if value is False:
        return ()
    if value is None:
        return None
    urls = [value] if isinstance(value, str) else value
    if (
        not isinstance(urls, list | tuple)
        or not urls
        or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls)
    ):
        raise ImproperlyConfigured(
            f"{name} must be an http:// or https:// URL or a list of them, "
            f"None (ask each broker host on port {MANAGEMENT_PORT}) or False (never ask); "
            f"got {masked(value)}."
        )
    return tuple(urls)


def management_urls_of(broker_urls: tuple[str, ...]) -> tuple[str, ...]:
    """Each broker host on the plugin's port: HTTPS on 15671 for an amqps:// broker,
    so that credentials never go out in clear text when the broker connection is
    encrypted."""
    derived = []
    for url in broker_urls:
        broker = urllib.parse.urlsplit(url)
        host = broker.hostname or "localhost"
        scheme, port = (
            ("https", MANAGEMENT_TLS_PORT)
            if broker.scheme == "amqps"
            else ("http", MANAGEMENT_PORT)
        )
        derived.append(f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}/")
    return tuple(dict.fromkeys(derived))


# --------------------------------------------------------------------------- publishing


def publish_timeout_s(name: str, value: Any) -> float:
    seconds = duration_ms(name, value) / 1000
    if not 0 < seconds <= MAX_PUBLISH_TIMEOUT_S:
        raise ImproperlyConfigured(
            f"{name} must be more than 0 and at most {MAX_PUBLISH_TIMEOUT_S:g} s; got {value!r}."
        )
    return seconds


#: The bounds of MAX_MESSAGE_BYTES: a job with a few arguments needs well
#: under 1 KiB; RabbitMQ's own limit (max_message_size) is 128 MiB by default
#: on 3.x, 16 MiB on 4.x.
MIN_MESSAGE_BYTES = 1024
MAX_MESSAGE_BYTES = 128 * 1024 * 1024


def max_message_bytes(name: str, value: Any) -> int:
    if not _is_int(value) or not MIN_MESSAGE_BYTES <= value <= MAX_MESSAGE_BYTES:
        raise ImproperlyConfigured(
            f"{name} must be a whole number of bytes from "
            f"{MIN_MESSAGE_BYTES} to {MAX_MESSAGE_BYTES} (RabbitMQ 3.x's default limit; "
            "4.x refuses more than 16 MiB by default); "
            f"got {value!r}."
        )
    return int(value)


# --------------------------------------------------------------------------- topology


MAX_RADIX = 64


def prefix(name: str, value: Any) -> str:
    if not isinstance(value, str) or not _PREFIX_RE.match(value) or len(value) > 100:
        raise ImproperlyConfigured(
            f"{name} must be 1-100 characters of letters, digits, '_', '.', ':' "
            f"or '-', starting with a letter or digit; got {value!r}."
        )
    return value


def queues(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ImproperlyConfigured(
            f"{name} must be a non-empty list of queue names, got {value!r}."
        )
    for queue in value:
        try:
            validate_queue_name(queue)
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {exc}") from exc
    if len(set(value)) != len(value):
        raise ImproperlyConfigured(f"{name} has duplicates: {value!r}.")
    return tuple(value)


def queue_type(name: str, value: Any) -> str:
    if value not in QUEUE_TYPES:
        raise ImproperlyConfigured(
            f"{name} must be one of {', '.join(QUEUE_TYPES)}; got {value!r}."
        )
    return str(value)


def delay_queue_type(name: str, value: Any) -> str | None:
    """One of the queue types, or None: QUEUE_TYPE's (resolved beside it). An empty
    value (``""`` from an unset environment variable) means None too."""
    if not value:
        return None
    if value not in QUEUE_TYPES:
        raise ImproperlyConfigured(
            f"{name} must be None (QUEUE_TYPE's) or one of {', '.join(QUEUE_TYPES)}; got {value!r}."
        )
    return str(value)


def max_delay_ms(name: str, value: Any) -> int:
    """At most ten years; at least the resolution is checked beside RESOLUTION."""
    delay = duration_ms(name, value)
    if delay > MAX_TTL_MS:
        raise ImproperlyConfigured(
            f"{name} must be at most 10 years (3650 days), the longest TTL "
            f"RabbitMQ accepts on a queue; got {value!r}."
        )
    return int(delay)


def radix(name: str, value: Any) -> int:
    if not _is_int(value) or not 2 <= value <= MAX_RADIX:
        raise ImproperlyConfigured(
            f"{name} must be an integer from 2 to {MAX_RADIX}, got {value!r}."
        )
    return int(value)


def resolution_ms(name: str, value: Any) -> int:
    resolution = duration_ms(name, value)
    if resolution < 1 or resolution != int(resolution):
        raise ImproperlyConfigured(
            f"{name} must be a whole number of milliseconds, at least 1 ms "
            f"(RabbitMQ TTLs are whole milliseconds); got {value!r}."
        )
    return int(resolution)


# --------------------------------------------------------------------------- the worker


def time_limit_s(name: str, value: Any) -> float | None:
    """A duration in seconds, or None: no limit."""
    try:
        return parse_time_limit(value, name)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(str(exc)) from None


def time_limit_grace_s(name: str, value: Any) -> float:
    grace = time_limit_s(name, value)
    if grace is None:
        raise ImproperlyConfigured(
            f"{name} must be a positive duration (seconds or a timedelta), not None."
        )
    return grace


#: RabbitMQ's consumer timeout is a 32-bit count of milliseconds (about 24 days).
MAX_CONSUMER_TIMEOUT_MS = 2**31 - 1


def consumer_timeout_ms(name: str, value: Any) -> int | None:
    """Whole milliseconds, or None: the broker's (quorum queues only: checked beside
    QUEUE_TYPE)."""
    if value is None:
        return None
    timeout_ms = duration_ms(name, value)
    if not 1000 <= timeout_ms <= MAX_CONSUMER_TIMEOUT_MS:
        raise ImproperlyConfigured(
            f"{name} must be from 1 second to 24 days (RabbitMQ's limit), or None; got {value!r}."
        )
    return math.ceil(timeout_ms)


#: The longest worker heartbeat: past it, a paused worker keeps its jobs for half an hour.
MAX_WORKER_HEARTBEAT_S = 600


def worker_heartbeat_s(name: str, value: Any) -> int:
    """Whole seconds (AMQP counts heartbeats in seconds)."""
    seconds = duration_ms(name, value) / 1000
    if not 1 <= seconds <= MAX_WORKER_HEARTBEAT_S or seconds != int(seconds):
        raise ImproperlyConfigured(
            f"{name} must be a whole number of seconds from 1 to "
            f"{MAX_WORKER_HEARTBEAT_S}, got {value!r}."
        )
    return int(seconds)


#: The longest HOLD_WINDOW: a worker holds its jobs in memory, unacked.
MAX_HOLD_WINDOW_MS = 3600 * 1000
#: AMQP's prefetch count is a 16-bit number.
MAX_HOLD_PREFETCH = 65535


def hold_window_ms(name: str, value: Any) -> int:
    raw = duration_ms(name, value)
    window_ms = round(raw)  # 0.3 s is 300.00000000000006 ms in floats
    if not 0 <= raw <= MAX_HOLD_WINDOW_MS or abs(raw - window_ms) > 1e-6:
        raise ImproperlyConfigured(
            f"{name} must be a whole number of milliseconds from 0 (no "
            f"holding) to 1 hour; got {value!r}."
        )
    return window_ms


def hold_prefetch(name: str, value: Any) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_HOLD_PREFETCH:
        raise ImproperlyConfigured(
            f"{name} must be an integer from 1 to {MAX_HOLD_PREFETCH} "
            f"(AMQP's largest prefetch); got {value!r}."
        )
    return int(value)


# --------------------------------------------------------------------------- retries, schedules


max_retries: Parser = wrapping(validate_max_retries, ValueError)


retry_backoff: Parser = wrapping(parse_backoff, TypeError, ValueError)


def schedules(name: str, value: Any) -> tuple[tuple[str, Schedule], ...]:
    """Task name -> every(...) or cron(...), as sorted pairs (hashable, like the rest)."""
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            f"{name} must be a dict of task name -> every(...) or cron(...), got {value!r}."
        )
    for task, schedule in value.items():
        if not isinstance(task, str) or not task:
            raise ImproperlyConfigured(f"{name}: the keys are task names, got {task!r}.")
        if not isinstance(schedule, Schedule):
            raise ImproperlyConfigured(
                f"{name}[{task!r}] must be every(...) or cron(...), got {schedule!r}."
            )
    return tuple(sorted(value.items()))


def cancel_margin_ms(name: str, value: Any) -> int:
    margin_ms = duration_ms(name, value)
    if not 1000 <= margin_ms <= MAX_TTL_MS:
        raise ImproperlyConfigured(f"{name} must be from 1 second to 10 years, got {value!r}.")
    return math.ceil(margin_ms)


# --------------------------------------------------------------------------- results


#: RESULT_MAX_BYTES' ceiling: a result is one record among many in a stream message.
MAX_RESULT_BYTES = 1024 * 1024


def result_ttl_ms(name: str, value: Any) -> int:
    ttl_ms = duration_ms(name, value)
    if not 60_000 <= ttl_ms <= MAX_TTL_MS:
        raise ImproperlyConfigured(f"{name} must be from 1 minute to 10 years, got {value!r}.")
    return math.ceil(ttl_ms)


def result_max_bytes(name: str, value: Any) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_RESULT_BYTES:
        raise ImproperlyConfigured(
            f"{name} must be a whole number of bytes from 0 to {MAX_RESULT_BYTES}, got {value!r}."
        )
    return int(value)


def cache_alias(name: str, value: Any) -> str | None:
    """An alias of ``CACHES``, or None."""
    if value is None:
        return None
    caches = django_settings.CACHES
    if not isinstance(value, str) or value not in caches:
        raise ImproperlyConfigured(
            f"{name} must be None or an alias of CACHES "
            f"({', '.join(map(repr, caches)) or 'none configured'}), got {value!r}."
        )
    return value


def result_cache_timeout_s(name: str, value: Any) -> float:
    """Seconds, at least one (at most RESULT_TTL: applied beside it)."""
    timeout_ms = duration_ms(name, value)
    if timeout_ms < 1000:
        raise ImproperlyConfigured(f"{name} must be 1 second or more, got {value!r}.")
    return timeout_ms / 1000


# --------------------------------------------------------------------------- clusters


def stuck_after_s(name: str, value: Any) -> float:
    seconds = duration_ms(name, value) / 1000
    if seconds < 1:
        raise ImproperlyConfigured(f"{name} must be at least 1 second, got {value!r}.")
    return seconds


# --------------------------------------------------------------------------- security


def signing_key(name: str, value: Any) -> str | bytes | None:
    if value is None:
        return None
    return key(name, value)


def key(name: str, value: Any) -> str | bytes:
    """A non-empty string or bytes (never shown, not even its type's value)."""
    if not isinstance(value, str | bytes) or not value:
        raise ImproperlyConfigured(
            f"{name} must be a non-empty string (or bytes); got a {type(value).__name__}."
        )
    return value


def keys(name: str, value: Any) -> tuple[str | bytes, ...] | None:
    """A list of keys, or None."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise ImproperlyConfigured(f"{name} must be a list of keys.")
    return tuple(key(f"{name}[{n}]", v) for n, v in enumerate(value))


#: A shorter bearer token can be guessed: the metrics URL refuses to start with one.
MIN_METRICS_TOKEN = 16


def metrics_token(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) < MIN_METRICS_TOKEN or value != value.strip():
        raise ImproperlyConfigured(
            f"{name} must be a string of at least {MIN_METRICS_TOKEN} "
            "characters with no surrounding spaces (e.g. secrets.token_urlsafe(32)), or None."
        )
    return value


def networks(
    name: str, value: Any
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
    """Addresses or networks ("10.0.0.0/8", "::1"), or None."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ImproperlyConfigured(
            f"{name} must be a non-empty list of addresses or networks, "
            f'e.g. ["127.0.0.1", "10.0.0.0/8"], or None; got {value!r}.'
        )
    found = []
    for entry in value:
        try:
            found.append(ipaddress.ip_network(entry, strict=False))
        except (TypeError, ValueError):
            raise ImproperlyConfigured(
                f"{name}: {entry!r} is not an IP address or network."
            ) from None
    return tuple(found)
