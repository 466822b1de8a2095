"""System checks: bad ``DEFERRED`` values show up in ``manage.py check`` and at start-up."""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from deferred.conf import get_settings
from deferred.tasks import registered_tasks


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
    return errors


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
