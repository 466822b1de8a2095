"""Tests of the reminders app, through the Django test client.

They run under the library's test settings, which have no URLconf, templates
or middleware of their own: the ``_web`` fixture supplies the demo's. The
tests that start a ``Worker`` need a running RabbitMQ; the others use the
test modes (``capture()``, ``eager()``) or call the task directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from deferred.conf import get_settings
from deferred.core.context import running
from deferred.records import failures
from deferred.testing import capture, eager
from deferred.worker import Worker
from demo_project.reminders.models import Outcome, Reminder
from demo_project.reminders.tasks import RETRIES, DemoFailure, send_reminder
from demo_project.reminders.views import schedule_reminder


@pytest.fixture(autouse=True)
def _web(settings: Any) -> Iterator[None]:
    """The web-facing settings the views need, without sessions (messages go in a cookie)."""
    settings.ROOT_URLCONF = "demo_project.urls"
    settings.MIDDLEWARE = [
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ]
    settings.MESSAGE_STORAGE = "django.contrib.messages.storage.cookie.CookieStorage"
    settings.TEMPLATES = [
        {
            "BACKEND": "django.template.backends.django.DjangoTemplates",
            "APP_DIRS": True,
            "OPTIONS": {
                "context_processors": [
                    "django.template.context_processors.request",
                    "django.contrib.messages.context_processors.messages",
                ],
            },
        }
    ]
    yield


def wait_for(predicate: Any, timeout: float) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


@contextmanager
def running_worker() -> Iterator[Worker]:
    """The topology declared and a worker consuming in a thread; stopped, and its thread
    ended, when the block ends. (transaction=True tests: it must see committed rows.)"""
    call_command("declare_delay_topology")
    worker = Worker(install_signal_handlers=False)
    thread = threading.Thread(target=worker.run, name="reminders-test-worker")
    thread.start()
    try:
        assert worker.consuming.wait(10), "the worker did not start consuming"
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def _reminder(**fields: Any) -> Reminder:
    now = timezone.now()
    return Reminder.objects.create(
        **{"message": "hello", "delay_seconds": 0.0, "due_at": now, **fields}
    )


@pytest.mark.django_db
def test_get_renders_the_form(client: Client) -> None:
    response = client.get("/")
    assert response.status_code == 200
    content = response.content.decode()
    assert 'name="message"' in content
    assert 'name="delay_seconds"' in content
    assert 'name="outcome"' in content
    assert "No reminders yet." in content
    # Nothing pending: not even the no-JavaScript fallback reloads the page.
    assert 'http-equiv="refresh"' not in content
    # The live part says how soon the page's script is to fetch it again.
    assert 'data-refresh="15"' in content and 'data-pending="false"' in content


@pytest.mark.django_db
def test_pending_reminder_makes_the_live_part_refresh_often(client: Client) -> None:
    _reminder(message="still waiting")
    content = client.get("/").content.decode()
    assert "still waiting" in content
    assert "pending" in content
    assert 'data-refresh="2"' in content and 'data-pending="true"' in content
    # Without JavaScript, the whole page reloads instead.
    assert '<noscript><meta http-equiv="refresh" content="2"></noscript>' in content


@pytest.mark.django_db
def test_live_returns_only_the_part_that_changes(client: Client) -> None:
    _reminder(message="watch me")
    response = client.get("/live")
    assert response.status_code == 200
    content = response.content.decode()
    assert "watch me" in content and 'data-pending="true"' in content
    assert "Digest, every minute" in content
    # Not the form: the page swaps this in and leaves what is typed alone.
    assert 'name="message"' not in content and "<html" not in content
    assert client.post("/live").status_code == 405


def test_favicon_is_served_where_browsers_look(client: Client) -> None:
    for url in ("/favicon.ico", "/favicon.svg"):
        response = client.get(url)
        assert response.status_code == 200
        assert response["Content-Type"] == "image/svg+xml"
        assert response.content.startswith(b"<svg")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("delay", "error"),
    [("-1", "greater than or equal to 0"), ("abc", "Enter a number."), ("", "required")],
)
def test_post_with_a_bad_delay_shows_the_error_and_creates_nothing(
    client: Client, delay: str, error: str
) -> None:
    response = client.post("/", {"message": "hi", "delay_seconds": delay})
    assert response.status_code == 200
    assert response.context["form"].errors["delay_seconds"]
    assert error in response.content.decode()
    assert not Reminder.objects.exists()


@pytest.mark.django_db
def test_post_defers_one_job_for_the_reminders_due_time(client: Client) -> None:
    # capture(): no broker; the job is recorded instead of published.
    with capture() as jobs:
        response = client.post("/", {"message": "hi", "delay_seconds": "5"})
    assert response.status_code == 302
    reminder = Reminder.objects.get()
    (job,) = jobs
    assert job.id == reminder.job_id
    assert job.task == "reminders.send_reminder" and job.args == (reminder.pk,)
    assert job.due >= reminder.due_at
    assert reminder.ran_at is None


@pytest.mark.django_db
def test_post_runs_the_reminder_in_eager_mode(client: Client) -> None:
    # eager(): no broker; the job runs inline, at once, whatever its delay.
    with eager():
        client.post("/", {"message": "now", "delay_seconds": "3600"})
    reminder = Reminder.objects.get()
    assert reminder.ran_at is not None


@pytest.mark.django_db
def test_send_reminder_sets_ran_at_once() -> None:
    reminder = _reminder()
    send_reminder(reminder.pk)
    reminder.refresh_from_db()
    first = reminder.ran_at
    assert first is not None
    assert reminder.lateness_ms is not None

    # At-least-once delivery: a second run of the same job changes nothing.
    send_reminder(reminder.pk)
    reminder.refresh_from_db()
    assert reminder.ran_at == first


@pytest.mark.django_db
def test_fail_once_fails_the_first_attempt_and_runs_on_the_retry() -> None:
    with capture() as jobs:
        reminder = schedule_reminder("flaky", 0, Outcome.FAIL_ONCE)
    (job,) = jobs
    with running(job), pytest.raises(DemoFailure, match="attempt 1"):
        send_reminder(reminder.pk)
    reminder.refresh_from_db()
    assert reminder.attempts == 1 and reminder.pending and reminder.failed_at is None
    with running(replace(job, attempt=2)):
        send_reminder(reminder.pk)
    reminder.refresh_from_db()
    assert reminder.attempts == 2 and reminder.ran_at is not None and not reminder.pending


@pytest.mark.django_db
def test_always_fail_fails_every_attempt_and_the_last_marks_it_failed() -> None:
    with capture() as jobs:
        reminder = schedule_reminder("doomed", 0, Outcome.ALWAYS_FAIL)
    (job,) = jobs
    for attempt in range(1, RETRIES + 2):
        with running(replace(job, attempt=attempt)), pytest.raises(DemoFailure):
            send_reminder(reminder.pk)
        reminder.refresh_from_db()
        assert reminder.attempts == attempt
        # Pending (retrying) until the last attempt, which the failed list keeps.
        assert (reminder.failed_at is not None) == (attempt == RETRIES + 1)
    assert reminder.ran_at is None and not reminder.pending


@pytest.mark.django_db
def test_send_reminder_ignores_a_deleted_reminder() -> None:
    send_reminder(987654321)


def test_healthz(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.content == b"ok"


# Needs RabbitMQ: publishes for real and runs the job in an in-process worker.
# transaction=True, because the worker thread must see the committed row.
@pytest.mark.django_db(transaction=True)
def test_post_defers_and_worker_runs_the_reminder(client: Client) -> None:
    with running_worker():
        response = client.post("/", {"message": "soon", "delay_seconds": "0.05"})
        assert response.status_code == 302
        assert response["Location"] == "/"

        reminder = Reminder.objects.get()
        assert reminder.job_id
        deadline = time.monotonic() + 10
        while reminder.ran_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
            reminder.refresh_from_db()
    assert reminder.ran_at is not None, "the worker did not run the reminder within 10 s"
    assert reminder.ran_at >= reminder.due_at
    assert "scheduled" in client.get("/").content.decode()


@pytest.mark.django_db
def test_the_digest_runs_once_per_occurrence_and_shows_on_the_page(client: Client) -> None:
    from django.conf import settings
    from django.test import override_settings

    from deferred.core.schedule import every
    from deferred.testing import fire_schedule
    from demo_project.reminders.models import Digest

    now = timezone.now()
    expected = every(minutes=1).after(now - timedelta(seconds=1))
    sent_at = expected - timedelta(seconds=10)  # within the minute the digest counts
    Reminder.objects.create(message="sent", delay_seconds=1, due_at=sent_at, ran_at=sent_at)
    demo = {**settings.DEFERRED, "SCHEDULES": {"reminders.digest": every(minutes=1)}}
    with override_settings(DEFERRED=demo):
        occurrence = fire_schedule("reminders.digest", after=now - timedelta(seconds=1))
        # A repeated run of the same occurrence writes nothing more.
        fire_schedule("reminders.digest", after=now - timedelta(seconds=1))
    (digest,) = Digest.objects.all()
    assert occurrence == expected and digest.occurrence == occurrence and digest.reminders_sent == 1
    content = client.get("/").content.decode()
    assert "Digest, every minute" in content
    assert f'<time datetime="{occurrence.isoformat()}">' in content


@pytest.mark.django_db
def test_cancel_button_cancels_the_captured_job_and_shows_cancelled(client: Client) -> None:
    with capture() as jobs:
        client.post("/", {"message": "never", "delay_seconds": "60"})
        reminder = Reminder.objects.get()
        assert f'action="/reminders/{reminder.pk}/cancel"' in client.get("/").content.decode()
        response = client.post(f"/reminders/{reminder.pk}/cancel")
    assert response.status_code == 302
    assert list(jobs) == []  # the captured job is gone: cancel() removed it
    reminder.refresh_from_db()
    assert reminder.cancelled_at is not None and reminder.ran_at is None
    page = client.get("/").content.decode()
    assert "cancelled" in page and f"/reminders/{reminder.pk}/cancel" not in page
    # A second cancel of the same reminder is refused politely.
    client.post(f"/reminders/{reminder.pk}/cancel")
    assert "no longer pending" in client.get("/").content.decode()


# Needs RabbitMQ: the cancel goes to the broker and the worker drops the job.
@pytest.mark.django_db(transaction=True)
def test_a_cancelled_reminder_never_runs_and_its_neighbour_does(client: Client) -> None:
    with running_worker() as worker:
        # Due in 3 s: time enough for the cancel to reach the broker first
        # on a loaded host.
        client.post("/", {"message": "cancel me", "delay_seconds": "3"})
        client.post("/", {"message": "keep me", "delay_seconds": "3"})
        gone = Reminder.objects.get(message="cancel me")
        kept = Reminder.objects.get(message="keep me")
        assert client.post(f"/reminders/{gone.pk}/cancel").status_code == 302
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            kept.ran_at and worker.outcomes["cancelled"] == 1
        ):
            time.sleep(0.05)
            kept.refresh_from_db()
    gone.refresh_from_db()
    assert kept.ran_at is not None
    assert worker.outcomes["cancelled"] == 1
    assert gone.ran_at is None and gone.cancelled_at is not None


# Needs RabbitMQ: the demo's "make it fail" choices, through the worker's
# retries and into deferred's failed list.
@pytest.mark.django_db(transaction=True)
def test_make_it_fail_shows_a_retry_and_the_failed_list(client: Client) -> None:
    with running_worker():
        client.post("/", {"message": "flaky", "delay_seconds": "0", "outcome": "fail_once"})
        client.post("/", {"message": "doomed", "delay_seconds": "0", "outcome": "always_fail"})
        flaky = Reminder.objects.get(message="flaky")
        doomed = Reminder.objects.get(message="doomed")
        # Retries after 0.5, 2 and 5 s: the last attempt about 7.5 s after the first.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (flaky.ran_at and doomed.failed_at):
            time.sleep(0.1)
            flaky.refresh_from_db()
            doomed.refresh_from_db()
    try:
        assert flaky.ran_at is not None and flaky.attempts == 2
        assert doomed.failed_at is not None and doomed.attempts == RETRIES + 1

        # The worker stores the failure just after the task's last attempt committed.
        def failed_entries() -> list[failures.FailedJob]:
            return [e for e in failures.list_failed(get_settings()) if e.id == doomed.job_id]

        assert wait_for(failed_entries, 10)
        (entry,) = failed_entries()
        assert entry.reason == "retries_exhausted" and "DemoFailure" in (entry.error or "")
        page = client.get("/live").content.decode()
        assert "on attempt 2" in page and "failed 4 times" in page and "in the failed list" in page
    finally:
        failures.purge(get_settings(), [doomed.job_id])


@pytest.mark.django_db
def test_a_retry_from_the_failed_list_starts_again_and_clears_the_failure() -> None:
    with capture() as jobs:
        reminder = schedule_reminder("doomed", 0, Outcome.ALWAYS_FAIL)
    (job,) = jobs
    with running(replace(job, attempt=RETRIES + 1)), pytest.raises(DemoFailure):
        send_reminder(reminder.pk)
    reminder.refresh_from_db()
    assert reminder.failed_at is not None and not reminder.pending
    # A retry from the failed list is attempt 1 again: pending (retrying) once more
    with running(job), pytest.raises(DemoFailure):
        send_reminder(reminder.pk)
    reminder.refresh_from_db()
    assert reminder.failed_at is None and reminder.pending and reminder.attempts == 1


@pytest.mark.django_db
def test_digest_clicks_leave_one_job_that_sends_them_all(client: Client) -> None:
    from demo_project.reminders.models import ChangeRequest
    from demo_project.reminders.tasks import CHANGES_KEY

    with capture() as jobs:
        for _ in range(3):
            assert client.post("/changes-digest").status_code == 302
    # capture() keeps the latest job of a key, as the workers do
    (job,) = jobs
    clicks = list(ChangeRequest.objects.order_by("pk"))
    assert len(clicks) == 3 and job.key == CHANGES_KEY and job.id == clicks[-1].job_id
    assert "waiting" in client.get("/live").content.decode()
    jobs.run()
    assert {(c.sent_by, c.sent_at is not None) for c in ChangeRequest.objects.all()} == {
        (job.id, True)
    }
    page = client.get("/live").content.decode()
    assert "this click&#x27;s job" in page or "this click's job" in page
    assert "a later click" in page


# Needs RabbitMQ: three clicks, one digest; the workers drop the other two jobs.
@pytest.mark.django_db(transaction=True)
def test_digest_clicks_are_debounced_by_the_worker(client: Client, monkeypatch) -> None:
    from demo_project.reminders import views
    from demo_project.reminders.models import ChangeRequest

    monkeypatch.setattr(views, "CHANGES_DELAY_S", 1)
    with running_worker() as worker:
        for _ in range(3):
            client.post("/changes-digest")
        assert wait_for(lambda: not ChangeRequest.objects.filter(sent_at=None).exists(), 10)
        assert wait_for(lambda: worker.outcomes["superseded"] == 2, 5)
    latest = ChangeRequest.objects.order_by("-pk")[0]
    assert set(ChangeRequest.objects.values_list("sent_by", flat=True)) == {latest.job_id}
    assert worker.outcomes["succeeded"] == 1


# Needs RabbitMQ: the page lists the jobs the ledger says are waiting, and moves them.
@pytest.mark.django_db(transaction=True)
def test_waiting_reminders_come_from_the_ledger_and_can_be_sent_now_or_postponed(
    client: Client,
) -> None:
    from deferred import pending

    with running_worker():
        client.post("/", {"message": "send me now", "delay_seconds": "60"})
        client.post("/", {"message": "later please", "delay_seconds": "60"})
        now_one = Reminder.objects.get(message="send me now")
        later = Reminder.objects.get(message="later please")
        page = client.get("/").content.decode()
        for reminder in (now_one, later):
            assert f'data-job="{reminder.job_id}"' in page
            assert f'action="/jobs/{reminder.job_id}/send-now"' in page
        assert client.post(f"/jobs/{now_one.job_id}/send-now").status_code == 302
        assert wait_for(lambda: Reminder.objects.get(pk=now_one.pk).ran_at is not None, 10)
        due_before = later.due_at
        assert client.post(f"/jobs/{later.job_id}/postpone").status_code == 302
        later.refresh_from_db()
        # A minute later, rounded up to the topology's resolution (1 ms).
        moved_by = (later.due_at - due_before).total_seconds()
        assert 60 <= moved_by < 60.002
        (row,) = [j for j in pending(task=send_reminder.name) if j.id == later.job_id]
        assert abs((row.due - later.due_at).total_seconds()) < 0.01 and row.moved
        ran = Reminder.objects.get(pk=now_one.pk)
        # Its due time moved to the send-now moment, and it ran after it.
        assert ran.ran_at is not None and ran.ran_at >= ran.due_at
        page = client.get("/").content.decode()
        assert f'data-job="{now_one.job_id}"' not in page
        # A job that already ran cannot be sent again.
        client.post(f"/jobs/{now_one.job_id}/send-now")
        assert "Could not move that reminder" in client.get("/").content.decode()
        client.post(f"/reminders/{later.pk}/cancel")
