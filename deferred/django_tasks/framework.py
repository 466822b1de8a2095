"""The django.tasks framework as this Django has it: ``django.tasks`` (Django 6) or
the ``django-tasks`` backport (Django 5.2), and what both sides of the backend
share of it.

The producer side (:mod:`deferred.django_tasks.backend`, enqueueing) and the worker
side (:mod:`deferred.worker.django_tasks`, running) both send the framework's
signals, finish its ``TaskResult`` and know :class:`ReturnValueNotJSON`;
they find them here, whichever package provides the framework.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from contextvars import ContextVar
from importlib import metadata
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone


def _framework_package() -> str:
    """``django.tasks`` (Django 6), else the ``django_tasks`` backport (Django 5.2)."""
    for package in ("django.tasks", "django_tasks"):
        try:
            importlib.import_module(package)
        except ImportError:
            continue
        return package
    raise ImproperlyConfigured(
        "deferred.backends.RabbitMQBackend needs django.tasks (Django 6) or, on "
        "Django 5.2, the backport: pip install 'django-tasks>=0.12'."
    )


#: The oldest django-tasks (the backport, on Django 5.2) the backend works with:
#: 0.12 follows Django 6's django.tasks API (its SUCCESSFUL status, for one;
#: older releases say SUCCEEDED, and every job would fail at its end).
MIN_BACKPORT = (0, 12)


def check_backport_release(version: str) -> None:
    """Refuse a django-tasks older than ``MIN_BACKPORT`` at once, by its version."""
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if release < MIN_BACKPORT:
        raise ImproperlyConfigured(
            f"deferred.backends.RabbitMQBackend needs django-tasks 0.12 or newer; "
            f"{version} is installed: pip install -U 'django-tasks>=0.12'."
        )


package = _framework_package()
if package == "django_tasks":
    check_backport_release(metadata.version("django-tasks"))
api = importlib.import_module(package)
base = importlib.import_module(f"{package}.base")
exceptions = importlib.import_module(f"{package}.exceptions")
signals = importlib.import_module(f"{package}.signals")
TaskResultDoesNotExist = exceptions.TaskResultDoesNotExist
BaseTaskBackend: Any = importlib.import_module(f"{package}.backends.base").BaseTaskBackend
# The backport names its exceptions with an "Error" suffix.
InvalidTask = getattr(exceptions, "InvalidTask", None) or exceptions.InvalidTaskError
InvalidTaskBackend = (
    getattr(exceptions, "InvalidTaskBackend", None) or exceptions.InvalidTaskBackendError
)
FrameworkTask = base.Task
TaskContext = base.TaskContext
TaskError = base.TaskError
TaskResult = base.TaskResult
TaskResultStatus = base.TaskResultStatus
#: The queue name ``@task`` gives a task that names none.
DEFAULT_TASK_QUEUE_NAME: str = base.DEFAULT_TASK_QUEUE_NAME


def _json_normalizer() -> Any:
    """The framework's own ``normalize_json`` (what its backends make of a return value),
    or ``json.loads(json.dumps(...))`` where it has none."""
    for module in ("django.utils.json", f"{package}.utils"):
        try:
            return importlib.import_module(module).normalize_json
        except (ImportError, AttributeError):
            continue
    return lambda value: json.loads(json.dumps(value))


normalize_json = _json_normalizer()


class ReturnValueNotJSON(TypeError):
    """A django.tasks task returned a value JSON cannot carry. Its result is FAILED with
    this error, as the framework's own backends make it, and it is not retried: the
    function ran, and would return the same again."""

    # The path its results record: the public one.
    __module__ = "deferred.backends"


logger = logging.getLogger("deferred.backends")

#: The result ``enqueue()`` is about to return, while a test mode may run the
#: task inline (``deferred.testing.eager()``): that run then updates it, as
#: the framework's ImmediateBackend does, instead of a result nobody sees.
inline_result: ContextVar[Any] = ContextVar("deferred_enqueuing", default=None)


def send(name: str, sender: type, result: Any) -> None:
    """Send a framework signal; a receiver that raises is logged, never fatal.

    By the time ``task_enqueued`` is sent the job is on the broker, and other
    jobs of the same transaction may still be waiting for their on-commit
    callback: a receiver's bug must neither lose those nor make the caller
    retry (and so duplicate) a job that was published. Likewise a job's
    outcome is its function's, not a receiver's.
    """
    for receiver, response in getattr(signals, name).send_robust(sender, task_result=result):
        if isinstance(response, Exception):
            logger.error(
                "A receiver of django.tasks' %s signal raised (job %s): %s",
                name,
                result.id,
                receiver,
                exc_info=response,
            )


def finish(result: Any, status: Any) -> None:
    # TaskResult is frozen; the framework's own backends update it this way.
    object.__setattr__(result, "status", status)
    object.__setattr__(result, "finished_at", timezone.now())
