"""Tests of the reminders app, through the Django test client.

They run under the library's test settings, which have no URLconf, templates
or middleware of their own: the ``_web`` fixture supplies the demo's. Only
``test_post_defers_and_worker_runs_the_reminder`` needs a running RabbitMQ.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from deferred.testing import capture, eager
from deferred.worker import Worker
from demo_project.reminders.models import Reminder
from demo_project.reminders.tasks import send_reminder


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
    assert "No reminders yet." in content
    # Nothing pending: the page does not reload itself.
    assert 'http-equiv="refresh"' not in content


@pytest.mark.django_db
def test_pending_reminder_makes_the_page_refresh(client: Client) -> None:
    _reminder(message="still waiting")
    content = client.get("/").content.decode()
    assert "still waiting" in content
    assert "pending" in content
    assert 'http-equiv="refresh"' in content


@pytest.mark.django_db
def test_ran_reminder_shows_its_lateness(client: Client) -> None:
    reminder = _reminder(message="done")
    reminder.ran_at = reminder.due_at + timedelta(milliseconds=12.34)
    reminder.save()
    content = client.get("/").content.decode()
    assert "12.3 ms" in content
    assert 'http-equiv="refresh"' not in content


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
    call_command("declare_delay_topology")
    worker = Worker(install_signal_handlers=False)
    thread = threading.Thread(target=worker.run, name="reminders-test-worker")
    thread.start()
    try:
        assert worker.consuming.wait(10), "the worker did not start consuming"
        response = client.post("/", {"message": "soon", "delay_seconds": "0.05"})
        assert response.status_code == 302
        assert response["Location"] == "/"

        reminder = Reminder.objects.get()
        assert reminder.job_id
        deadline = time.monotonic() + 10
        while reminder.ran_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
            reminder.refresh_from_db()
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert reminder.ran_at is not None, "the worker did not run the reminder within 10 s"
    assert reminder.ran_at >= reminder.due_at
    assert "scheduled" in client.get("/").content.decode()


@pytest.mark.django_db
def test_the_digest_runs_once_per_occurrence_and_shows_on_the_page(client: Client) -> None:
    from django.conf import settings
    from django.test import override_settings

    from deferred.schedule import every
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
    assert occurrence.strftime("%Y-%m-%d %H:%M:%S") in content


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
    call_command("declare_delay_topology")
    worker = Worker(install_signal_handlers=False)
    thread = threading.Thread(target=worker.run, name="reminders-test-worker")
    thread.start()
    try:
        assert worker.consuming.wait(10), "the worker did not start consuming"
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
    finally:
        worker.stop()
        thread.join(timeout=30)
    gone.refresh_from_db()
    assert kept.ran_at is not None
    assert worker.outcomes["cancelled"] == 1
    assert gone.ran_at is None and gone.cancelled_at is not None
