"""Settings for the test suite: the deferred app, a task app, a throwaway PREFIX.

The PREFIX is unique per test run (and inherited by the worker subprocesses the
tests start), so tests never touch the demo's or another run's queues.
"""

import os
import tempfile
import uuid

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "deferred",
    "tests.testapp.apps.TestAppConfig",
    "demo_project.reminders",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.setdefault(
            "DEFERRED_TEST_DB", os.path.join(tempfile.gettempdir(), "deferred-tests.sqlite3")
        ),
    },
    # A second database, for on-commit publishing across two transactions.
    "other": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(tempfile.gettempdir(), "deferred-tests-other.sqlite3"),
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DEFERRED = {
    "BROKER_URL": os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    "PREFIX": os.environ.setdefault(
        "DEFERRED_TEST_PREFIX", f"deferred-test-{uuid.uuid4().hex[:8]}"
    ),
    "QUEUES": ["default", "other"],
    # Worker subprocesses of the poison-job tests run with other values.
    "QUEUE_TYPE": os.environ.get("DEFERRED_TEST_QUEUE_TYPE", "classic"),
    "DELIVERY_LIMIT": int(os.environ.get("DEFERRED_TEST_DELIVERY_LIMIT", "5")),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "deferred": {"handlers": ["stderr"], "level": "INFO"},
        "pika": {"level": "WARNING"},
    },
}
