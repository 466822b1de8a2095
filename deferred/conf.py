"""The ``DEFERRED`` setting: one table, read once into a frozen, validated object.

Each field of :class:`DeferredSettings` is a row of the table: its key in
``DEFERRED``, its default, the parser that checks it (``deferred.core.parsers``), the
topic and the words of the settings reference, which the docs render from here.
Adding a setting is one row; :func:`_build` is a loop over the rows plus the
checks that span several of them.

Every other module asks :func:`get_settings` instead of reading
``django.conf.settings`` itself, so the rules for what a valid value is live in
one place, bad values surface as ``ImproperlyConfigured`` (and in
``manage.py check``), and tests that use ``override_settings`` see the new value
because the cache is dropped on Django's ``setting_changed`` signal.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.template.defaultfilters import pluralize

from deferred.broker.connection import with_tls_options
from deferred.core import parsers as p
from deferred.core.parsers import Parser
from deferred.core.retries import Backoff
from deferred.core.schedule import Schedule
from deferred.core.topology import (
    CANCEL_MARGIN_MS,
    MAX_TTL_MS,
    RESULT_TTL_MS,
    TopologyError,
    plan_topology,
)


@dataclass(frozen=True)
class Setting:
    """One row of the table: a key of ``DEFERRED`` and all that is known of it."""

    key: str
    #: The value when ``DEFERRED`` leaves the key out, as a project would write it.
    default: Any
    parse: Parser
    #: The section of the settings reference it is filed under.
    topic: str
    #: What the reference says of it: what it does, its unit and bounds, and why.
    doc: str


def setting(
    key: str, default: Any, parse: Parser, topic: str, doc: str, *, secret: bool = False
) -> Any:
    """A field of :class:`DeferredSettings` that is read from ``DEFERRED[key]``.

    ``secret`` keeps the value out of ``repr()`` (URLs with passwords, keys).
    """
    row = Setting(key=key, default=default, parse=parse, topic=topic, doc=" ".join(doc.split()))
    return field(metadata={"setting": row}, repr=not secret)


# The sections of the settings reference, in page order; the rows below follow it.
BROKER = "Broker connection"
PUBLISHING = "Publishing: defer()"
TOPOLOGY = "Topology and delays"
WORKER = "Worker"
RETRIES = "Retries and failures"
RECURRING = "Recurring jobs and cancels"
RESULTS = "Results"
CLUSTERS = "Clusters"
RESTARTS = "Broker restarts"
SECURITY = "Security"


@dataclass(frozen=True)
class TLSOptions:
    """Where the CA, the client certificate and its key are, and the name to expect."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None


@dataclass(frozen=True, kw_only=True)
class DeferredSettings:
    """The validated ``DEFERRED`` setting; durations are whole milliseconds or
    seconds, as each name says. The fields are the table of settings, in the
    reference's order; the last few are derived from several rows."""

    # ----------------------------------------------------------------- broker connection
    #: One URL per node, in the order they are tried (with the TLS_* options in them).
    broker_urls: tuple[str, ...] = setting(
        "BROKER_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        p.broker_urls,
        BROKER,
        """An AMQP URL in pika's syntax (?heartbeat=30 etc.), or a list of them, one per
        node of a cluster, tried in order.""",
        secret=True,
    )
    tls_ca_file: str | None = setting(
        "TLS_CA_FILE",
        None,
        p.tls_path,
        BROKER,
        "amqps:// only: the CA file to verify the broker with (None: the system's CAs).",
    )
    tls_cert_file: str | None = setting(
        "TLS_CERT_FILE",
        None,
        p.tls_path,
        BROKER,
        """amqps:// only: a client certificate, for brokers that require one (mutual
        TLS), with TLS_KEY_FILE.""",
    )
    tls_key_file: str | None = setting(
        "TLS_KEY_FILE", None, p.tls_path, BROKER, "amqps:// only: the key of TLS_CERT_FILE."
    )
    tls_server_name: str | None = setting(
        "TLS_SERVER_NAME",
        None,
        p.host_name,
        BROKER,
        "amqps:// only: the name the broker's certificate must carry (None: the URL's host).",
    )
    #: The management API's base URLs, tried in order; empty when it is not to be asked.
    management_urls: tuple[str, ...] = setting(
        "MANAGEMENT_URL",
        None,
        p.management_urls,
        BROKER,
        """Where to ask RabbitMQ's management API for what AMQP cannot tell (unacked
        counts, nodes, queue leaders, stuck dead-letters): None tries each broker host on
        the plugin's port (15672, or HTTPS on 15671 for an amqps:// broker: credentials
        never go out in clear text when the broker connection is encrypted), False never
        asks, or an http(s):// URL or a list of them, tried in order.""",
        secret=True,
    )

    # ----------------------------------------------------------------- publishing
    publish_timeout_s: float = setting(
        "PUBLISH_TIMEOUT",
        timedelta(seconds=10),
        p.publish_timeout_s,
        PUBLISHING,
        """The one deadline of each defer() / defer_many(): connecting, failing over to
        another node, waiting out a blocked connection (memory or disk alarm) and the
        broker's confirm (timedelta or seconds; at most 300 s). Well under a web server's
        request timeout, so a broker in trouble costs a request an error, not a hung
        worker process.""",
    )
    on_commit: bool = setting(
        "ON_COMMIT",
        True,
        p.flag,
        PUBLISHING,
        "defer() inside transaction.atomic() publishes after the commit.",
    )
    max_message_bytes: int = setting(
        "MAX_MESSAGE_BYTES",
        256 * 1024,
        p.max_message_bytes,
        PUBLISHING,
        """The largest job body (1 KiB to 128 MiB): defer() raises ValueError above it,
        and the worker sends a larger message to the failed queue unread. A body sits in
        the broker's memory or disk for its whole delay: pass ids. Keep it at or under the
        broker's max_message_size (RabbitMQ 4.x: 16 MiB by default, 3.x: 128 MiB); a
        larger job is MessageTooLarge at defer().""",
    )

    # ----------------------------------------------------------------- topology and delays
    prefix: str = setting(
        "PREFIX",
        "deferred",
        p.prefix,
        TOPOLOGY,
        """The start of every exchange and queue name, so several projects can share a
        vhost.""",
    )
    queues: tuple[str, ...] = setting(
        "QUEUES",
        ["default"],
        p.queues,
        TOPOLOGY,
        """The target queues' names; the first is the default. Letters, digits, "_" and
        "-" (no dots).""",
    )
    queue_type: str = setting(
        "QUEUE_TYPE",
        "classic",
        p.queue_type,
        TOPOLOGY,
        """The ready, hold and failed queues' type, "classic" or "quorum". Quorum queues
        are replicated on a cluster; classic ones keep ten priority levels on RabbitMQ 3.x
        and cost the broker less per job.""",
    )
    #: The delay queues' type: QUEUE_TYPE's unless set.
    delay_queue_type: str = setting(
        "DELAY_QUEUE_TYPE",
        None,
        p.delay_queue_type,
        TOPOLOGY,
        """The delay queues' type, "classic" or "quorum" (only with QUEUE_TYPE "quorum"
        too, or with classic ready queues). Classic queues dead-letter without confirms: a
        broker restart under load can lose a job moving between two delay queues at that
        moment. Quorum queues dead-letter with confirms, and on RabbitMQ 4.x lost none in
        the restart tests; on 3.10 they stranded dead-letters after a restart (a RabbitMQ
        bug). See the guarantees page before choosing.""",
    )
    quorum_group_size: int = setting(
        "QUORUM_GROUP_SIZE",
        3,
        p.positive_int,
        TOPOLOGY,
        """Quorum queues only: how many nodes keep a copy of each queue. RabbitMQ caps it
        at the cluster's size, so 3 means "every node, up to three".""",
    )
    #: Whether the app may create the topology; if not, it only checks it.
    declare: bool = setting(
        "DECLARE",
        True,
        p.flag,
        TOPOLOGY,
        """False: never declare anything; the broker's exchanges and queues are created
        by infrastructure code (definitions, Terraform), and the app only checks that
        they exist.""",
    )
    max_delay_ms: int = setting(
        "MAX_DELAY",
        timedelta(milliseconds=MAX_TTL_MS),
        p.max_delay_ms,
        TOPOLOGY,
        """The longest delay defer() accepts (timedelta or seconds). At most ten years,
        the largest TTL RabbitMQ accepts on a queue, so no queue of the topology ever
        needs a TTL the broker would refuse.""",
    )
    radix: int = setting(
        "RADIX",
        16,
        p.radix,
        TOPOLOGY,
        """The base of the delay decomposition (2-64): more queues, fewer hops as it
        grows. Chosen from the benchmarks (docs/bench/): sixteen digit values per level
        need half the hops of radix 2, and hops are the broker's main cost.""",
    )
    resolution_ms: int = setting(
        "RESOLUTION",
        timedelta(milliseconds=1),
        p.resolution_ms,
        TOPOLOGY,
        """Delays are rounded up to a multiple of this (timedelta or seconds; whole
        milliseconds). Coarser means fewer hops and burstier arrivals.""",
    )

    # ----------------------------------------------------------------- worker
    #: How long an attempt may run, in seconds (None: no limit); tasks may set their own.
    time_limit_s: float | None = setting(
        "TIME_LIMIT",
        timedelta(minutes=10),
        p.time_limit_s,
        WORKER,
        """How long one attempt of a task may run (timedelta or seconds; None: no limit),
        unless the task sets @task(time_limit=...). When it passes,
        deferred.TimeLimitExceeded is raised inside the task. Ten minutes stops a hung job
        long before the broker's consumer timeout (30 minutes by default) would take it
        back and start it a second time.""",
    )
    time_limit_grace_s: float = setting(
        "TIME_LIMIT_GRACE",
        timedelta(seconds=30),
        p.time_limit_grace_s,
        WORKER,
        """How long a task may go on after TimeLimitExceeded (to clean up, or because it
        is blocked in C code) before the worker records the attempt as timed_out, acks it
        and ends its process for a fresh one.""",
    )
    #: The quorum ready queues' ``x-consumer-timeout`` (None: the broker's).
    consumer_timeout_ms: int | None = setting(
        "CONSUMER_TIMEOUT",
        None,
        p.consumer_timeout_ms,
        WORKER,
        """Quorum queues only (RabbitMQ 3.12+): how long a worker may hold a job, running
        it, before its ready queue takes it back and hands it to another worker, which
        runs it a second time (timedelta or seconds; None: the broker's consumer_timeout,
        30 minutes unless configured). Set it above your longest job. Classic queues
        follow the broker-wide consumer_timeout in rabbitmq.conf (on 4.3 they have
        none).""",
    )
    worker_heartbeat_s: int = setting(
        "WORKER_HEARTBEAT",
        timedelta(seconds=5),
        p.worker_heartbeat_s,
        WORKER,
        """The worker connection's heartbeat (timedelta or seconds, 1 s to 10 minutes).
        RabbitMQ closes the connection of a worker it has not heard from for about three
        of them (a paused process, a lost host), and hands the jobs it held to the other
        workers: the lower, the sooner, at the price of a frame every half heartbeat. A
        task holding the GIL longer than that (C code) costs its worker the
        connection.""",
    )
    priorities: bool = setting(
        "PRIORITIES",
        True,
        p.flag,
        WORKER,
        """Among due jobs, higher @task(priority=...) runs first. Classic ready and hold
        queues then take x-max-priority, a topology of its own (declared beside the old
        one, which drains: see the live-changes guide); quorum queues need nothing
        (RabbitMQ 4.0+; 3.x quorum queues have no priorities). False: plain FIFO queues,
        and priorities only order the jobs waiting in a worker for a thread.""",
    )
    #: The last mile: jobs due within this are held by the worker (0: none).
    hold_window_ms: int = setting(
        "HOLD_WINDOW",
        timedelta(milliseconds=256),
        p.hold_window_ms,
        WORKER,
        """The last mile (timedelta or seconds; 0: none): a job due within this window
        skips the lowest levels of the topology, and the worker that takes it holds it
        unacked until its due time. The levels it covers whole (RADIX**k units) are left
        out of the topology: fewer hops, less broker CPU per job, and lateness set by the
        worker's timer rather than by broker hops. At most one hour.""",
    )
    hold_prefetch: int = setting(
        "HOLD_PREFETCH",
        1000,
        p.hold_prefetch,
        WORKER,
        """The most jobs a worker holds at once (its hold queues' prefetch, beside its
        concurrency), 1-65535. A held job that comes due while every thread is busy goes
        back for another worker at once.""",
    )

    # ----------------------------------------------------------------- retries and failures
    max_retries: int = setting(
        "MAX_RETRIES",
        0,
        p.max_retries,
        RETRIES,
        """Retries after the first attempt, for tasks that do not set max_retries. Retries
        are opt-in: a task that raises goes to the failed queue unless it (or this
        default) allows retries.""",
    )
    retry_backoff: Backoff = setting(
        "RETRY_BACKOFF",
        {"base": 10.0, "factor": 2.0, "cap": 3600.0, "jitter": 0.1},
        p.retry_backoff,
        RETRIES,
        """The default waits between attempts: a list of seconds (the last one repeats)
        or an exponential dict {"base", "factor", "cap", "jitter"}.""",
    )
    delivery_limit: int = setting(
        "DELIVERY_LIMIT",
        5,
        p.positive_int,
        RETRIES,
        """Deliveries of one job without an ack before it counts as a poison job that
        kills workers, and goes to the failed queue.""",
    )

    # ----------------------------------------------------------------- recurring jobs, cancels
    schedules: tuple[tuple[str, Schedule], ...] = setting(
        "SCHEDULES",
        {},
        p.schedules,
        RECURRING,
        """Recurring jobs for tasks the decorator cannot reach (other apps' tasks), by
        task name: {"app.tasks.cleanup": every(hours=1)}. Overrides
        @task(schedule=...).""",
    )
    cancel_margin_ms: int = setting(
        "CANCEL_MARGIN",
        timedelta(milliseconds=CANCEL_MARGIN_MS),
        p.cancel_margin_ms,
        RECURRING,
        """How long a cancel stays in force after its job was due: a job that comes due
        while no worker runs is still cancelled if a worker takes it within this margin
        (timedelta or seconds, 1 s to 10 years). Workers keep each cancel in memory until
        then.""",
    )

    # ----------------------------------------------------------------- results
    results: bool = setting(
        "RESULTS",
        True,
        p.flag,
        RESULTS,
        """Results (deferred.records.results): workers write each job's start and outcome to the
        PREFIX.results stream, which deferred.result(id) and the django.tasks backend's
        get_result() read. False: nothing is written, at no cost.""",
    )
    result_ttl_ms: int = setting(
        "RESULT_TTL",
        timedelta(milliseconds=RESULT_TTL_MS),
        p.result_ttl_ms,
        RESULTS,
        """How long the results stream keeps them (timedelta or seconds, 1 minute to 10
        years): RabbitMQ drops older ones by whole segments. Declared with the stream: a
        change needs the stream re-made (see the results guide).""",
    )
    result_max_bytes: int = setting(
        "RESULT_MAX_BYTES",
        64 * 1024,
        p.result_max_bytes,
        RESULTS,
        """The largest return value kept, as JSON (0 to 1 MiB); a larger one, or one JSON
        cannot carry, is left out of the result (value_kept is False).""",
    )
    result_cache: str | None = setting(
        "RESULT_CACHE",
        None,
        p.cache_alias,
        RESULTS,
        """A cache alias from CACHES that every worker and web process shares (Redis,
        Memcached, the database): workers put a finished job's result there once the
        stream has it, and result() looks there first. Never the only copy; None:
        look-ups read the stream.""",
    )
    #: How long finished results stay in RESULT_CACHE, in seconds (at most RESULT_TTL).
    result_cache_timeout_s: float = setting(
        "RESULT_CACHE_TIMEOUT",
        timedelta(hours=1),
        p.result_cache_timeout_s,
        RESULTS,
        """How long a result stays in RESULT_CACHE (timedelta or seconds, 1 second or
        more; RESULT_TTL if that is shorter); after that, look-ups of it read the
        stream.""",
    )

    # ----------------------------------------------------------------- clusters
    stuck_after_s: float = setting(
        "STUCK_AFTER",
        timedelta(seconds=30),
        p.stuck_after_s,
        CLUSTERS,
        """Quorum delay queues whose dead-lettered messages have not moved for this long
        are reported as stuck, a known RabbitMQ bug after a leader change (timedelta or
        seconds, at least 1 s).""",
    )
    repair_stuck: bool = setting(
        "REPAIR_STUCK",
        True,
        p.flag,
        CLUSTERS,
        """Whether the worker repairs stuck queues itself (forcing a leader election
        through the management API), when its broker user may.""",
    )

    # ----------------------------------------------------------------- broker restarts
    ledger: bool = setting(
        "LEDGER",
        True,
        p.flag,
        RESTARTS,
        """The ledger (deferred.core.ledger): the broker copies every job published into the
        PREFIX.ledger stream, and after a broker restart one worker (the keeper) publishes
        again the jobs that were moving between two delay queues when it went down. It is
        also what deferred.pending(), deferred_jobs and the status page list, and what
        run_now() and reschedule() move (docs: See and change pending jobs). False: no
        ledger, such a job can be lost, and pending jobs cannot be listed.""",
    )

    # ----------------------------------------------------------------- security
    #: Whether the worker runs only jobs signed with one of ``signing_keys``.
    signing: bool = setting(
        "SIGNING",
        True,
        p.flag,
        SECURITY,
        """Every message carries an HMAC of its body; the worker runs only jobs signed
        with one of the keys (see deferred/core/signing.py). False: messages are still signed
        when a key exists, but not checked (a mixed fleet during an upgrade).""",
    )
    signing_key: str | bytes | None = setting(
        "SIGNING_KEY",
        None,
        p.signing_key,
        SECURITY,
        """The key jobs are signed with; None: SECRET_KEY. Set it for fleets whose web and
        worker processes must not share SECRET_KEY.""",
        secret=True,
    )
    signing_key_fallbacks: tuple[str | bytes, ...] | None = setting(
        "SIGNING_KEY_FALLBACKS",
        None,
        p.keys,
        SECURITY,
        """Older keys still accepted when verifying, with SIGNING_KEY (without it,
        SECRET_KEY_FALLBACKS are).""",
        secret=True,
    )
    #: The bearer token the metrics URL asks for (None: no token).
    metrics_token: str | None = setting(
        "METRICS_TOKEN",
        None,
        p.metrics_token,
        SECURITY,
        """The bearer token the metrics/ URL (Prometheus' text format of deferred_status)
        asks for, at least 16 characters. With neither this nor METRICS_ALLOW, the URL
        answers 404.""",
        secret=True,
    )
    #: The networks the metrics URL answers (None: any, if a token is set).
    metrics_allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None = setting(
        "METRICS_ALLOW",
        None,
        p.networks,
        SECURITY,
        """Addresses or networks (["10.0.0.0/8", "::1"]) the metrics/ URL answers, checked
        against REMOTE_ADDR; with METRICS_TOKEN too, both must pass.""",
    )

    # ----------------------------------------------------------------- derived from several rows
    #: The key messages are signed with, then the fallbacks accepted when verifying
    #: (SIGNING_KEY's, or SECRET_KEY's); empty only with signing off and no key.
    signing_keys: tuple[str | bytes, ...] = field(default=(), repr=False)
    #: The TLS_* settings together (None: none is set); they are in ``broker_urls`` too.
    tls: TLSOptions | None = None

    @property
    def broker_url(self) -> str:
        """The first node's URL (the only one with a single ``BROKER_URL``)."""
        return self.broker_urls[0]

    @property
    def default_queue(self) -> str:
        """The queue a task goes to when neither it nor the call names one."""
        return self.queues[0]


#: The table's rows, in the reference's order.
SETTINGS: tuple[Setting, ...] = tuple(
    f.metadata["setting"] for f in dataclasses.fields(DeferredSettings) if "setting" in f.metadata
)
#: The rows by key: the django.tasks backend's OPTIONS parse with them.
SETTINGS_BY_KEY: dict[str, Setting] = {row.key: row for row in SETTINGS}
#: Each key's default, as a project would write it.
DEFAULTS: dict[str, Any] = {row.key: row.default for row in SETTINGS}


def _build(raw: Any, cls: type[DeferredSettings] = DeferredSettings) -> DeferredSettings:
    """``DEFERRED`` checked row by row, then the checks that span several rows."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ImproperlyConfigured(f"DEFERRED must be a dict, got {type(raw).__name__}.")
    rows = {
        f.name: f.metadata["setting"] for f in dataclasses.fields(cls) if "setting" in f.metadata
    }
    known = {row.key for row in rows.values()}
    if unknown := sorted(set(raw) - known):
        raise ImproperlyConfigured(
            f"Unknown key{pluralize(len(unknown))} in DEFERRED: {', '.join(unknown)}. "
            f"Known keys: {', '.join(sorted(known))}."
        )
    given = {row.key: raw.get(row.key, row.default) for row in rows.values()}
    _before_rows(given)
    values = {
        name: row.parse(f"DEFERRED[{row.key!r}]", given[row.key]) for name, row in rows.items()
    }
    values.update(_spanning(values, given))
    result = cls(**values)
    # The plan enforces the limits that depend on several values at once
    # (routing-key length); building it here makes them configuration errors.
    try:
        plan_topology(result)
    except TopologyError as exc:
        raise ImproperlyConfigured(str(exc)) from exc
    return result


def _before_rows(given: dict[str, Any]) -> None:
    """What a setting's own check would hide: a value that does not apply at all is
    said to be so before anything is said of the value."""
    if given["CONSUMER_TIMEOUT"] is not None and given["QUEUE_TYPE"] == "classic":
        raise ImproperlyConfigured(
            "DEFERRED['CONSUMER_TIMEOUT'] applies to quorum queues only. With classic queues, "
            "set consumer_timeout in rabbitmq.conf (RabbitMQ 3.x to 4.2; on 4.3 classic "
            "queues have no consumer timeout), or leave CONSUMER_TIMEOUT at None."
        )
    if given["SIGNING_KEY"] is None and given["SIGNING_KEY_FALLBACKS"] is not None:
        raise ImproperlyConfigured(
            "DEFERRED['SIGNING_KEY_FALLBACKS'] needs DEFERRED['SIGNING_KEY'] (without it, "
            "SECRET_KEY and SECRET_KEY_FALLBACKS are used)."
        )


def _spanning(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """What one row cannot say alone: the values it resolves, and the checks across rows."""
    changes: dict[str, Any] = {}
    if values["max_delay_ms"] < values["resolution_ms"]:
        raise ImproperlyConfigured(
            f"DEFERRED['MAX_DELAY'] must be at least the resolution ({values['resolution_ms']} "
            f"ms); got {given['MAX_DELAY']!r}."
        )
    queue_type = values["queue_type"]
    delay_queue_type = changes["delay_queue_type"] = values["delay_queue_type"] or queue_type
    if queue_type == "quorum" and delay_queue_type != "quorum":
        raise ImproperlyConfigured(
            "DEFERRED['DELAY_QUEUE_TYPE'] must be 'quorum' when QUEUE_TYPE is 'quorum': classic "
            "delay queues would lose jobs moving between them on a broker restart, and would "
            "live on one node of the cluster that quorum queues are for."
        )
    # The cache only speeds up what the stream keeps: no entry outlives RESULT_TTL
    # (a project with a RESULT_TTL under the default hour keeps working as it was).
    changes["result_cache_timeout_s"] = min(
        values["result_cache_timeout_s"], values["result_ttl_ms"] / 1000
    )
    changes["signing_keys"] = _signing_keys(
        values["signing_key"], values["signing_key_fallbacks"], values["signing"]
    )
    tls = _tls(values)
    changes["tls"] = tls
    broker_urls = values["broker_urls"]
    if tls is not None:
        broker_urls = changes["broker_urls"] = tuple(_with_tls(url, tls) for url in broker_urls)
    if values["management_urls"] is None:
        changes["management_urls"] = p.management_urls_of(broker_urls)
    return changes


def _signing_keys(
    key: str | bytes | None, fallbacks: tuple[str | bytes, ...] | None, signing: bool
) -> tuple[str | bytes, ...]:
    """The signing key, then the fallbacks: ``SIGNING_KEY``'s, or ``SECRET_KEY``'s."""
    if key is not None:
        return (key, *(fallbacks or ()))
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
        p.key("SECRET_KEY", secret),
        *(
            p.keys("SECRET_KEY_FALLBACKS", getattr(django_settings, "SECRET_KEY_FALLBACKS", None))
            or ()
        ),
    )


def _tls(values: dict[str, Any]) -> TLSOptions | None:
    """The TLS_* settings together; ``None`` when none is set."""
    tls = TLSOptions(
        ca_file=values["tls_ca_file"],
        cert_file=values["tls_cert_file"],
        key_file=values["tls_key_file"],
        server_name=values["tls_server_name"],
    )
    if tls == TLSOptions():
        return None
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ImproperlyConfigured(
            "DEFERRED['TLS_CERT_FILE'] and DEFERRED['TLS_KEY_FILE'] go together: a client "
            "certificate needs its key (mutual TLS)."
        )
    return tls


def _with_tls(url: str, tls: TLSOptions) -> str:
    """``url`` carrying the ``TLS_*`` settings, which every connection is made from."""
    try:
        return with_tls_options(
            url,
            "DEFERRED['TLS_*'] settings",
            cafile=tls.ca_file,
            certfile=tls.cert_file,
            keyfile=tls.key_file,
            server_hostname=tls.server_name,
        )
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None


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
