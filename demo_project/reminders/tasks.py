"""The deferred tasks of the demo: a reminder, and a digest every minute.

Found by the ``deferred`` app's autodiscovery of ``tasks.py`` modules, so the
worker knows it by name before the first message arrives.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import OperationalError, transaction
from django.utils import timezone

from deferred import current_job, task
from demo_project.reminders.models import Digest, Reminder

logger = logging.getLogger(__name__)


# An explicit name: it is what the messages carry, so it must survive a move
# of this function to another module while jobs are still waiting.
# A locked or briefly unavailable database is worth another try; any other
# error goes to the failed queue at once.
@task(
    name="reminders.send_reminder",
    max_retries=3,
    retry_backoff=[0.5, 2, 5],
    retry_for=(OperationalError,),
)
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
        if reminder.cancelled_at is not None:
            # The worker drops a cancelled job; this covers a cancel that came
            # while the job was already running.
            logger.info("Reminder %s was cancelled; not sending it.", reminder_id)
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


# A recurring job, scheduled every minute by DEFERRED["SCHEDULES"] in the demo's
# settings (the same as @task(schedule=every(minutes=1)) here, but a project that
# only installs this app, such as the test suite, does not get it scheduled).
# The worker that holds the scheduler's lease defers each occurrence, once,
# through the same delay queues as the reminders.
@task(name="reminders.digest")
def digest() -> None:
    """Count the reminders sent in the minute before this occurrence.

    ``current_job().occurrence`` is the scheduled instant, the same on a
    repeated run, so the row it keys is written once.
    """
    job = current_job()
    occurrence = job.occurrence if job and job.occurrence else timezone.now()
    sent = Reminder.objects.filter(
        ran_at__gt=occurrence - timedelta(minutes=1), ran_at__lte=occurrence
    ).count()
    _, created = Digest.objects.get_or_create(
        occurrence=occurrence, defaults={"reminders_sent": sent}
    )
    if created:
        logger.info("Digest for %s: %d reminder(s) sent.", occurrence.isoformat(), sent)
