"""App config for the reminders app."""

from django.apps import AppConfig


class RemindersConfig(AppConfig):
    name = "demo_project.reminders"
    label = "reminders"
    verbose_name = "Reminders"
    default_auto_field = "django.db.models.BigAutoField"
