"""The ``Reminder`` model: what was asked for, when it was due and when it ran.

Keeping both ``due_at`` and ``ran_at`` makes the demo show how late each job
ran, which is the number that matters for a delay queue.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class Outcome(models.TextChoices):
    """What the reminder's job does when it runs: the demo's "make it fail" choice."""

    RUN = "run", "Run"
    FAIL_ONCE = "fail_once", "Fail once, then succeed on its retry"
    ALWAYS_FAIL = "always_fail", "Always fail (ends in the failed list)"


class Reminder(models.Model):
    message = models.CharField(max_length=200)
    delay_seconds = models.FloatField()
    created_at = models.DateTimeField(default=timezone.now)
    due_at = models.DateTimeField()
    #: Set by the ``reminders.send_reminder`` task; ``None`` while pending.
    ran_at = models.DateTimeField(null=True, blank=True)
    #: The id ``defer()`` returned, to find the job in the worker's logs and to cancel it.
    job_id = models.CharField(max_length=64, blank=True)
    #: Set when the user cancelled the reminder: its job was cancelled and never runs.
    cancelled_at = models.DateTimeField(null=True, blank=True)
    #: Whether the job succeeds, or fails to show retries and the failed list.
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.RUN)
    #: Attempts made so far (retries included), as the task saw them.
    attempts = models.PositiveIntegerField(default=0)
    #: Set when the last attempt failed: the job is in deferred's failed list.
    failed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return self.message

    @property
    def pending(self) -> bool:
        return self.ran_at is None and self.cancelled_at is None and self.failed_at is None

    def fails_on(self, attempt: int) -> bool:
        """Whether attempt number ``attempt`` (1 for the first run) is to raise."""
        return self.outcome == Outcome.ALWAYS_FAIL or (
            self.outcome == Outcome.FAIL_ONCE and attempt == 1
        )

    @property
    def lateness_ms(self) -> float | None:
        """How long after ``due_at`` the job ran, in milliseconds; ``None`` while pending."""
        if self.ran_at is None:
            return None
        return (self.ran_at - self.due_at).total_seconds() * 1000


class Digest(models.Model):
    """One run of the recurring ``reminders.digest`` task: how many reminders were sent in
    the minute before its occurrence. Unique per occurrence, so a repeated run is a no-op."""

    occurrence = models.DateTimeField(unique=True)
    reminders_sent = models.PositiveIntegerField()
    ran_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-occurrence"]

    def __str__(self) -> str:
        return f"{self.occurrence:%H:%M}: {self.reminders_sent} sent"


class ChangeRequest(models.Model):
    """A click on "Send me a digest of my changes": each defers the digest with one
    debounce key, so only the latest click's job runs, and sends every request so far."""

    created_at = models.DateTimeField(default=timezone.now)
    #: The job this click deferred; superseded by the next click's, if any.
    job_id = models.CharField(max_length=64, blank=True)
    #: When the digest that covered this request went out; ``None`` while waiting.
    sent_at = models.DateTimeField(null=True, blank=True)
    #: The job that sent it: this request's own, or a later click's.
    sent_by = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.created_at:%H:%M:%S}: {'sent' if self.sent_at else 'waiting'}"
