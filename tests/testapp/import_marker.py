"""A module of an installed app that only a job naming it would import: tests
check that a job refused for its backend alias never imports it."""

try:
    from django.tasks import task
except ImportError:  # Django 5.2
    from django_tasks import task  # type: ignore[no-redef]


@task
def marked():
    return "imported"
