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

_CLUSTER_URLS = os.environ.get("BENCH_BROKER_URLS")  # a cluster's nodes, comma-separated

DEFERRED: dict[str, object] = {
    "BROKER_URL": _CLUSTER_URLS.split(",")
    if _CLUSTER_URLS
    else os.environ.get("DEFERRED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    "PREFIX": os.environ.get("BENCH_PREFIX", "deferred-bench"),
    "RADIX": int(os.environ.get("BENCH_RADIX", "2")),
    "RESOLUTION": float(os.environ.get("BENCH_RESOLUTION_S", "0.001")),
    "QUEUE_TYPE": os.environ.get("BENCH_QUEUE_TYPE", "classic"),
    "DELAY_QUEUE_TYPE": os.environ.get("BENCH_DELAY_QUEUE_TYPE") or None,
    "MAX_DELAY": 400 * 86400,
    "ON_COMMIT": False,
}
if os.environ.get("BENCH_MANAGEMENT_URLS"):
    DEFERRED["MANAGEMENT_URL"] = os.environ["BENCH_MANAGEMENT_URLS"].split(",")
if os.environ.get("BENCH_STUCK_AFTER_S"):
    DEFERRED["STUCK_AFTER"] = float(os.environ["BENCH_STUCK_AFTER_S"])
if os.environ.get("BENCH_REPAIR_STUCK"):
    DEFERRED["REPAIR_STUCK"] = os.environ["BENCH_REPAIR_STUCK"] == "1"

# The signing scenario's unsigned runs: nothing signed, nothing checked.
if os.environ.get("BENCH_LEDGER") == "0":
    DEFERRED["LEDGER"] = False  # the cost of the ledger, measured against the default
if os.environ.get("BENCH_SIGNING") == "0":
    DEFERRED["SIGNING"] = False
    SECRET_KEY = ""

# The schedules scenario: bench.tick every BENCH_EVERY_S seconds.
if os.environ.get("BENCH_EVERY_S"):
    from deferred.core.schedule import every

    DEFERRED["SCHEDULES"] = {"bench.tick": every(seconds=float(os.environ["BENCH_EVERY_S"]))}

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
