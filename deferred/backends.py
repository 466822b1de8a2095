"""A django.tasks backend, ``deferred.backends.RabbitMQBackend``: the path
``TASKS`` names.

Django 6 ships the ``django.tasks`` API (``@task``, ``.enqueue()``,
``.using(run_after=...)``) with no production backend; Django 5.2 gets the
same API from the ``django-tasks`` backport. This backend puts such tasks on
the same delay topology, on-commit rule and worker as ``defer()``: a task
enqueued here is a job like any other, so ``run_deferred_worker`` runs both
kinds from the same queues.

The public face of :mod:`deferred.django_tasks.backend` (enqueueing, results),
:mod:`deferred.worker.django_tasks` (running) and
:mod:`deferred.django_tasks.framework` (the framework as this Django has it).
"""

from deferred.django_tasks.backend import RabbitMQBackend
from deferred.django_tasks.framework import InvalidTask, InvalidTaskBackend, ReturnValueNotJSON

__all__ = ["InvalidTask", "InvalidTaskBackend", "RabbitMQBackend", "ReturnValueNotJSON"]
