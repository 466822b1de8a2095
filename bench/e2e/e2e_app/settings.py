"""Settings for the harness: the library's defaults, a throwaway PREFIX.

``E2E_DEFERRED`` (JSON) adds settings on top, such as ``QUEUE_TYPE``; ``E2E_CACHES``
(JSON), if set, is ``CACHES`` (for ``RESULT_CACHE``).
"""

import json
import os

SECRET_KEY = "e2e-bench-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["deferred", "e2e_app"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("E2E_DB", "/tmp/deferred-e2e.sqlite3"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DEFERRED: dict[str, object] = {
    "BROKER_URL": os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    "PREFIX": os.environ.get("E2E_PREFIX", "deferred-e2e"),
    **json.loads(os.environ.get("E2E_DEFERRED", "{}")),
}

if os.environ.get("E2E_CACHES"):
    CACHES = json.loads(os.environ["E2E_CACHES"])

# What a production worker logs: a line per job at INFO.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "deferred": {"handlers": ["stderr"], "level": os.environ.get("E2E_LOG_LEVEL", "INFO")},
        "pika": {"level": "WARNING"},
    },
}
