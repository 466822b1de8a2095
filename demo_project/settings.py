"""Settings for the demo project, all read from the environment.

This is the only module that reads environment variables: everything else asks
``django.conf.settings``, so configuration has one place to look at. The
defaults make ``manage.py runserver`` work on a laptop with a local RabbitMQ;
anything that should differ in production (``DEBUG``, ``SECRET_KEY``,
``ALLOWED_HOSTS``, ``DATABASE_URL``) is an environment variable.
"""

from pathlib import Path

import environ

from deferred.core.schedule import every

#: The repository root, where ``manage.py`` lives.
BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

DEBUG = env.bool("DEBUG", default=True)
# Deliberately named so that nobody mistakes it for a real key.
SECRET_KEY = env.str("SECRET_KEY", default="django-insecure-demo-only-do-not-use-in-production")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # Before the admin: its admin/index.html adds a link to the status page.
    "deferred",
    "django.contrib.admin",
    "demo_project.reminders",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "demo_project.urls"
WSGI_APPLICATION = "demo_project.wsgi.application"
ASGI_APPLICATION = "demo_project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'demo.sqlite3'}"),
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
USE_I18N = False

STATIC_URL = "static/"

DEFERRED = {
    # One URL, or several separated by commas (the nodes of a cluster).
    "BROKER_URL": env.list(
        "DEFERRED_BROKER_URL", default=["amqp://guest:guest@127.0.0.1:5672/%2F"]
    ),
    # A prefix of its own, so the demo never shares queues with another app on the broker.
    "PREFIX": env.str("DEFERRED_PREFIX", default="deferred-demo"),
    "QUEUES": ["default"],
    # "quorum" for replicated queues on a cluster.
    "QUEUE_TYPE": env.str("DEFERRED_QUEUE_TYPE", default="classic"),
    # Recurring jobs by task name (the page's "Digest" table).
    "SCHEDULES": {"reminders.digest": every(minutes=1)},
}
if env.str("DEFERRED_MANAGEMENT_URL", default=""):
    DEFERRED["MANAGEMENT_URL"] = env.list("DEFERRED_MANAGEMENT_URL")

# The worker logs one line per job (lateness, outcome, duration): show them.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "loggers": {
        "deferred": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        "demo_project": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
    },
}
