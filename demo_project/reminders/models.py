"""The ``Reminder`` model: what was asked for, when it was due and when it ran.

Keeping both ``due_at`` and ``ran_at`` makes the demo show how late each job
ran, which is the number that matters for a delay queue.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


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

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return self.message

    @property
    def pending(self) -> bool:
        return self.ran_at is None and self.cancelled_at is None

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
