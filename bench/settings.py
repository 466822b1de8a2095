"""Django settings for benchmark runs: the bench app and a throwaway PREFIX.

Values come from the environment so that the worker subprocesses the bench
starts use exactly the configuration the measuring process declared.
"""

import os

SECRET_KEY = "bench-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["deferred", "bench"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("BENCH_DB", "/tmp/deferred-bench.sqlite3"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DEFERRED = {
    "BROKER_URL": os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    "PREFIX": os.environ.get("BENCH_PREFIX", "deferred-bench"),
    "RADIX": int(os.environ.get("BENCH_RADIX", "2")),
    "RESOLUTION": float(os.environ.get("BENCH_RESOLUTION_S", "0.001")),
    "QUEUE_TYPE": os.environ.get("BENCH_QUEUE_TYPE", "classic"),
    "MAX_DELAY": 400 * 86400,
    "ON_COMMIT": False,
}

# The django.tasks backend, for the operate scenario.
TASKS = {"default": {"BACKEND": "deferred.backends.RabbitMQBackend"}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "deferred": {"handlers": ["stderr"], "level": os.environ.get("BENCH_LOG_LEVEL", "INFO")},
        "pika": {"level": "WARNING"},
    },
}
