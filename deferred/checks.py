"""System checks: bad ``DEFERRED`` values show up in ``manage.py check`` and at start-up."""

from __future__ import annotations

import functools
import ipaddress
import urllib.parse
from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from deferred.broker import BrokerError, server_version
from deferred.conf import get_settings
from deferred.core.priorities import broker_levels, honoured
from deferred.producer.tasks import SETTING, registered_tasks


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    try:
        settings = get_settings()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), hint="See the settings table in the README.", id="deferred.E001")]
    errors: list[CheckMessage] = []
    for name, task in sorted(registered_tasks().items()):
        if task.queue is not None and task.queue not in settings.queues:
            errors.append(
                Error(
                    f"Task {name!r} uses queue {task.queue!r}, which is not in "
                    f"DEFERRED['QUEUES'] {list(settings.queues)!r}.",
                    hint="Add the queue to DEFERRED['QUEUES'] and run declare_delay_topology.",
                    obj=task.func,
                    id="deferred.E002",
                )
            )
    return errors + _check_time_limits(settings)


#: RabbitMQ's consumer timeout when nothing sets another: 30 minutes.
BROKER_CONSUMER_TIMEOUT_S = 1800.0


def _check_time_limits(settings: Any) -> list[CheckMessage]:
    """Warn of a time limit the broker's consumer timeout would beat: the broker would
    take the job back and start it elsewhere while it still runs here.

    Twice the limit and its grace: a job given up at its hard limit is acked
    once the worker's other running jobs end, each within its own limit.
    """
    timeout_s = (
        settings.consumer_timeout_ms / 1000
        if settings.consumer_timeout_ms is not None
        else BROKER_CONSUMER_TIMEOUT_S
    )
    limits: list[tuple[str, float | None, object]] = [
        ("DEFERRED['TIME_LIMIT']", settings.time_limit_s, None)
    ]
    limits += [
        (f"Task {name!r}'s time_limit", task.time_limit(settings), task.func)
        for name, task in sorted(registered_tasks().items())
        if task.time_limit_s is not SETTING
    ]
    warnings: list[CheckMessage] = []
    for what, limit_s, obj in limits:
        if limit_s is not None and 2 * (limit_s + settings.time_limit_grace_s) >= timeout_s:
            warnings.append(
                Warning(
                    f"Twice {what} ({limit_s:g} s) plus TIME_LIMIT_GRACE "
                    f"({settings.time_limit_grace_s:g} s) reaches the consumer timeout "
                    f"({timeout_s:g} s): RabbitMQ could take such a job back and start it "
                    "again elsewhere while it still runs (a job given up at its hard limit "
                    "is acked once the worker's other running jobs end).",
                    hint="Lower the limit, or raise DEFERRED['CONSUMER_TIMEOUT'] (quorum "
                    "queues) or consumer_timeout in rabbitmq.conf above it.",
                    obj=obj,
                    id="deferred.W004",
                )
            )
    return warnings


@functools.lru_cache(maxsize=8)
def _broker_version(urls: tuple[str, ...]) -> tuple[int, ...] | None:
    """The broker's release, asked once per process (checks run at every command's start)."""
    try:
        return server_version(urls, timeout=2.0)
    except BrokerError:
        return None


@register()
def check_priorities(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn of a task whose priority the queues cannot honour.

    Only asked when a task sets a priority and the queues may not order
    by it: quorum queues (their levels depend on the RabbitMQ release,
    which only the broker can tell) or classic ones with PRIORITIES off.
    """
    try:
        settings = get_settings()
    except ImproperlyConfigured:
        return []  # check_settings reports it
    asking = [(n, t) for n, t in sorted(registered_tasks().items()) if t.priority]
    if not asking or (settings.queue_type == "classic" and settings.priorities):
        return []
    if settings.queue_type == "classic":
        levels, where = 1, "DEFERRED['PRIORITIES'] is False: the ready queues are FIFO"
    else:
        version = _broker_version(settings.broker_urls)
        if version is None:
            return []  # no broker to ask: nothing is known, nothing is said
        levels = broker_levels("quorum", version)
        release = ".".join(map(str, version))
        where = f"quorum queues on RabbitMQ {release} have " + (
            "no priorities" if levels == 1 else f"{levels} priority levels"
        )
    return [
        Warning(
            f"Task {name!r} asks for priority {task.priority}, which the ready queues "
            f"cannot honour: {where}.",
            hint="Jobs waiting in a worker for a thread are still ordered by priority; "
            "see the worker guide's section on priorities for what each queue type offers.",
            obj=task.func,
            id="deferred.W005",
        )
        for name, task in asking
        if not honoured(task.priority, levels)
    ]


@register()
def check_signing(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    try:
        settings = get_settings()
    except ImproperlyConfigured:
        return []  # reported by check_settings
    if settings.signing or django_settings.DEBUG:
        return []
    return [
        Warning(
            "DEFERRED['SIGNING'] is False: the worker runs any job anyone who can publish "
            "to the broker's vhost sends it.",
            hint="Turn it back on once every process of the fleet signs its jobs (see the "
            "README's Security section).",
            id="deferred.W001",
        )
    ]


#: Cache backends whose entries one process alone sees (or none does).
PROCESS_CACHES = (
    "django.core.cache.backends.locmem.LocMemCache",
    "django.core.cache.backends.dummy.DummyCache",
)


@register()
def check_result_cache(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn of a ``RESULT_CACHE`` that workers and web processes cannot share: the
    worker would fill its own, and look-ups would never find an entry."""
    try:
        settings = get_settings()
    except ImproperlyConfigured:
        return []
    if settings.result_cache is None:
        return []
    backend = django_settings.CACHES.get(settings.result_cache, {}).get("BACKEND", "")
    if backend not in PROCESS_CACHES:
        return []
    kind = backend.rsplit(".", 1)[-1]
    return [
        Warning(
            f"DEFERRED['RESULT_CACHE'] is {settings.result_cache!r}, a {kind}: "
            "each process has its own, so what a worker puts there no look-up finds.",
            hint="Name a cache every worker and web process shares (Redis, Memcached, the "
            "database cache), or set RESULT_CACHE to None.",
            id="deferred.W006",
        )
    ]


def _is_loopback(host: str | None) -> bool:
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@register(Tags.security, deploy=True)
def check_broker_security(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``check --deploy``: the default account, or clear text, to a broker on another host."""
    try:
        settings = get_settings()
    except ImproperlyConfigured:
        return []
    warnings: list[CheckMessage] = []
    for url in settings.broker_urls:
        parts = urllib.parse.urlsplit(url)
        if _is_loopback(parts.hostname):
            continue
        where = f"{parts.hostname}:{parts.port or (5671 if parts.scheme == 'amqps' else 5672)}"
        user = urllib.parse.unquote(parts.username or "guest")
        password = urllib.parse.unquote(parts.password or "guest")
        if user == "guest" and password == "guest":
            warnings.append(
                Warning(
                    f"DEFERRED['BROKER_URL'] uses RabbitMQ's default guest:guest account on "
                    f"{where}, which is not this host.",
                    hint="Create a user per role (see the README's Security section); "
                    "RabbitMQ itself refuses guest from other hosts unless told otherwise.",
                    id="deferred.W002",
                )
            )
        if parts.scheme == "amqp":
            warnings.append(
                Warning(
                    f"DEFERRED['BROKER_URL'] connects to {where} without TLS: the password "
                    "and every job cross the network in clear text.",
                    hint="Use an amqps:// URL (see the README's Security section).",
                    id="deferred.W003",
                )
            )
    return warnings
