"""The one page of the demo: schedule a reminder, watch it run (or fail).

The page refreshes only its live part (the reminders and the digest, from
``live``) by a small script, so that what the user is typing and the
confirmation stay put; without JavaScript it reloads whole, as a fallback.

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

from deferred import BrokerError, JobNotPending, cancel, defer, pending, reschedule, run_now
from demo_project.reminders.forms import ReminderForm
from demo_project.reminders.models import ChangeRequest, Digest, Outcome, Reminder
from demo_project.reminders.tasks import (
    CHANGES_DELAY_S,
    CHANGES_KEY,
    changes_digest,
    send_reminder,
)

#: How many reminders the page lists, newest first.
LIST_LENGTH = 50
#: How many jobs waiting in the broker the page lists, soonest first.
WAITING_SHOWN = 10
#: "Postpone": this much later than the reminder is due.
POSTPONE = timedelta(minutes=1)
#: How many runs of the recurring digest the page lists.
DIGESTS_SHOWN = 5
#: Seconds between refreshes of the live part while a reminder is pending.
REFRESH_SECONDS = 2
#: Seconds between refreshes otherwise: the digest still changes every minute.
IDLE_REFRESH_SECONDS = 15

#: The favicon: an SVG, which every current browser takes.
FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 64 64">'
    '<circle cx="32" cy="32" r="28" fill="#2f6fdf"/>'
    '<path d="M32 14v19l12 8" stroke="#fff" stroke-width="6" fill="none" '
    'stroke-linecap="round" stroke-linejoin="round"/></svg>'
)


def schedule_reminder(message: str, delay_seconds: float, outcome: str = Outcome.RUN) -> Reminder:
    """Store a reminder and defer its job, published when the transaction commits."""
    now = timezone.now()
    with transaction.atomic():
        reminder = Reminder.objects.create(
            message=message,
            delay_seconds=delay_seconds,
            created_at=now,
            due_at=now + timedelta(seconds=delay_seconds),
            outcome=outcome,
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
                form.cleaned_data["message"],
                form.cleaned_data["delay_seconds"],
                form.cleaned_data["outcome"] or Outcome.RUN,
            )
            then = (
                ""
                if reminder.outcome == Outcome.RUN
                else f", then {reminder.get_outcome_display().lower()}"
            )
            messages.success(
                request,
                f"Reminder scheduled to run in {reminder.delay_seconds:g} s{then} "
                f"(job {reminder.job_id}).",
            )
            return redirect("reminders:index")
    else:
        form = ReminderForm()
    return render(request, "reminders/index.html", {"form": form, **_live_context()})


@require_POST
def request_changes_digest(request: HttpRequest) -> HttpResponse:
    """ "Send me a digest of my changes": each click defers the digest again, with one
    debounce key, so it goes out once, ``CHANGES_DELAY_S`` after the last click."""
    with transaction.atomic():
        change = ChangeRequest.objects.create()
        change.job_id = defer(changes_digest.using(key=CHANGES_KEY), CHANGES_DELAY_S)
        change.save(update_fields=["job_id"])
    messages.success(
        request,
        f"Digest requested: it goes out {CHANGES_DELAY_S} s after your last click "
        f"(job {change.job_id} replaces the jobs of the clicks before).",
    )
    return redirect("reminders:index")


@require_GET
def live(request: HttpRequest) -> HttpResponse:
    """The part of the page that changes: the reminders and the digest, for the page's script."""
    return render(request, "reminders/_live.html", _live_context())


def _live_context() -> dict[str, object]:
    reminders = list(Reminder.objects.order_by("-created_at", "-pk")[:LIST_LENGTH])
    changes = list(ChangeRequest.objects.all()[:DIGESTS_SHOWN])
    pending = any(r.pending for r in reminders) or any(c.sent_at is None for c in changes)
    return {
        **_waiting(),
        "reminders": reminders,
        "digests": list(Digest.objects.all()[:DIGESTS_SHOWN]),
        "changes": changes,
        "changes_delay_s": CHANGES_DELAY_S,
        "pending": pending,
        "refresh_seconds": REFRESH_SECONDS if pending else IDLE_REFRESH_SECONDS,
    }


def _waiting() -> dict[str, object]:
    """The reminders' jobs waiting in the broker, read from the ledger (no table)."""
    try:
        jobs = pending(task=send_reminder.name, limit=WAITING_SHOWN, timeout=5)
    except BrokerError as exc:
        return {"waiting": [], "waiting_error": str(exc)}
    return {"waiting": jobs}


@require_POST
def send_now(request: HttpRequest, job_id: str) -> HttpResponse:
    """Run a reminder's job now: the ledger's ``run_now()``; the reminder is due now."""
    return _move(request, job_id, now=True)


@require_POST
def postpone(request: HttpRequest, job_id: str) -> HttpResponse:
    """Move a reminder's job one minute later than it is due (``reschedule()``)."""
    return _move(request, job_id, now=False)


def _move(request: HttpRequest, job_id: str, *, now: bool) -> HttpResponse:
    with transaction.atomic():
        reminder = Reminder.objects.select_for_update().filter(job_id=job_id).first()
        try:
            if now:
                due = run_now(job_id)
            else:
                base = reminder.due_at if reminder is not None else timezone.now()
                due = reschedule(job_id, base + POSTPONE)
        except (JobNotPending, ValueError, BrokerError) as exc:
            messages.error(request, f"Could not move that reminder: {exc}")
            return redirect("reminders:index")
        if reminder is not None:
            # The row's due time follows its job's, so that lateness is measured from it.
            reminder.due_at = due
            reminder.save(update_fields=["due_at"])
    messages.success(
        request, f"Reminder job {job_id} is due {due:%H:%M:%S} UTC" + (" (now)." if now else ".")
    )
    return redirect("reminders:index")


@require_GET
def favicon(request: HttpRequest) -> HttpResponse:
    """The page's icon, also at /favicon.ico, where browsers look without being told."""
    response = HttpResponse(FAVICON, content_type="image/svg+xml")
    response["Cache-Control"] = "max-age=86400"
    return response


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
