"""The one page of the demo: schedule a reminder, watch it run.

The reminder's row and its job are created in one transaction: ``defer()``
publishes after the commit, so the worker never receives a job whose row is
not visible yet, and a rolled-back request leaves no job behind.
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from deferred import BrokerError, cancel, defer
from demo_project.reminders.forms import ReminderForm
from demo_project.reminders.models import Digest, Reminder
from demo_project.reminders.tasks import send_reminder

#: How many reminders the page lists, newest first.
LIST_LENGTH = 50
#: How many runs of the recurring digest the page lists.
DIGESTS_SHOWN = 5
#: Seconds between reloads of the page while a reminder is pending.
REFRESH_SECONDS = 2


def schedule_reminder(message: str, delay_seconds: float) -> Reminder:
    """Store a reminder and defer its job, published when the transaction commits."""
    now = timezone.now()
    with transaction.atomic():
        reminder = Reminder.objects.create(
            message=message,
            delay_seconds=delay_seconds,
            created_at=now,
            due_at=now + timedelta(seconds=delay_seconds),
        )
        # The row's own due time: the page and the job agree on when it is due.
        reminder.job_id = defer(send_reminder, reminder.due_at, reminder.pk)
        reminder.save(update_fields=["job_id"])
    return reminder


@require_http_methods(["GET", "POST"])
def index(request: HttpRequest) -> HttpResponse:
    """Show the form and the latest reminders; on POST, schedule one (post/redirect/get)."""
    if request.method == "POST":
        form = ReminderForm(request.POST)
        if form.is_valid():
            reminder = schedule_reminder(
                form.cleaned_data["message"], form.cleaned_data["delay_seconds"]
            )
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
        "digests": list(Digest.objects.all()[:DIGESTS_SHOWN]),
        # Reload only while there is something to watch.
        "refresh_seconds": REFRESH_SECONDS if any(r.pending for r in reminders) else None,
    }
    return render(request, "reminders/index.html", context)


@require_POST
def cancel_reminder(request: HttpRequest, pk: int) -> HttpResponse:
    """Cancel a pending reminder: its job is cancelled in the broker, and never runs.

    No "cancelled" check in the task is needed: the worker drops the job.
    The row only records the cancel, for the page.
    """
    with transaction.atomic():
        reminder = Reminder.objects.select_for_update().filter(pk=pk).first()
        if reminder is None or not reminder.pending:
            messages.warning(request, "That reminder is no longer pending.")
            return redirect("reminders:index")
        try:
            cancel(reminder.job_id)
        except (BrokerError, ValueError) as exc:  # ValueError: a row with no job id
            messages.error(request, f"Could not cancel the reminder: {exc}")
            return redirect("reminders:index")
        reminder.cancelled_at = timezone.now()
        reminder.save(update_fields=["cancelled_at"])
    messages.success(request, f"Reminder cancelled (job {reminder.job_id}).")
    return redirect("reminders:index")


@require_GET
def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness probe: the process answers; it checks neither the database nor the broker."""
    return HttpResponse("ok", content_type="text/plain")
