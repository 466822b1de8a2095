"""The status page through Django's test client, against the real broker."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client, override_settings

from deferred import defer
from deferred.conf import get_settings
from deferred.core.topology import Plan
from deferred.records import failures
from tests.conftest import wait_for
from tests.testapp.tasks import explode, record

# Transactional: defer() inside a test transaction would wait for a commit that never comes.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("staff", password="pw", is_staff=True)


@pytest.fixture
def member(django_user_model):
    return django_user_model.objects.create_user("member", password="pw")


@pytest.fixture
def failed_job(own_topology: Plan, run_worker) -> str:
    """The id of a job that raised in a worker and sits in the failed queue."""
    run_worker(queues=["default"])
    job_id = defer(explode, 0, "boom")
    assert wait_for(lambda: len(failures.list_failed(get_settings())) == 1, 15)
    return job_id


def failed_ids() -> list[str]:
    return [entry.id for entry in failures.list_failed(get_settings())]


def test_anonymous_users_are_sent_to_the_login_page(client: Client) -> None:
    response = client.get("/deferred/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/?next=/deferred/")


def test_non_staff_users_are_refused(client: Client, member, failed_job: str) -> None:
    client.force_login(member)
    for response in (
        client.get("/deferred/"),
        client.post("/deferred/failed/retry/", {"id": failed_job}),
        client.post("/deferred/failed/purge/", {"id": failed_job, "confirmed": "yes"}),
    ):
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")
    assert failed_ids() == [failed_job]


def test_staff_sees_the_figures_the_chart_and_the_failed_job(
    client: Client, staff, failed_job: str, tmp_path
) -> None:
    # Given two jobs pending for ten minutes and one failed job
    for _ in range(2):
        defer(record, timedelta(minutes=10), str(tmp_path / "never.jsonl"), "later")
    client.force_login(staff)
    # When staff opens the page, the management API not asked (its figures
    # are test_cluster's, on nodes that run it)
    with override_settings(DEFERRED={**settings.DEFERRED, "MANAGEMENT_URL": False}):
        response = client.get("/deferred/")
    # Then it shows the queues, the chart with both jobs in "≤ 1 h", and the failed job
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="deferred-chart"' in page
    assert 'data-label="≤ 1 h" data-jobs="2"' in page
    assert f'data-job-id="{failed_job}"' in page
    assert "tests.explode" in page and "RuntimeError: boom" in page
    assert response.context["snapshot"].pending == 2
    assert "n/a" in page  # unacked, without the management API


def test_one_failed_job_reads_in_the_singular_with_one_time_format(
    client: Client, staff, failed_job: str
) -> None:
    client.force_login(staff)
    page = client.get("/deferred/").content.decode()
    # Plurals: no "job(s)" or "Retry all 1"
    assert "(s)" not in page
    assert 'value="Retry the failed job"' in page and 'value="Purge the failed job…"' in page
    assert re.search(r"0</span> cancels in force", page)
    # The id shortened to its last digits (ids of neighbours share their time
    # prefix), the full id on a copy button and in the title
    row = page[page.index(f'data-job-id="{failed_job}"') :]
    assert f'title="{failed_job}">…{failed_job[-8:]}</code>' in row
    assert f'data-copy="{failed_job}"' in row
    # The failure time in the page's one format, and a button that says what it does
    entry = failures.list_failed(get_settings())[0]
    assert entry.failed_at_time is not None
    assert f">{entry.failed_at_time:%Y-%m-%d %H:%M:%S}</time>" in row
    assert 'value="Never run again"' in row
    assert re.search(r"Read from the broker at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", page)


def test_retry_re_queues_the_job(client: Client, staff, failed_job: str) -> None:
    client.force_login(staff)
    response = client.post("/deferred/failed/retry/", {"id": failed_job}, follow=True)
    assert response.redirect_chain[-1][0] == "/deferred/"
    assert "1 failed job re-queued." in response.content.decode()
    # It raises again in the worker and comes back: it was run, not dropped
    assert wait_for(lambda: failed_ids() == [failed_job], 15)


def test_purge_asks_for_confirmation_first(client: Client, staff, failed_job: str) -> None:
    client.force_login(staff)
    # When purge is asked without confirming, a confirmation page names the job
    response = client.post("/deferred/failed/purge/", {"id": failed_job})
    assert response.status_code == 200
    page = response.content.decode()
    assert failed_job in page and 'name="confirmed" value="yes"' in page
    assert failed_ids() == [failed_job]
    # And once confirmed, the job is gone
    response = client.post(
        "/deferred/failed/purge/", {"id": failed_job, "confirmed": "yes"}, follow=True
    )
    assert "1 failed job purged." in response.content.decode()
    assert failed_ids() == []


def test_purge_all_after_confirmation(client: Client, staff, failed_job: str) -> None:
    client.force_login(staff)
    page = client.post("/deferred/failed/purge/", {"all": "1"}).content.decode()
    assert "every" in page and failed_job in page
    # The confirmation names the jobs it showed, so one failing meanwhile is kept
    assert 'name="all"' not in page
    shown = re.findall(r'name="id" value="([0-9a-f]+)"', page)
    assert shown == [failed_job]
    client.post("/deferred/failed/purge/", {"id": shown, "confirmed": "yes"})
    assert failed_ids() == []


def test_forms_need_the_csrf_token(staff, failed_job: str) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff)
    assert client.post("/deferred/failed/retry/", {"id": failed_job}).status_code == 403
    assert client.post("/deferred/failed/purge/", {"all": "1", "confirmed": "yes"}).status_code == (
        403
    )
    assert failed_ids() == [failed_job]


def test_get_cannot_retry_or_purge(client: Client, staff) -> None:
    client.force_login(staff)
    assert client.get("/deferred/failed/retry/").status_code == 405
    assert client.get("/deferred/failed/purge/").status_code == 405


def test_the_admin_index_links_to_the_page(client: Client, staff) -> None:
    client.force_login(staff)
    page = client.get("/admin/").content.decode()
    assert 'id="deferred-admin-link"' in page and 'href="/deferred/"' in page


def test_a_broker_that_is_down_is_said_on_the_page(client: Client, staff) -> None:
    client.force_login(staff)
    down = {**settings.DEFERRED, "BROKER_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}
    with override_settings(DEFERRED=down):
        response = client.get("/deferred/")
    assert response.status_code == 503
    assert "The broker cannot be read" in response.content.decode()


def test_the_page_shows_the_recurring_jobs(client: Client, staff, topology) -> None:
    from django.conf import settings
    from django.test import override_settings

    from deferred.core.schedule import every

    client.force_login(staff)
    scheduled = {**settings.DEFERRED, "SCHEDULES": {"tests.tick": every(minutes=5)}}
    with override_settings(DEFERRED=scheduled):
        content = client.get("/deferred/").content.decode()
    assert "Recurring jobs (scheduling worker: none yet)" in content
    assert "tests.tick" in content and "every 5 min" in content


def test_cancel_a_failed_job_then_a_retry_of_it_is_dropped(
    client: Client, staff, failed_job: str, caplog
) -> None:
    client.force_login(staff)
    page = client.get("/deferred/").content.decode()
    assert re.search(r'action="/deferred/cancel/".*?name="id" value="' + failed_job, page, re.S)
    # When staff cancels the failed job
    response = client.post("/deferred/cancel/", {"id": failed_job}, follow=True)
    page = response.content.decode()
    assert "1 job cancelled" in page
    # Then the page counts the cancel and shows the entry as cancelled, with no Retry
    assert response.context["snapshot"].cancels >= 1
    row = re.search(rf'data-job-id="{failed_job}".*?</tr>', page, re.S)
    assert row and "cancelled" in row[0] and 'value="Retry"' not in row[0]
    # And a retry of it (all of them, from the command line) is dropped by the worker
    failures.redrive(get_settings(), None)
    dropped = f"job={failed_job} task=tests.explode attempt=1"
    assert wait_for(
        lambda: any(dropped in m and "outcome=cancelled" in m for m in caplog.messages), 15
    )
    assert failed_ids() == []


def test_cancel_jobs_by_id_from_the_form(client: Client, staff, own_topology, tmp_path) -> None:
    path = str(tmp_path / "never.jsonl")
    first, second = (defer(record, timedelta(minutes=10), path, "later") for _ in range(2))
    client.force_login(staff)
    response = client.post("/deferred/cancel/", {"ids": f"{first}, {second}"}, follow=True)
    assert "2 jobs cancelled" in response.content.decode()
    assert re.search(r'id="deferred-cancels-count">\s*2<', response.content.decode())
    assert (
        "No job id was given."
        in client.post("/deferred/cancel/", {"ids": " "}, follow=True).content.decode()
    )
    assert client.get("/deferred/cancel/").status_code == 405
