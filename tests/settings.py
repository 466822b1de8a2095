"""Settings for the test suite: the deferred app with its status page, a task app, a
throwaway PREFIX.

The PREFIX is unique per test run (and inherited by the worker subprocesses the
tests start), so tests never touch the demo's or another run's queues.
"""

import os
import tempfile
import uuid

import django

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # Before the admin, so that its admin/index.html adds the status page link.
    "deferred",
    "django.contrib.admin",
    "tests.testapp.apps.TestAppConfig",
    "demo_project.reminders",
]
# The status page: the admin's login, sessions and messages.
ROOT_URLCONF = "tests.urls"
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    }
]
STATIC_URL = "static/"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.setdefault(
            "DEFERRED_TEST_DB", os.path.join(tempfile.gettempdir(), "deferred-tests.sqlite3")
        ),
        # A file, not Django's default shared-cache memory database: there a worker
        # thread's open write transaction makes the test's own reads fail at once with
        # "database table is locked" (SQLite's busy timeout does not cover it). In WAL
        # mode readers never wait for the writer, and writers wait their turn.
        "TEST": {
            "NAME": os.path.join(tempfile.gettempdir(), f"deferred-test-db-{os.getpid()}.sqlite3")
        },
        "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=OFF;"},
    },
    # A second database, for on-commit publishing across two transactions.
    "other": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(tempfile.gettempdir(), "deferred-tests-other.sqlite3"),
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

#: Each run's own PREFIX. Under pytest-xdist every worker process adds its name
#: (gw0, gw1...) once, since they inherit the first process's environment: workers
#: side by side never share a queue. The subprocesses a test starts inherit the
#: finished name, or are given a PREFIX of their own, which stays as it is.
PREFIX = os.environ.setdefault("DEFERRED_TEST_PREFIX", f"deferred-test-{uuid.uuid4().hex[:8]}")
_xdist_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _xdist_worker and os.environ.get("DEFERRED_TEST_PREFIX_OF") != _xdist_worker:
    PREFIX = os.environ["DEFERRED_TEST_PREFIX"] = f"{PREFIX}-{_xdist_worker}"
    os.environ["DEFERRED_TEST_PREFIX_OF"] = _xdist_worker

DEFERRED: dict[str, object] = {
    # Worker subprocesses of the cluster tests get a list of node URLs.
    "BROKER_URL": (
        os.environ["DEFERRED_TEST_BROKER_URLS"].split(",")
        if os.environ.get("DEFERRED_TEST_BROKER_URLS")
        else os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F").split(
            ","
        )
    ),
    "PREFIX": PREFIX,
    "QUEUES": ["default", "other"],
    # Worker subprocesses of the poison-job tests run with other values.
    "QUEUE_TYPE": os.environ.get("DEFERRED_TEST_QUEUE_TYPE", "classic"),
    # The restart tests run with quorum delay queues too.
    "DELAY_QUEUE_TYPE": os.environ.get("DEFERRED_TEST_DELAY_QUEUE_TYPE") or None,
    "DELIVERY_LIMIT": int(os.environ.get("DEFERRED_TEST_DELIVERY_LIMIT", "5")),
    # Worker subprocesses of the infrastructure-as-code tests run with DECLARE off.
    "DECLARE": os.environ.get("DEFERRED_TEST_DECLARE", "true") == "true",
}
if os.environ.get("DEFERRED_TEST_MANAGEMENT_URLS"):
    DEFERRED["MANAGEMENT_URL"] = os.environ["DEFERRED_TEST_MANAGEMENT_URLS"].split(",")
# Worker subprocesses of the last-mile tests hold jobs for seconds.
if os.environ.get("DEFERRED_TEST_HOLD_WINDOW"):
    DEFERRED["HOLD_WINDOW"] = float(os.environ["DEFERRED_TEST_HOLD_WINDOW"])
if os.environ.get("DEFERRED_TEST_HOLD_PREFETCH"):
    DEFERRED["HOLD_PREFETCH"] = int(os.environ["DEFERRED_TEST_HOLD_PREFETCH"])
# Worker subprocesses of the paused-worker test lose their connection sooner.
if os.environ.get("DEFERRED_TEST_WORKER_HEARTBEAT"):
    DEFERRED["WORKER_HEARTBEAT"] = int(os.environ["DEFERRED_TEST_WORKER_HEARTBEAT"])
# Worker subprocesses of the time-limit tests give up on a job sooner.
if os.environ.get("DEFERRED_TEST_TIME_LIMIT_GRACE"):
    DEFERRED["TIME_LIMIT_GRACE"] = float(os.environ["DEFERRED_TEST_TIME_LIMIT_GRACE"])
if os.environ.get("DEFERRED_TEST_MAX_DELAY"):
    DEFERRED["MAX_DELAY"] = float(os.environ["DEFERRED_TEST_MAX_DELAY"])
if os.environ.get("DEFERRED_TEST_STUCK_AFTER"):
    DEFERRED["STUCK_AFTER"] = float(os.environ["DEFERRED_TEST_STUCK_AFTER"])
if os.environ.get("DEFERRED_TEST_REPAIR_STUCK"):
    DEFERRED["REPAIR_STUCK"] = os.environ["DEFERRED_TEST_REPAIR_STUCK"] == "true"
# Worker subprocesses of the recurring-job tests schedule tests.tick.
if os.environ.get("DEFERRED_TEST_EVERY"):
    from deferred.core.schedule import every

    DEFERRED["SCHEDULES"] = {
        "tests.tick": every(
            seconds=float(os.environ["DEFERRED_TEST_EVERY"]),
            misfire=os.environ.get("DEFERRED_TEST_MISFIRE", "coalesce"),
        )
    }

# The django.tasks backend (Django 6, or Django 5.2 with the django-tasks backport).
TASKS = {"default": {"BACKEND": "deferred.backends.RabbitMQBackend"}}
# Worker subprocesses write mail to files the tests read.
_MAIL_DIR = os.environ.get(
    "DEFERRED_TEST_MAIL_DIR", os.path.join(tempfile.gettempdir(), "deferred-test-mail")
)
if django.VERSION >= (6, 1):
    MAILERS = {
        "default": {
            "BACKEND": "django.core.mail.backends.filebased.EmailBackend",
            "OPTIONS": {"file_path": _MAIL_DIR},
        }
    }
else:
    EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
    EMAIL_FILE_PATH = _MAIL_DIR

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "deferred": {"handlers": ["stderr"], "level": "INFO"},
        "pika": {"level": "WARNING"},
    },
}
