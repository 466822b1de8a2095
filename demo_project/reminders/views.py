"""The one page of the demo: schedule a reminder, watch it run.

The reminder's row is committed *before* its job is published: with a delay
of a few milliseconds the worker could otherwise pick the job up before the
row is visible to it, and find nothing to do. If publishing fails, the row is
deleted again, so the list never shows a reminder that will never run.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods

from deferred import defer
from deferred.broker import BrokerError
from demo_project.reminders.forms import ReminderForm
from demo_project.reminders.models import Reminder
from demo_project.reminders.tasks import send_reminder

logger = logging.getLogger(__name__)

#: How many reminders the page lists, newest first.
LIST_LENGTH = 50
#: Seconds between reloads of the page while a reminder is pending.
REFRESH_SECONDS = 2


def schedule_reminder(message: str, delay_seconds: float) -> Reminder:
    """Store a reminder and defer its job; raise ``BrokerError`` if the broker cannot take it.

    Must not run inside an outer transaction (``ATOMIC_REQUESTS`` is off): the
    row has to be committed before the job is published.
    """
    delay = timedelta(seconds=delay_seconds)
    now = timezone.now()
    with transaction.atomic():
        reminder = Reminder.objects.create(
            message=message, delay_seconds=delay_seconds, created_at=now, due_at=now + delay
        )
    try:
        # The row's own due time: the page and the job agree on when it is due.
        job_id = defer(send_reminder, reminder.due_at, reminder.pk)
    except Exception:
        # Nothing was published: a reminder that can never run must not stay listed.
        reminder.delete()
        raise
    reminder.job_id = job_id
    # Only this column: the job may already have run and set ``ran_at``.
    reminder.save(update_fields=["job_id"])
    return reminder


@require_http_methods(["GET", "POST"])
def index(request: HttpRequest) -> HttpResponse:
    """Show the form and the latest reminders; on POST, schedule one (post/redirect/get)."""
    status = 200
    if request.method == "POST":
        form = ReminderForm(request.POST)
        if form.is_valid():
            try:
                reminder = schedule_reminder(
                    form.cleaned_data["message"], form.cleaned_data["delay_seconds"]
                )
            except BrokerError as exc:
                logger.error("Could not schedule a reminder: %s", exc)
                messages.error(
                    request,
                    "The broker is unavailable, so the reminder was not scheduled. "
                    "Please try again in a moment.",
                )
                status = 503
            else:
                messages.success(
                    request,
                    f"Reminder scheduled to run in {reminder.delay_seconds:g} s "
                    f"(job {reminder.job_id}).",
                )
                return redirect("reminders:index")
    else:
        form = ReminderForm()

    reminders = list(Reminder.objects.order_by("-created_at", "-pk")[:LIST_LENGTH])
    context = {
        "form": form,
        "reminders": reminders,
        # Reload only while there is something to watch.
        "refresh_seconds": REFRESH_SECONDS if any(r.ran_at is None for r in reminders) else None,
    }
    return render(request, "reminders/index.html", context, status=status)


@require_GET
def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness probe: the process answers; it checks neither the database nor the broker."""
    return HttpResponse("ok", content_type="text/plain")
