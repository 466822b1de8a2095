"""django.tasks tasks (Django 6, or the django-tasks backport on 5.2) for the
backend's tests; the first is the example of Django's documentation."""

import functools
import json
import os
import time

from django.core.mail import send_mail

try:
    from django.tasks import task
except ImportError:  # Django 5.2
    from django_tasks import task  # type: ignore[no-redef]


@task
def email_users(emails, subject, message):
    return send_mail(subject=subject, message=message, from_email=None, recipient_list=emails)


@task(takes_context=True)
def flaky(context, path, failures):
    """Fails its first ``failures`` attempts; records each attempt number."""
    with open(path, "a") as f:
        f.write(json.dumps({"attempt": context.attempt, "id": context.task_result.id}) + "\n")
    if context.attempt <= failures:
        raise RuntimeError(f"attempt {context.attempt} fails")
    return context.attempt


@task
def double(n):
    return 2 * n


@task(queue_name="other")
def note(path, label):
    with open(path, "a") as f:
        f.write(json.dumps({"label": label, "at": time.time(), "pid": os.getpid()}) + "\n")


@task
async def note_async(path, label):
    with open(path, "a") as f:
        f.write(json.dumps({"label": label, "at": time.time(), "async": True}) + "\n")


@task
def spin(path, label):
    """Runs until its time limit stops it (OPTIONS["TIME_LIMIT"] in the tests)."""
    with open(path, "a") as f:
        f.write(json.dumps({"label": label, "event": "start"}) + "\n")
    while True:
        time.sleep(0.01)


@task
async def spin_async(path, label):
    """The same, on an event loop."""
    import asyncio

    with open(path, "a") as f:
        f.write(json.dumps({"label": label, "event": "start"}) + "\n")
    await asyncio.sleep(60)


@task
def returns_a_lambda():
    """Returns what JSON cannot carry (the framework's own backends mark it FAILED)."""
    return lambda: None


def exactly_once(func):
    """A decorator in the manner of django-periodic-tasks' ``@exactly_once``: its wrapper
    takes a keyword the function does not, and drops it."""

    @functools.wraps(func)
    def wrapper(*args, _execution_id=None, **kwargs):
        return func(*args, **kwargs)

    return wrapper


@task
@exactly_once
def wrapped_double(n):
    return 2 * n


@task(takes_context=True)
def own_id(context):
    """Returns its own result id (the reference suites' ``get_task_id``)."""
    return context.task_result.id


@task
def fails_with(kind, message):
    """Raises ``ValueError(message)``, or ``SystemExit(message)`` (the reference suites'
    ``failing_task_value_error`` and ``failing_task_system_exit``)."""
    raise {"value": ValueError, "exit": SystemExit}[kind](message)


# The reference suites' test tasks (Django's tests/tasks/tasks.py, django-tasks' tests/tasks.py),
# for tests/django_tasks/test_reference.py.


@task
def noop(*args, **kwargs):
    """The reference suites' ``noop_task``."""
    return None


@task
async def noop_async(*args, **kwargs):
    """The reference suites' ``noop_task_async``."""
    return None


@task
def meaning_of_life():
    """The reference suites' ``calculate_meaning_of_life``."""
    return 42


@task
def echo(*args, **kwargs):
    """Returns what it was given, as JSON carries it back."""
    return {"args": args, "kwargs": kwargs}


@task
def complex_exception():
    """The reference suites' ``complex_exception``."""
    raise ValueError(ValueError("This task failed"))


@task
def interrupts(message):
    """Raises ``KeyboardInterrupt`` (the reference suites' ``failing_task_keyboard_interrupt``)."""
    raise KeyboardInterrupt(message)


@task
def exits():
    """Calls ``exit(1)`` (the reference suites' ``exit_task``)."""
    import sys

    sys.exit(1)


@task
def sleep_for(seconds):
    """The reference suites' ``sleep_for``."""
    time.sleep(seconds)


@task(takes_context=True)
def attempt_is(context, attempt):
    """Fails unless its context is a ``TaskContext`` of attempt ``attempt`` (the reference
    suites' ``test_context``)."""
    try:
        from django.tasks import TaskContext
    except ImportError:  # Django 5.2
        from django_tasks import TaskContext  # type: ignore[no-redef]

    assert isinstance(context, TaskContext), type(context)
    assert context.attempt == attempt, context.attempt


@task
def blocks_until(path, timeout=30):
    """Runs until the file ``path`` exists (a test releases it), ``timeout`` s at most:
    a task that is surely still running when a test signals its worker."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)
    return "released"
