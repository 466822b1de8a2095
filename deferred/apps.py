"""Django app config: autodiscover ``tasks.py`` modules and register system checks."""

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class DeferredConfig(AppConfig):
    name = "deferred"
    verbose_name = "Deferred jobs"

    def ready(self) -> None:
        from deferred import checks  # noqa: F401 - registers the checks

        # The worker finds tasks by name in the registry, so every installed
        # app's tasks must be registered before the first message arrives.
        autodiscover_modules("tasks")
