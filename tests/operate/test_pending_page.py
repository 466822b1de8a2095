"""The status page's "Pending jobs" section through the test client, on the real broker."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client

from deferred import defer, pending
from tests.conftest import wait_for
from tests.testapp.tasks import on_other, read_records, record, timed

# Transactional: defer() inside a test transaction would wait for a commit that never comes.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("staff", password="pw", is_staff=True)


@pytest.fixture
def member(django_user_model):
    return django_user_model.objects.create_user("member", password="pw")


def test_staff_sees_the_next_jobs_filters_and_pages_them(
    client: Client, staff, own_topology, records, monkeypatch
) -> None:
    from deferred import views

    monkeypatch.setattr(views, "PAGE_SIZE", 2)
    jobs = [defer(record, 60 + n, records, f"r{n}") for n in range(3)]
    other = defer(on_other, 30, records, "o")
    client.force_login(staff)
    page = client.get("/deferred/").content.decode()
    assert 'id="deferred-pending-table"' in page
    # Soonest first, two a page.
    assert page.index(other[-8:]) < page.index(jobs[0][-8:])
    assert jobs[1][-8:] not in page and "Later &rarr;" in page
    second = client.get("/deferred/?p_page=2").content.decode()
    assert jobs[1][-8:] in second and jobs[2][-8:] in second and other[-8:] not in second
    assert "Sooner" in second
    only_other = client.get("/deferred/?p_queue=other").content.decode()
    assert other[-8:] in only_other and jobs[0][-8:] not in only_other
    by_task = client.get("/deferred/?p_task=tests.testapp.tasks.record").content.decode()
    assert other[-8:] not in by_task and jobs[0][-8:] in by_task
    bad = client.get("/deferred/?p_after=yesterday").content.decode()
    assert 'id="deferred-pending-error"' in bad
    # Search by id: the job's record, while it waits.
    looked = client.get(f"/deferred/?job={other}").content.decode()
    assert 'id="deferred-result-waiting"' in looked and "tests.on_other" in looked


def test_staff_runs_a_job_now_moves_one_and_cancels_by_filter(
    client: Client, staff, own_topology, run_worker, records
) -> None:
    now_job = defer(timed, 60, records, "now")
    moved = defer(timed, 60, records, "moved")
    gone = [defer(on_other, 60, records, f"gone{n}") for n in range(2)]
    client.force_login(staff)
    response = client.post("/deferred/pending/move/", {"id": now_job, "in": "0"})
    assert response.status_code == 302
    response = client.post(
        "/deferred/pending/move/", {"id": moved, "by": "-59.5", "next": "/deferred/?p_page=1"}
    )
    assert response["Location"] == "/deferred/?p_page=1"
    # An address off the site is not followed.
    response = client.post(
        "/deferred/pending/move/", {"id": moved, "in": "5", "next": "https://elsewhere.example/"}
    )
    assert response["Location"] == "/deferred/"
    confirm = client.post("/deferred/pending/cancel/", {"p_queue": "other"})
    assert confirm.status_code == 200
    text = confirm.content.decode()
    assert "these 2 pending jobs" in text and all(g in text for g in gone)
    assert {j.id for j in pending(queue="other")} == set(gone)  # not yet
    # Confirmed: the jobs that match and were deferred before the page was shown.
    later = defer(on_other, 60, records, "deferred after the page")
    shown_at = text.split('name="shown_at" value="')[1].split('"')[0]
    client.post(
        "/deferred/pending/cancel/",
        {"p_queue": "other", "shown_at": shown_at, "confirmed": "yes"},
    )
    assert [j.id for j in pending(queue="other")] == [later]
    client.post("/deferred/cancel/", {"id": later})
    run_worker()
    assert wait_for(lambda: {r["label"] for r in read_records(records)} == {"now", "moved"}, 10)
    bad = client.post("/deferred/pending/move/", {"id": now_job, "in": "0"}, follow=True)
    assert "Nothing was moved" in bad.content.decode()


def test_non_staff_cannot_move_or_cancel(client: Client, member, own_topology, records) -> None:
    job = defer(record, timedelta(minutes=5), records, "kept")
    client.force_login(member)
    for response in (
        client.post("/deferred/pending/move/", {"id": job, "in": "0"}),
        client.post(
            "/deferred/pending/cancel/",
            {"shown_at": "2030-01-01T00:00:00+00:00", "confirmed": "yes"},
        ),
    ):
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")
    assert [j.id for j in pending()] == [job]
