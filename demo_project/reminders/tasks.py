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
from demo_project.reminders.models import ChangeRequest, Digest, Reminder

logger = logging.getLogger(__name__)


#: Retries after a failed attempt: with the backoff below, a reminder that
#: always fails reaches the failed list about 7.5 s after it was due.
RETRIES = 3


class DemoFailure(Exception):
    """Raised on purpose, for a reminder scheduled with a "make it fail" choice."""


# An explicit name: it is what the messages carry, so it must survive a move
# of this function to another module while jobs are still waiting.
# A locked or briefly unavailable database is worth another try, and so is the
# demo's own failure; any other error goes to the failed list at once.
@task(
    name="reminders.send_reminder",
    max_retries=RETRIES,
    retry_backoff=[0.5, 2, 5],
    retry_for=(OperationalError, DemoFailure),
)
def send_reminder(reminder_id: int) -> None:
    """Mark the reminder as sent, once; or fail, when the form asked for it.

    Delivery is at-least-once, so this may run twice for one job: the first
    run's time is kept. A reminder deleted while its job waited is not an
    error, just nothing left to do.
    """
    job = current_job()
    attempt = job.attempt if job else 1
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
        reminder.attempts = attempt
        failing = reminder.fails_on(attempt)
        # Set by the last attempt (the worker puts the job in the failed list);
        # cleared by a retry from that list, which starts again at attempt 1.
        reminder.failed_at = timezone.now() if failing and attempt > RETRIES else None
        if not failing:
            reminder.ran_at = timezone.now()
        # Only these columns: the web request may be writing ``job_id`` meanwhile.
        reminder.save(update_fields=["attempts", "ran_at", "failed_at"])
    # Raised after the commit, so that the page shows the attempt.
    if failing:
        raise DemoFailure(
            f"Reminder {reminder_id} failed on attempt {attempt}, as its form asked "
            f"({reminder.get_outcome_display()})."
        )
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


#: The one debounce key of the demo's "digest of my changes" (a project would add
#: the user's id: one key per user).
CHANGES_KEY = "demo:changes-digest"
#: Seconds after the last click that the digest goes out.
CHANGES_DELAY_S = 10


@task(name="reminders.changes_digest")
def changes_digest() -> None:
    """Send one digest for every request not sent yet.

    Deferred with the key ``CHANGES_KEY`` on each click: only the latest
    click's job runs, ``CHANGES_DELAY_S`` after it, and covers them all.
    """
    job = current_job()
    sent = ChangeRequest.objects.filter(sent_at__isnull=True).update(
        sent_at=timezone.now(), sent_by=job.id if job else ""
    )
    logger.info("Digest of changes sent, covering %d request(s).", sent)
