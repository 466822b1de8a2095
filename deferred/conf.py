"""The ``DEFERRED`` setting, read once into a frozen, validated object.

Every other module asks :func:`get_settings` instead of reading
``django.conf.settings`` itself, so the rules for what a valid value is live in
one place, bad values surface as ``ImproperlyConfigured`` (and in
``manage.py check``), and tests that use ``override_settings`` see the new value
because the cache is dropped on Django's ``setting_changed`` signal.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.template.defaultfilters import pluralize

from deferred.limits import parse_time_limit
from deferred.retries import Backoff, parse_backoff, validate_max_retries
from deferred.schedule import Schedule
from deferred.topology import (
    CANCEL_MARGIN_MS,
    MAX_TTL_MS,
    RESULT_TTL_MS,
    TopologyError,
    plan_topology,
)

DEFAULTS: dict[str, Any] = {
    # An AMQP URL in pika's syntax (?heartbeat=30 etc.), or a list of them,
    # one per node of a cluster, tried in order.
    "BROKER_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
    # The one deadline of each defer() / defer_many(): connecting, failing
    # over to another node, waiting out a blocked connection (memory or disk
    # alarm) and the broker's confirm (timedelta or seconds; at most 300 s).
    # Well under a web server's request timeout, so a broker in trouble costs
    # a request an error, not a hung worker process.
    "PUBLISH_TIMEOUT": timedelta(seconds=10),
    # Quorum queues only: how many nodes keep a copy of each queue. RabbitMQ
    # caps it at the cluster's size, so 3 means "every node, up to three".
    "QUORUM_GROUP_SIZE": 3,
    # The start of every exchange and queue name, so several projects can
    # share a vhost.
    "PREFIX": "deferred",
    # The longest delay defer() accepts (timedelta or seconds). At most ten
    # years, the largest TTL RabbitMQ accepts on a queue, so no queue of the
    # topology ever needs a TTL the broker would refuse.
    "MAX_DELAY": timedelta(milliseconds=MAX_TTL_MS),
    # The base of the delay decomposition (2-64): more queues, fewer hops as
    # it grows. Chosen from the benchmarks (docs/bench/): sixteen digit values
    # per level need half the hops of radix 2, and hops are the broker's main cost.
    "RADIX": 16,
    # Delays are rounded up to a multiple of this (timedelta or seconds; whole
    # milliseconds). Coarser means fewer hops and burstier arrivals.
    "RESOLUTION": timedelta(milliseconds=1),
    # The last mile (timedelta or seconds; 0: none): a job due within this
    # window skips the lowest levels of the topology, and the worker that
    # takes it holds it unacked until its due time. The levels it covers
    # whole (RADIX**k units) are left out of the topology: fewer hops, less
    # broker CPU per job, and lateness set by the worker's timer rather than
    # by broker hops. At most one hour.
    "HOLD_WINDOW": timedelta(milliseconds=256),
    # The most jobs a worker holds at once (its hold queues' prefetch, beside
    # its concurrency), 1-65535. A held job that comes due while every
    # thread is busy goes back for another worker at once.
    "HOLD_PREFETCH": 1000,
    # How long one attempt of a task may run (timedelta or seconds; None: no
    # limit), unless the task sets @task(time_limit=...). When it passes,
    # deferred.TimeLimitExceeded is raised inside the task. Ten minutes stops
    # a hung job long before the broker's consumer timeout (30 minutes by
    # default) would take it back and start it a second time.
    "TIME_LIMIT": timedelta(minutes=10),
    # How long a task may go on after TimeLimitExceeded (to clean up, or
    # because it is blocked in C code) before the worker records the attempt
    # as timed_out, acks it and ends its process for a fresh one.
    "TIME_LIMIT_GRACE": timedelta(seconds=30),
    # Among due jobs, higher @task(priority=...) runs first. Classic ready and
    # hold queues then take x-max-priority, a topology of its own (declared
    # beside the old one, which drains: see the live-changes guide); quorum
    # queues need nothing (RabbitMQ 4.0+; 3.x quorum queues have no
    # priorities). False: plain FIFO queues, and priorities only order the
    # jobs waiting in a worker for a thread.
    "PRIORITIES": True,
    # The ready, hold and failed queues' type, "classic" or "quorum". Quorum
    # queues are replicated on a cluster; classic ones keep ten priority
    # levels on RabbitMQ 3.x and cost the broker less per job.
    "QUEUE_TYPE": "classic",
    # The delay queues' type, "classic" or "quorum" (only with QUEUE_TYPE
    # "quorum" too, or with classic ready queues). Classic queues dead-letter
    # without confirms: a broker restart under load can lose a job moving
    # between two delay queues at that moment. Quorum queues dead-letter with
    # confirms, and on RabbitMQ 4.x lost none in the restart tests; on 3.10
    # they stranded dead-letters after a restart (a RabbitMQ bug). See the
    # guarantees page before choosing.
    "DELAY_QUEUE_TYPE": None,
    # The target queues' names; the first is the default. Letters, digits,
    # "_" and "-" (no dots).
    "QUEUES": ["default"],
    # Retries after the first attempt, for tasks that do not set max_retries.
    # Retries are opt-in: a task that raises goes to the failed queue unless
    # it (or this default) allows retries.
    "MAX_RETRIES": 0,
    # The default waits between attempts: a list of seconds (the last one
    # repeats) or an exponential dict {"base", "factor", "cap", "jitter"}.
    "RETRY_BACKOFF": {"base": 10.0, "factor": 2.0, "cap": 3600.0, "jitter": 0.1},
    # defer() inside transaction.atomic() publishes after the commit.
    "ON_COMMIT": True,
    # Deliveries of one job without an ack before it counts as a poison job
    # that kills workers, and goes to the failed queue.
    "DELIVERY_LIMIT": 5,
    # Quorum queues only (RabbitMQ 3.12+): how long a worker may hold a job,
    # running it, before its ready queue takes it back and hands it to
    # another worker, which runs it a second time (timedelta or seconds;
    # None: the broker's consumer_timeout, 30 minutes unless configured).
    # Set it above your longest job. Classic queues follow the broker-wide
    # consumer_timeout in rabbitmq.conf (on 4.3 they have none).
    "CONSUMER_TIMEOUT": None,
    # The worker connection's heartbeat (timedelta or seconds, 1 s to 10
    # minutes). RabbitMQ closes the connection of a worker it has not heard
    # from for about three of them (a paused process, a lost host), and hands
    # the jobs it held to the other workers: the lower, the sooner, at the
    # price of a frame every half heartbeat. A task holding the GIL longer
    # than that (C code) costs its worker the connection.
    "WORKER_HEARTBEAT": timedelta(seconds=5),
    # False: never declare anything; the broker's exchanges and queues are
    # created by infrastructure code (definitions, Terraform), and the app
    # only checks that they exist.
    "DECLARE": True,
    # Where to ask RabbitMQ's management API for what AMQP cannot tell
    # (unacked counts, nodes, queue leaders, stuck dead-letters): None tries
    # each broker host on the plugin's port (15672, or HTTPS on 15671 for an
    # amqps:// broker: credentials never go out in clear text when the broker
    # connection is encrypted), False never asks, or an http(s):// URL or a
    # list of them, tried in order.
    "MANAGEMENT_URL": None,
    # Quorum delay queues whose dead-lettered messages have not moved for this
    # long are reported as stuck, a known RabbitMQ bug after a leader change
    # (timedelta or seconds, at least 1 s).
    "STUCK_AFTER": timedelta(seconds=30),
    # Whether the worker repairs stuck queues itself (forcing a leader
    # election through the management API), when its broker user may.
    "REPAIR_STUCK": True,
    # Recurring jobs for tasks the decorator cannot reach (other apps' tasks),
    # by task name: {"app.tasks.cleanup": every(hours=1)}. Overrides @task(schedule=...).
    "SCHEDULES": {},
    # How long a cancel stays in force after its job was due: a job that
    # comes due while no worker runs is still cancelled if a worker takes it
    # within this margin (timedelta or seconds, 1 s to 10 years). Workers
    # keep each cancel in memory until then.
    "CANCEL_MARGIN": timedelta(milliseconds=CANCEL_MARGIN_MS),
    # Every message carries an HMAC of its body; the worker runs only jobs
    # signed with one of the keys (see deferred/signing.py). False: messages
    # are still signed when a key exists, but not checked (a mixed fleet
    # during an upgrade).
    "SIGNING": True,
    # The key jobs are signed with; None: SECRET_KEY. Set it for fleets whose
    # web and worker processes must not share SECRET_KEY.
    "SIGNING_KEY": None,
    # Older keys still accepted when verifying, with SIGNING_KEY (without it,
    # SECRET_KEY_FALLBACKS are).
    "SIGNING_KEY_FALLBACKS": None,
    # The largest job body (1 KiB to 128 MiB): defer() raises ValueError above
    # it, and the worker sends a larger message to the failed queue unread. A
    # body sits in the broker's memory or disk for its whole delay: pass ids.
    # Keep it at or under the broker's max_message_size (RabbitMQ 4.x: 16 MiB
    # by default, 3.x: 128 MiB); a larger job is MessageTooLarge at defer().
    "MAX_MESSAGE_BYTES": 256 * 1024,
    # amqps:// only: the CA file to verify the broker with (None: the
    # system's CAs).
    "TLS_CA_FILE": None,
    # amqps:// only: a client certificate, for brokers that require one
    # (mutual TLS), with TLS_KEY_FILE.
    "TLS_CERT_FILE": None,
    # amqps:// only: the key of TLS_CERT_FILE.
    "TLS_KEY_FILE": None,
    # amqps:// only: the name the broker's certificate must carry (None: the
    # URL's host).
    "TLS_SERVER_NAME": None,
    # The bearer token the metrics/ URL (Prometheus' text format of
    # deferred_status) asks for, at least 16 characters. With neither this
    # nor METRICS_ALLOW, the URL answers 404.
    "METRICS_TOKEN": None,
    # Addresses or networks (["10.0.0.0/8", "::1"]) the metrics/ URL answers,
    # checked against REMOTE_ADDR; with METRICS_TOKEN too, both must pass.
    "METRICS_ALLOW": None,
    # Results (deferred.results): workers write each job's start and outcome to
    # the PREFIX.results stream, which deferred.result(id) and the django.tasks
    # backend's get_result() read. False: nothing is written, at no cost.
    "RESULTS": True,
    # The ledger (deferred.ledger): the broker copies every job published into
    # the PREFIX.ledger stream, and after a broker restart one worker (the
    # keeper) publishes again the jobs that were moving between two delay
    # queues when it went down. False: no ledger, and such a job can be lost.
    "LEDGER": True,
    # How long the results stream keeps them (timedelta or seconds, 1 minute
    # to 10 years): RabbitMQ drops older ones by whole segments. Declared with
    # the stream: a change needs the stream re-made (see the results guide).
    "RESULT_TTL": timedelta(milliseconds=RESULT_TTL_MS),
    # The largest return value kept, as JSON (0 to 1 MiB); a larger one, or
    # one JSON cannot carry, is left out of the result (value_kept is False).
    "RESULT_MAX_BYTES": 64 * 1024,
    # A cache alias from CACHES that every worker and web process shares
    # (Redis, Memcached, the database): workers put a finished job's result
    # there once the stream has it, and result() looks there first. Never the
    # only copy; None: look-ups read the stream.
    "RESULT_CACHE": None,
    # How long a result stays in RESULT_CACHE (timedelta or seconds, 1 second
    # or more; RESULT_TTL if that is shorter); after that, look-ups of it read
    # the stream.
    "RESULT_CACHE_TIMEOUT": timedelta(hours=1),
}

#: The management plugin's default ports, plain and TLS.
MANAGEMENT_PORT = 15672
MANAGEMENT_TLS_PORT = 15671

QUEUE_TYPES = ("classic", "quorum")
#: A defer() that may take longer than this is a hung web request, not a timeout.
MAX_PUBLISH_TIMEOUT_S = 300.0
MAX_RADIX = 64
#: The bounds of MAX_MESSAGE_BYTES: a job with a few arguments needs well
#: under 1 KiB; RabbitMQ's own limit (max_message_size) is 128 MiB by default
#: on 3.x, 16 MiB on 4.x.
MIN_MESSAGE_BYTES = 1024
MAX_MESSAGE_BYTES = 128 * 1024 * 1024

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


@dataclass(frozen=True)
class TLSOptions:
    """Where the CA, the client certificate and its key are, and the name to expect."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None


@dataclass(frozen=True)
class DeferredSettings:
    """The validated ``DEFERRED`` setting; durations are whole milliseconds."""

    #: One URL per node, in the order they are tried. Never shown: they hold passwords.
    broker_urls: tuple[str, ...] = field(repr=False)
    publish_timeout_s: float
    prefix: str
    max_delay_ms: int
    radix: int
    resolution_ms: int
    queue_type: str
    #: The delay queues' type (``DELAY_QUEUE_TYPE``).
    delay_queue_type: str
    queues: tuple[str, ...]
    max_retries: int
    retry_backoff: Backoff
    on_commit: bool
    delivery_limit: int
    #: Whether the app may create the topology; if not, it only checks it.
    declare: bool
    #: The management API's base URLs, tried in order; empty when it is not to be asked.
    management_urls: tuple[str, ...] = field(repr=False)
    quorum_group_size: int
    stuck_after_s: float
    repair_stuck: bool
    #: DEFERRED['SCHEDULES'] as (task name, schedule) pairs (hashable, like the rest).
    schedules: tuple[tuple[str, Schedule], ...] = ()
    #: How long a cancel is kept after its job was due (``CANCEL_MARGIN``).
    cancel_margin_ms: int = CANCEL_MARGIN_MS
    #: Whether the worker runs only jobs signed with one of ``signing_keys``.
    signing: bool = True
    #: The key messages are signed with, then the fallbacks accepted when
    #: verifying; empty only with signing off and no key. Never shown.
    signing_keys: tuple[str | bytes, ...] = field(default=(), repr=False)
    max_message_bytes: int = 256 * 1024
    #: The quorum ready queues' ``x-consumer-timeout`` (None: the broker's).
    consumer_timeout_ms: int | None = None
    #: The worker connection's heartbeat, in whole seconds (``WORKER_HEARTBEAT``).
    worker_heartbeat_s: int = 5
    #: TLS options for amqps:// URLs (None: pika's and the system's defaults).
    tls: TLSOptions | None = None
    #: The bearer token the metrics URL asks for (None: no token). Never shown.
    metrics_token: str | None = field(default=None, repr=False)
    #: The networks the metrics URL answers (None: any, if a token is set).
    metrics_allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None = None
    #: The last mile: jobs due within this are held by the worker (0: none).
    hold_window_ms: int = 256
    #: The most jobs a worker holds at once, beside its concurrency.
    hold_prefetch: int = 1000
    #: Whether classic ready queues order due jobs by priority (``x-max-priority``).
    priorities: bool = True
    #: How long an attempt may run, in seconds (None: no limit); tasks may set their own.
    time_limit_s: float | None = 600.0
    #: How long after the soft limit the worker gives up on an attempt, in seconds.
    time_limit_grace_s: float = 30.0
    #: Whether workers write results (``RESULTS``).
    results: bool = True
    #: Whether every job is copied into the ledger stream, and restarts repaired (``LEDGER``).
    ledger: bool = True
    #: How long the results stream keeps them (``RESULT_TTL``).
    result_ttl_ms: int = RESULT_TTL_MS
    #: The largest return value kept, in bytes of JSON (``RESULT_MAX_BYTES``).
    result_max_bytes: int = 64 * 1024
    #: The cache alias finished results are also put in (``RESULT_CACHE``; None: none).
    result_cache: str | None = None
    #: How long they stay there, in seconds (``RESULT_CACHE_TIMEOUT``).
    result_cache_timeout_s: float = 3600.0

    @property
    def broker_url(self) -> str:
        """The first node's URL (the only one with a single ``BROKER_URL``)."""
        return self.broker_urls[0]

    @property
    def default_queue(self) -> str:
        """The queue a task goes to when neither it nor the call names one."""
        return self.queues[0]


#: RabbitMQ's consumer timeout is a 32-bit count of milliseconds (about 24 days).
MAX_CONSUMER_TIMEOUT_MS = 2**31 - 1


def _consumer_timeout_ms(value: Any, queue_type: str) -> int | None:
    if value is None:
        return None
    if queue_type != "quorum":
        raise ImproperlyConfigured(
            "DEFERRED['CONSUMER_TIMEOUT'] applies to quorum queues only. With classic queues, "
            "set consumer_timeout in rabbitmq.conf (RabbitMQ 3.x to 4.2; on 4.3 classic "
            "queues have no consumer timeout), or leave CONSUMER_TIMEOUT at None."
        )
    timeout_ms = _duration_ms("CONSUMER_TIMEOUT", value)
    if not 1000 <= timeout_ms <= MAX_CONSUMER_TIMEOUT_MS:
        raise ImproperlyConfigured(
            "DEFERRED['CONSUMER_TIMEOUT'] must be from 1 second to 24 days (RabbitMQ's "
            f"limit), or None; got {value!r}."
        )
    return math.ceil(timeout_ms)


def _time_limits(limit: Any, grace: Any) -> tuple[float | None, float]:
    """``TIME_LIMIT`` and ``TIME_LIMIT_GRACE`` in seconds, checked."""
    try:
        limit_s = parse_time_limit(limit, "DEFERRED['TIME_LIMIT']")
        grace_s = parse_time_limit(grace, "DEFERRED['TIME_LIMIT_GRACE']")
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(str(exc)) from None
    if grace_s is None:
        raise ImproperlyConfigured(
            "DEFERRED['TIME_LIMIT_GRACE'] must be a positive duration (seconds or a "
            "timedelta), not None."
        )
    return limit_s, grace_s


#: The longest HOLD_WINDOW: a worker holds its jobs in memory, unacked.
MAX_HOLD_WINDOW_MS = 3600 * 1000
#: AMQP's prefetch count is a 16-bit number.
MAX_HOLD_PREFETCH = 65535


def _hold(window: Any, prefetch: Any) -> tuple[int, int]:
    """``HOLD_WINDOW`` in whole milliseconds and ``HOLD_PREFETCH``, checked."""
    raw = _duration_ms("HOLD_WINDOW", window)
    window_ms = round(raw)  # 0.3 s is 300.00000000000006 ms in floats
    if not 0 <= raw <= MAX_HOLD_WINDOW_MS or abs(raw - window_ms) > 1e-6:
        raise ImproperlyConfigured(
            "DEFERRED['HOLD_WINDOW'] must be a whole number of milliseconds from 0 (no "
            f"holding) to 1 hour; got {window!r}."
        )
    if (
        isinstance(prefetch, bool)
        or not isinstance(prefetch, int)
        or not 1 <= prefetch <= MAX_HOLD_PREFETCH
    ):
        raise ImproperlyConfigured(
            f"DEFERRED['HOLD_PREFETCH'] must be an integer from 1 to {MAX_HOLD_PREFETCH} "
            f"(AMQP's largest prefetch); got {prefetch!r}."
        )
    return window_ms, prefetch


#: A shorter bearer token can be guessed: the metrics URL refuses to start with one.
MIN_METRICS_TOKEN = 16


def _metrics_token(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) < MIN_METRICS_TOKEN or value != value.strip():
        raise ImproperlyConfigured(
            f"DEFERRED['METRICS_TOKEN'] must be a string of at least {MIN_METRICS_TOKEN} "
            "characters with no surrounding spaces (e.g. secrets.token_urlsafe(32)), or None."
        )
    return value


def _metrics_allow(
    value: Any,
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
    """``METRICS_ALLOW``: addresses or networks ("10.0.0.0/8", "::1") the metrics URL answers."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ImproperlyConfigured(
            "DEFERRED['METRICS_ALLOW'] must be a non-empty list of addresses or networks, "
            f'e.g. ["127.0.0.1", "10.0.0.0/8"], or None; got {value!r}.'
        )
    networks = []
    for entry in value:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except (TypeError, ValueError):
            raise ImproperlyConfigured(
                f"DEFERRED['METRICS_ALLOW']: {entry!r} is not an IP address or network."
            ) from None
    return tuple(networks)


#: RESULT_MAX_BYTES' ceiling: a result is one record among many in a stream message.
MAX_RESULT_BYTES = 1024 * 1024


def _flag(name: str, value: Any) -> bool:
    """A True/False setting, checked."""
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"DEFERRED[{name!r}] must be True or False, got {value!r}.")
    return value


def _results(enabled: Any, ttl: Any, max_bytes: Any) -> tuple[bool, int, int]:
    """RESULTS, RESULT_TTL (milliseconds) and RESULT_MAX_BYTES, checked."""
    if not isinstance(enabled, bool):
        raise ImproperlyConfigured(f"DEFERRED['RESULTS'] must be True or False, got {enabled!r}.")
    ttl_ms = _duration_ms("RESULT_TTL", ttl)
    if not 60_000 <= ttl_ms <= MAX_TTL_MS:
        raise ImproperlyConfigured(
            f"DEFERRED['RESULT_TTL'] must be from 1 minute to 10 years, got {ttl!r}."
        )
    if (
        isinstance(max_bytes, bool)
        or not isinstance(max_bytes, int)
        or not 0 <= max_bytes <= MAX_RESULT_BYTES
    ):
        raise ImproperlyConfigured(
            "DEFERRED['RESULT_MAX_BYTES'] must be a whole number of bytes from 0 to "
            f"{MAX_RESULT_BYTES}, got {max_bytes!r}."
        )
    return enabled, math.ceil(ttl_ms), max_bytes


def _result_cache(alias: Any, timeout: Any, result_ttl_ms: int) -> tuple[str | None, float]:
    """RESULT_CACHE (an alias of CACHES, or None) and RESULT_CACHE_TIMEOUT (seconds), checked."""
    timeout_ms = _duration_ms("RESULT_CACHE_TIMEOUT", timeout)
    if timeout_ms < 1000:
        raise ImproperlyConfigured(
            f"DEFERRED['RESULT_CACHE_TIMEOUT'] must be 1 second or more, got {timeout!r}."
        )
    # The cache only speeds up what the stream keeps: no entry outlives RESULT_TTL
    # (a project with a RESULT_TTL under the default hour keeps working as it was).
    timeout_ms = min(timeout_ms, result_ttl_ms)
    if alias is None:
        return None, timeout_ms / 1000
    caches = django_settings.CACHES
    if not isinstance(alias, str) or alias not in caches:
        raise ImproperlyConfigured(
            f"DEFERRED['RESULT_CACHE'] must be None or an alias of CACHES "
            f"({', '.join(map(repr, caches)) or 'none configured'}), got {alias!r}."
        )
    return alias, timeout_ms / 1000


#: The longest worker heartbeat: past it, a paused worker keeps its jobs for half an hour.
MAX_WORKER_HEARTBEAT_S = 600


def _worker_heartbeat_s(value: Any) -> int:
    """``WORKER_HEARTBEAT`` in whole seconds (AMQP counts heartbeats in seconds), checked."""
    seconds = _duration_ms("WORKER_HEARTBEAT", value) / 1000
    if not 1 <= seconds <= MAX_WORKER_HEARTBEAT_S or seconds != int(seconds):
        raise ImproperlyConfigured(
            "DEFERRED['WORKER_HEARTBEAT'] must be a whole number of seconds from 1 to "
            f"{MAX_WORKER_HEARTBEAT_S}, got {value!r}."
        )
    return int(seconds)


def _duration_ms(name: str, value: Any) -> float:
    """Turn a ``timedelta`` or a number of seconds into milliseconds."""
    if isinstance(value, timedelta):
        return value / timedelta(milliseconds=1)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ImproperlyConfigured(
            f"DEFERRED[{name!r}] must be a timedelta or a number of seconds, got {value!r}."
        )
    if not math.isfinite(value):
        raise ImproperlyConfigured(f"DEFERRED[{name!r}] must be finite, got {value!r}.")
    return value * 1000


def _broker_urls(value: Any) -> tuple[str, ...]:
    """``BROKER_URL`` as a tuple: one URL, or a non-empty list of them (one per node)."""
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list | tuple) or not urls:
        raise ImproperlyConfigured(
            "DEFERRED['BROKER_URL'] must be an amqp:// or amqps:// URL, or a non-empty list "
            f"of them (one per cluster node); got {_masked(value)}."
        )
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
            raise ImproperlyConfigured(
                f"DEFERRED['BROKER_URL'] must hold amqp:// or amqps:// URLs, got {_masked(url)}."
            )
    if len(set(urls)) != len(urls):
        raise ImproperlyConfigured(
            f"DEFERRED['BROKER_URL'] lists a URL twice: {_masked(list(urls))}."
        )
    vhosts = {urllib.parse.unquote(urllib.parse.urlsplit(url).path[1:]) or "/" for url in urls}
    if len(vhosts) > 1:
        raise ImproperlyConfigured(
            "DEFERRED['BROKER_URL']: every URL must name the same virtual host (they are "
            f"nodes of one cluster); got {_masked(list(urls))}."
        )
    return tuple(urls)


def _masked(value: Any) -> str:
    """``repr(value)`` with the password of any URL in it replaced: for error messages."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_masked(v) for v in value) + "]"
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


def _management_urls(value: Any, broker_urls: tuple[str, ...]) -> tuple[str, ...]:
    """``MANAGEMENT_URL`` as a tuple of base URLs to try in order (empty: never ask).

    ``None`` asks each broker node on the plugin's port (HTTPS on 15671 for an
    amqps:// broker: credentials never go out in clear text when the broker
    connection is encrypted).
    """
    if value is False:
        return ()
    if value is None:
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
    urls = [value] if isinstance(value, str) else value
    if (
        not isinstance(urls, list | tuple)
        or not urls
        or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls)
    ):
        raise ImproperlyConfigured(
            "DEFERRED['MANAGEMENT_URL'] must be an http:// or https:// URL or a list of them, "
            f"None (ask each broker host on port {MANAGEMENT_PORT}) or False (never ask); "
            f"got {_masked(value)}."
        )
    return tuple(urls)


def _build(raw: Any) -> DeferredSettings:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ImproperlyConfigured(f"DEFERRED must be a dict, got {type(raw).__name__}.")
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ImproperlyConfigured(
            f"Unknown key{pluralize(len(unknown))} in DEFERRED: {', '.join(unknown)}. "
            f"Known keys: {', '.join(sorted(DEFAULTS))}."
        )
    values = {**DEFAULTS, **raw}

    broker_urls = _broker_urls(values["BROKER_URL"])
    publish_timeout_s = _duration_ms("PUBLISH_TIMEOUT", values["PUBLISH_TIMEOUT"]) / 1000
    if not 0 < publish_timeout_s <= MAX_PUBLISH_TIMEOUT_S:
        raise ImproperlyConfigured(
            "DEFERRED['PUBLISH_TIMEOUT'] must be more than 0 and at most "
            f"{MAX_PUBLISH_TIMEOUT_S:g} s; got {values['PUBLISH_TIMEOUT']!r}."
        )

    prefix = values["PREFIX"]
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix) or len(prefix) > 100:
        raise ImproperlyConfigured(
            "DEFERRED['PREFIX'] must be 1-100 characters of letters, digits, '_', '.', ':' "
            f"or '-', starting with a letter or digit; got {prefix!r}."
        )

    radix = values["RADIX"]
    if isinstance(radix, bool) or not isinstance(radix, int) or not 2 <= radix <= MAX_RADIX:
        raise ImproperlyConfigured(
            f"DEFERRED['RADIX'] must be an integer from 2 to {MAX_RADIX}, got {radix!r}."
        )

    resolution = _duration_ms("RESOLUTION", values["RESOLUTION"])
    if resolution < 1 or resolution != int(resolution):
        raise ImproperlyConfigured(
            "DEFERRED['RESOLUTION'] must be a whole number of milliseconds, at least 1 ms "
            f"(RabbitMQ TTLs are whole milliseconds); got {values['RESOLUTION']!r}."
        )
    resolution_ms = int(resolution)

    max_delay = _duration_ms("MAX_DELAY", values["MAX_DELAY"])
    if max_delay < resolution_ms:
        raise ImproperlyConfigured(
            f"DEFERRED['MAX_DELAY'] must be at least the resolution ({resolution_ms} ms); "
            f"got {values['MAX_DELAY']!r}."
        )
    if max_delay > MAX_TTL_MS:
        raise ImproperlyConfigured(
            "DEFERRED['MAX_DELAY'] must be at most 10 years (3650 days), the longest TTL "
            f"RabbitMQ accepts on a queue; got {values['MAX_DELAY']!r}."
        )
    max_delay_ms = int(max_delay)

    queue_type = values["QUEUE_TYPE"]
    if queue_type not in QUEUE_TYPES:
        raise ImproperlyConfigured(
            f"DEFERRED['QUEUE_TYPE'] must be one of {', '.join(QUEUE_TYPES)}; got {queue_type!r}."
        )
    delay_queue_type = values["DELAY_QUEUE_TYPE"] or queue_type
    if delay_queue_type not in QUEUE_TYPES:
        raise ImproperlyConfigured(
            f"DEFERRED['DELAY_QUEUE_TYPE'] must be None (QUEUE_TYPE's) or one of "
            f"{', '.join(QUEUE_TYPES)}; got {delay_queue_type!r}."
        )
    if queue_type == "quorum" and delay_queue_type != "quorum":
        raise ImproperlyConfigured(
            "DEFERRED['DELAY_QUEUE_TYPE'] must be 'quorum' when QUEUE_TYPE is 'quorum': classic "
            "delay queues would lose jobs moving between them on a broker restart, and would "
            "live on one node of the cluster that quorum queues are for."
        )

    queues = values["QUEUES"]
    if isinstance(queues, str) or not isinstance(queues, list | tuple) or not queues:
        raise ImproperlyConfigured(
            f"DEFERRED['QUEUES'] must be a non-empty list of queue names, got {queues!r}."
        )
    for queue in queues:
        try:
            validate_queue_name(queue)
        except ValueError as exc:
            raise ImproperlyConfigured(f"DEFERRED['QUEUES']: {exc}") from exc
    if len(set(queues)) != len(queues):
        raise ImproperlyConfigured(f"DEFERRED['QUEUES'] has duplicates: {queues!r}.")

    try:
        max_retries = validate_max_retries(values["MAX_RETRIES"])
    except ValueError as exc:
        raise ImproperlyConfigured(f"DEFERRED['MAX_RETRIES']: {exc}") from exc
    try:
        retry_backoff = parse_backoff(values["RETRY_BACKOFF"])
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"DEFERRED['RETRY_BACKOFF']: {exc}") from exc
    on_commit = values["ON_COMMIT"]
    if not isinstance(on_commit, bool):
        raise ImproperlyConfigured(
            f"DEFERRED['ON_COMMIT'] must be True or False, got {on_commit!r}."
        )
    declare = values["DECLARE"]
    if not isinstance(declare, bool):
        raise ImproperlyConfigured(f"DEFERRED['DECLARE'] must be True or False, got {declare!r}.")
    delivery_limit = values["DELIVERY_LIMIT"]
    if (
        isinstance(delivery_limit, bool)
        or not isinstance(delivery_limit, int)
        or delivery_limit < 1
    ):
        raise ImproperlyConfigured(
            f"DEFERRED['DELIVERY_LIMIT'] must be a positive integer, got {delivery_limit!r}."
        )

    consumer_timeout_ms = _consumer_timeout_ms(values["CONSUMER_TIMEOUT"], queue_type)
    management_urls = _management_urls(values["MANAGEMENT_URL"], broker_urls)
    group_size = values["QUORUM_GROUP_SIZE"]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ImproperlyConfigured(
            f"DEFERRED['QUORUM_GROUP_SIZE'] must be a positive integer, got {group_size!r}."
        )
    worker_heartbeat_s = _worker_heartbeat_s(values["WORKER_HEARTBEAT"])
    stuck_after_s = _duration_ms("STUCK_AFTER", values["STUCK_AFTER"]) / 1000
    if stuck_after_s < 1:
        raise ImproperlyConfigured(
            f"DEFERRED['STUCK_AFTER'] must be at least 1 second, got {values['STUCK_AFTER']!r}."
        )
    repair_stuck = values["REPAIR_STUCK"]
    if not isinstance(repair_stuck, bool):
        raise ImproperlyConfigured(
            f"DEFERRED['REPAIR_STUCK'] must be True or False, got {repair_stuck!r}."
        )

    schedules = _schedules(values["SCHEDULES"])
    cancel_margin_ms = _duration_ms("CANCEL_MARGIN", values["CANCEL_MARGIN"])
    if not 1000 <= cancel_margin_ms <= MAX_TTL_MS:
        raise ImproperlyConfigured(
            "DEFERRED['CANCEL_MARGIN'] must be from 1 second to 10 years, got "
            f"{values['CANCEL_MARGIN']!r}."
        )

    signing = values["SIGNING"]
    if not isinstance(signing, bool):
        raise ImproperlyConfigured(f"DEFERRED['SIGNING'] must be True or False, got {signing!r}.")
    signing_keys = _signing_keys(values["SIGNING_KEY"], values["SIGNING_KEY_FALLBACKS"], signing)
    max_message_bytes = values["MAX_MESSAGE_BYTES"]
    if (
        isinstance(max_message_bytes, bool)
        or not isinstance(max_message_bytes, int)
        or not MIN_MESSAGE_BYTES <= max_message_bytes <= MAX_MESSAGE_BYTES
    ):
        raise ImproperlyConfigured(
            f"DEFERRED['MAX_MESSAGE_BYTES'] must be a whole number of bytes from "
            f"{MIN_MESSAGE_BYTES} to {MAX_MESSAGE_BYTES} (RabbitMQ 3.x's default limit; "
            "4.x refuses more than 16 MiB by default); "
            f"got {max_message_bytes!r}."
        )
    metrics_token = _metrics_token(values["METRICS_TOKEN"])
    metrics_allow = _metrics_allow(values["METRICS_ALLOW"])
    hold_window_ms, hold_prefetch = _hold(values["HOLD_WINDOW"], values["HOLD_PREFETCH"])
    priorities = values["PRIORITIES"]
    if not isinstance(priorities, bool):
        raise ImproperlyConfigured(
            f"DEFERRED['PRIORITIES'] must be True or False, got {priorities!r}."
        )
    time_limit_s, time_limit_grace_s = _time_limits(
        values["TIME_LIMIT"], values["TIME_LIMIT_GRACE"]
    )
    results, result_ttl_ms, result_max_bytes = _results(
        values["RESULTS"], values["RESULT_TTL"], values["RESULT_MAX_BYTES"]
    )
    result_cache, result_cache_timeout_s = _result_cache(
        values["RESULT_CACHE"], values["RESULT_CACHE_TIMEOUT"], result_ttl_ms
    )
    tls = _tls(values)
    if tls is not None:
        broker_urls = tuple(_with_tls(url, tls) for url in broker_urls)

    result = DeferredSettings(
        broker_urls=broker_urls,
        publish_timeout_s=publish_timeout_s,
        prefix=prefix,
        max_delay_ms=max_delay_ms,
        radix=radix,
        resolution_ms=resolution_ms,
        queue_type=queue_type,
        delay_queue_type=delay_queue_type,
        queues=tuple(queues),
        max_retries=max_retries,
        retry_backoff=retry_backoff,
        on_commit=on_commit,
        delivery_limit=delivery_limit,
        declare=declare,
        management_urls=management_urls,
        quorum_group_size=group_size,
        stuck_after_s=stuck_after_s,
        repair_stuck=repair_stuck,
        schedules=schedules,
        cancel_margin_ms=math.ceil(cancel_margin_ms),
        signing=signing,
        signing_keys=signing_keys,
        max_message_bytes=max_message_bytes,
        consumer_timeout_ms=consumer_timeout_ms,
        worker_heartbeat_s=worker_heartbeat_s,
        tls=tls,
        metrics_token=metrics_token,
        metrics_allow=metrics_allow,
        hold_window_ms=hold_window_ms,
        hold_prefetch=hold_prefetch,
        time_limit_s=time_limit_s,
        time_limit_grace_s=time_limit_grace_s,
        priorities=priorities,
        results=results,
        ledger=_flag("LEDGER", values["LEDGER"]),
        result_ttl_ms=result_ttl_ms,
        result_max_bytes=result_max_bytes,
        result_cache=result_cache,
        result_cache_timeout_s=result_cache_timeout_s,
    )
    # The plan enforces the limits that depend on several values at once
    # (routing-key length); building it here makes them configuration errors.
    try:
        plan_topology(result)
    except TopologyError as exc:
        raise ImproperlyConfigured(str(exc)) from exc
    return result


def _signing_keys(key: Any, fallbacks: Any, signing: bool) -> tuple[str | bytes, ...]:
    """The signing key, then the fallbacks: ``SIGNING_KEY``'s, or ``SECRET_KEY``'s."""

    def valid(name: str, value: Any) -> str | bytes:
        if not isinstance(value, str | bytes) or not value:
            raise ImproperlyConfigured(
                f"{name} must be a non-empty string (or bytes); got a {type(value).__name__}."
            )
        return value

    def listed(name: str, value: Any) -> tuple[str | bytes, ...]:
        if value is None:
            return ()
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise ImproperlyConfigured(f"{name} must be a list of keys.")
        return tuple(valid(f"{name}[{n}]", v) for n, v in enumerate(value))

    if key is not None:
        return (
            valid("DEFERRED['SIGNING_KEY']", key),
            *listed("DEFERRED['SIGNING_KEY_FALLBACKS']", fallbacks),
        )
    if fallbacks is not None:
        raise ImproperlyConfigured(
            "DEFERRED['SIGNING_KEY_FALLBACKS'] needs DEFERRED['SIGNING_KEY'] (without it, "
            "SECRET_KEY and SECRET_KEY_FALLBACKS are used)."
        )
    try:
        secret = django_settings.SECRET_KEY
    except ImproperlyConfigured:
        secret = ""
    if not secret:
        if signing:
            raise ImproperlyConfigured(
                "deferred signs its jobs with a key derived from SECRET_KEY, which is empty: "
                "set SECRET_KEY or DEFERRED['SIGNING_KEY']."
            )
        return ()
    return (
        valid("SECRET_KEY", secret),
        *listed("SECRET_KEY_FALLBACKS", getattr(django_settings, "SECRET_KEY_FALLBACKS", None)),
    )


def _tls(values: dict[str, Any]) -> TLSOptions | None:
    """The TLS_* settings; ``None`` when none is set."""
    paths = {}
    for name in ("TLS_CA_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_SERVER_NAME"):
        value = values[name]
        if value is not None and (not isinstance(value, str | os.PathLike) or not str(value)):
            raise ImproperlyConfigured(
                f"DEFERRED[{name!r}] must be a path (or, for TLS_SERVER_NAME, a host name) "
                f"or None; got {value!r}."
            )
        paths[name] = None if value is None else os.fspath(value)
        if name != "TLS_SERVER_NAME" and value is not None and not os.path.isfile(value):
            raise ImproperlyConfigured(f"DEFERRED[{name!r}]: no such file: {value}.")
    if all(v is None for v in paths.values()):
        return None
    if (paths["TLS_CERT_FILE"] is None) != (paths["TLS_KEY_FILE"] is None):
        raise ImproperlyConfigured(
            "DEFERRED['TLS_CERT_FILE'] and DEFERRED['TLS_KEY_FILE'] go together: a client "
            "certificate needs its key (mutual TLS)."
        )
    return TLSOptions(
        ca_file=paths["TLS_CA_FILE"],
        cert_file=paths["TLS_CERT_FILE"],
        key_file=paths["TLS_KEY_FILE"],
        server_name=paths["TLS_SERVER_NAME"],
    )


def _with_tls(url: str, tls: TLSOptions) -> str:
    """``url`` with the ``TLS_*`` settings as pika's ``ssl_options`` query argument.

    The URL is what every connection is made from, so the options travel
    with it: one place (``broker.parameters``) turns them into an SSL context.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "amqps":
        raise ImproperlyConfigured(
            "DEFERRED['TLS_*'] settings apply to amqps:// broker URLs; "
            f"{parts.scheme}://{parts.hostname}:{parts.port or 5672} is not encrypted."
        )
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "ssl_options" for key, _ in query):
        raise ImproperlyConfigured(
            "A broker URL has its own ssl_options and DEFERRED['TLS_*'] settings are given "
            "too: use one or the other."
        )
    options = {
        key: value
        for key, value in (
            ("cafile", tls.ca_file),
            ("certfile", tls.cert_file),
            ("keyfile", tls.key_file),
            ("server_hostname", tls.server_name),
        )
        if value is not None
    }
    query.append(("ssl_options", repr(options)))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def _schedules(value: Any) -> tuple[tuple[str, Schedule], ...]:
    if not isinstance(value, Mapping):
        raise ImproperlyConfigured(
            "DEFERRED['SCHEDULES'] must be a dict of task name -> every(...) or cron(...), "
            f"got {value!r}."
        )
    for name, schedule in value.items():
        if not isinstance(name, str) or not name:
            raise ImproperlyConfigured(
                f"DEFERRED['SCHEDULES']: the keys are task names, got {name!r}."
            )
        if not isinstance(schedule, Schedule):
            raise ImproperlyConfigured(
                f"DEFERRED['SCHEDULES'][{name!r}] must be every(...) or cron(...), "
                f"got {schedule!r}."
            )
    return tuple(sorted(value.items()))


@lru_cache(maxsize=1)
def get_settings() -> DeferredSettings:
    """Return the validated ``DEFERRED`` setting (cached until it changes)."""
    return _build(getattr(django_settings, "DEFERRED", None))


@receiver(setting_changed)
def _reset(*, setting: str, **kwargs: Any) -> None:
    # The signing keys come from SECRET_KEY and SECRET_KEY_FALLBACKS by default.
    if setting in ("DEFERRED", "SECRET_KEY", "SECRET_KEY_FALLBACKS"):
        get_settings.cache_clear()
        plan_topology.cache_clear()
