"""The deferred task of the demo.

Found by the ``deferred`` app's autodiscovery of ``tasks.py`` modules, so the
worker knows it by name before the first message arrives.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from deferred import task
from demo_project.reminders.models import Reminder

logger = logging.getLogger(__name__)


# An explicit name: it is what the messages carry, so it must survive a move
# of this function to another module while jobs are still waiting.
@task(name="reminders.send_reminder")
def send_reminder(reminder_id: int) -> None:
    """Mark the reminder as sent, once.

    Delivery is at-least-once, so this may run twice for one job: the first
    run's time is kept. A reminder deleted while its job waited is not an
    error, just nothing left to do.
    """
    with transaction.atomic():
        # The row lock makes two concurrent runs of the same job agree on which
        # one came first (on databases that support it; SQLite serialises writes).
        reminder = Reminder.objects.select_for_update().filter(pk=reminder_id).first()
        if reminder is None:
            logger.info("Reminder %s no longer exists; nothing to send.", reminder_id)
            return
        if reminder.ran_at is not None:
            logger.info(
                "Reminder %s already ran at %s; ignoring the repeat.",
                reminder_id,
                reminder.ran_at.isoformat(),
            )
            return
        reminder.ran_at = timezone.now()
        # Only this column: the web request may be writing ``job_id`` meanwhile.
        reminder.save(update_fields=["ran_at"])
    logger.info(
        "Reminder %s sent: %r (%.1f ms late).", reminder_id, reminder.message, reminder.lateness_ms
    )
