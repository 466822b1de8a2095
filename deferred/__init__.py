"""deferred: run a Django function later, after its own delay, on plain RabbitMQ.

from deferred import task, defer

@task
def send_reminder(reminder_id): ...

defer(send_reminder, timedelta(hours=24), reminder.pk)
"""

from deferred.broker import BrokerError, BrokerUnavailable, TopologyNotDeclared
from deferred.publishing import defer
from deferred.tasks import Task, task

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "Task",
    "TopologyNotDeclared",
    "defer",
    "task",
]
