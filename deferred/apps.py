"""Django app config: autodiscover ``tasks.py`` modules and register system checks."""

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class DeferredConfig(AppConfig):
    name = "deferred"
    verbose_name = "Deferred jobs"

    def ready(self) -> None:
        from deferred import checks  # noqa: F401 - registers the checks

        _task_framework_checks()

        # The worker finds tasks by name in the registry, so every installed
        # app's tasks must be registered before the first message arrives.
        autodiscover_modules("tasks")


def _task_framework_checks() -> None:
    """Register the task framework's system check (every ``TASKS`` backend's ``check()``,
    ``deferred.E010`` and ``deferred.E011`` among them) when ``TASKS`` names this app's
    backend.

    Django 6 registers it as ``django.tasks`` is imported, which a project's
    tasks may not do before ``manage.py check`` runs; the django-tasks backport
    (Django 5.2) only with ``"django_tasks"`` in ``INSTALLED_APPS``, which
    this backend does not need. Registering the same function again is a no-op.
    """
    import importlib

    from django.conf import settings

    backends = getattr(settings, "TASKS", {}) or {}
    if not any(
        isinstance(config, dict) and config.get("BACKEND") == "deferred.backends.RabbitMQBackend"
        for config in backends.values()
    ):
        return
    for module in ("django.tasks.checks", "django_tasks.checks"):
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        return
