"""deferred: run a Django function later, after its own delay, on plain RabbitMQ.

from deferred import cancel, defer, task

@task
def send_reminder(reminder_id): ...

job_id = defer(send_reminder, timedelta(hours=24), reminder.pk)
deferred.result(job_id).state  # "pending", later "running", "succeeded"...
cancel(job_id)  # changed our mind: it will not run
"""

#: The package's version: the one place it is written (pyproject.toml reads it).
__version__ = "0.1.0"

from deferred.broker import (
    BrokerError,
    BrokerUnavailable,
    MessageTooLarge,
    PublishRefused,
    TopologyNotDeclared,
)
from deferred.core.context import current_job
from deferred.core.limits import TimeLimitExceeded
from deferred.core.pending_jobs import PendingJob
from deferred.core.retries import Exponential, Retry
from deferred.core.schedule import cron, every
from deferred.producer.asynchronous import adefer, adefer_many
from deferred.producer.publishing import defer, defer_many
from deferred.producer.tasks import Task, task
from deferred.records.cancels import cancel, cancel_many
from deferred.records.changes import JobNotPending, reschedule, run_now
from deferred.records.listing import pending
from deferred.records.results import Result, aresult, result

from deferred import testing  # isort: skip  # after the names it uses

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "Exponential",
    "JobNotPending",
    "MessageTooLarge",
    "PendingJob",
    "PublishRefused",
    "Result",
    "Retry",
    "Task",
    "TimeLimitExceeded",
    "TopologyNotDeclared",
    "__version__",
    "adefer",
    "adefer_many",
    "aresult",
    "cancel",
    "cancel_many",
    "cron",
    "current_job",
    "defer",
    "defer_many",
    "every",
    "pending",
    "reschedule",
    "result",
    "run_now",
    "task",
    "testing",
]
