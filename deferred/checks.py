"""System checks: bad ``DEFERRED`` values show up in ``manage.py check`` and at start-up."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, register
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
