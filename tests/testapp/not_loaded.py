"""A django.tasks task in a module nothing imports: a job naming it must not
make the worker import this module."""

try:
    from django.tasks import task
except ImportError:  # Django 5.2
    from django_tasks import task  # type: ignore[no-redef]


@task
def hidden():
    raise AssertionError("a worker imported a module named by a message")
