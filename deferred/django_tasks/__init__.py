"""The django.tasks backend's enqueueing and results side, and the framework as this
Django has it (``django.tasks``, or the ``django-tasks`` backport).

Above ``records`` (results are read from there) and below ``worker``, whose
:mod:`deferred.worker.django_tasks` runs the tasks; ``deferred.backends`` is
the path ``TASKS`` names.
"""
