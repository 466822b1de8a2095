"""django.tasks tasks in a module nothing imports at start (not ``tasks.py``):
the worker imports it for a job naming it, as django.tasks' own workers do."""

import os
from pathlib import Path

try:
    from django.tasks import task
except ImportError:  # Django 5.2
    from django_tasks import task  # type: ignore[no-redef]


@task
def stamp(path):
    Path(path).write_text(f"ran in {os.getpid()}")


def helper(path):
    """Not a task: a job naming it must not call it."""
    Path(path).write_text("a plain function ran")
