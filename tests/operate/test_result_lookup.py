"""Looking a job's result up where staff do: the status page's ``?job=`` form and
``deferred_status --job``; and the results and keys figures of the status. Against the
real broker, a topology of the test's own, jobs run by a worker."""

from __future__ import annotations

import json
import re
from datetime import UTC, timedelta
from io import StringIO
from types import SimpleNamespace
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, override_settings

import deferred
from deferred import defer, views
from deferred.core.jobs import new_job_id, utcnow
from deferred.core.topology import Plan
from tests.conftest import wait_for
from tests.testapp.tasks import add, always_fails, record

# Transactional: defer() inside a test transaction would wait for a commit that never comes.
pytestmark = pytest.mark.django_db(transaction=True)

#: Malformed ids: not hex, markup, a valid layout in upper case, and one whose
#: time is past what a datetime holds (year 10889).
MALFORMED = [
    "nope",
    "<script>alert(1)</script>",
    # An id of its own (not a literal): the layout stays valid as the ids change.
    # Its name is fixed, so that every pytest-xdist process collects the same tests.
    pytest.param(new_job_id().upper(), id="a-job-id-in-upper-case"),
    "ffffffffffff70008000000000000000",
]
#: A time zone far from UTC, and not by whole hours: a time shown in it is not UTC's.
ELSEWHERE = "Asia/Kathmandu"


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("staff", password="pw", is_staff=True)


@pytest.fixture
def member(django_user_model):
    return django_user_model.objects.create_user("member", password="pw")


def finished(job_id: str, timeout: float = 20) -> deferred.Result:
    """The job's result, once it is finished."""
    assert wait_for(lambda: deferred.result(job_id).finished, timeout), deferred.result(job_id)
    return deferred.result(job_id)


def look_up(client: Client, job_id: str) -> tuple[int, str]:
    """The status page with ``?job=job_id``: its status code and its HTML."""
    # The management API not asked: its figures are test_cluster's.
    with override_settings(DEFERRED={**settings.DEFERRED, "MANAGEMENT_URL": False}):
        response = client.get("/deferred/", {"job": job_id})
    return response.status_code, response.content.decode()


def row(page: str, header: str) -> str | None:
    """The text of the look-up table's cell for ``header``, tags removed."""
    table = re.search(r'<table id="deferred-result">(.*?)</table>', page, re.S)
    assert table, "no result table on the page"
    cell = re.search(
        rf'<th scope="row">{re.escape(header)}</th><td[^>]*>(.*?)</td>', table[1], re.S
    )
    return None if cell is None else re.sub(r"<[^>]+>", "", cell[1]).strip()


def status(*args: str) -> str:
    out = StringIO()
    call_command("deferred_status", *args, stdout=out)
    return out.getvalue()


def status_json(*args: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(status(*args, "--json"))
    return data


# --------------------------------------------------------------------------- the page


def test_the_page_shows_a_finished_jobs_state_attempts_and_times_in_utc(
    client: Client, staff, own_topology: Plan, run_worker
) -> None:
    # Given a job a worker ran
    worker = run_worker(concurrency=1)
    job_id = defer(add, 0, 2, 3)
    done = finished(job_id)
    assert done.started_at is not None and done.finished_at is not None
    # When staff looks it up, Django's time zone far from UTC
    client.force_login(staff)
    with override_settings(TIME_ZONE=ELSEWHERE):
        code, page = look_up(client, job_id)
    # Then the page shows its state, attempt, worker and value
    assert code == 200
    assert 'id="deferred-result-error"' not in page
    assert row(page, "Job") == job_id
    assert row(page, "State") == "succeeded"
    assert row(page, "Task") == "tests.add"
    assert row(page, "Attempts") == "1"
    assert row(page, "Worker") == worker.worker_id
    assert row(page, "Returned") == "5"
    # And its times in UTC, as the headers say, not in the time zone of the settings
    for header, moment in (
        ("Started (UTC)", done.started_at),
        ("Finished (UTC)", done.finished_at),
    ):
        utc = moment.astimezone(UTC)
        assert row(page, header) == f"{utc:%Y-%m-%d %H:%M:%S}"
        assert f'<time datetime="{utc:%Y-%m-%dT%H:%M:%S}' in page
    assert "+05:45" not in page


def test_the_page_shows_a_failed_jobs_attempts_and_each_error(
    client: Client, staff, own_topology: Plan, run_worker, records: str
) -> None:
    # Given a job that failed its three attempts (max_retries=2)
    run_worker(concurrency=1)
    job_id = defer(always_fails, 0, records, "doomed")
    done = finished(job_id)
    assert done.state == "failed" and done.attempts == 3
    # When staff looks it up
    client.force_login(staff)
    code, page = look_up(client, job_id)
    # Then it reads failed, three attempts, each error numbered with its traceback
    assert code == 200
    assert row(page, "State") == "failed"
    assert row(page, "Attempts") == "3"
    for n in (1, 2, 3):
        error = row(page, f"Error {n}")
        assert error is not None and "RuntimeError" in error and "doomed" in error
    assert page.count("<summary>Traceback</summary>") >= 3
    assert row(page, "Returned") is None


def test_the_page_says_an_unknown_id_has_no_record(
    client: Client, staff, own_topology: Plan
) -> None:
    client.force_login(staff)
    job_id = new_job_id(utcnow() - timedelta(seconds=5))
    code, page = look_up(client, job_id)
    assert code == 200
    assert 'id="deferred-result-error"' not in page
    state = row(page, "State")
    assert state is not None and state.startswith("pending: not started yet")
    assert "older than 1 d" in state
    assert row(page, "Attempts") is None and row(page, "Started (UTC)") is None


@pytest.mark.parametrize("job_id", MALFORMED)
def test_the_page_says_a_malformed_id_is_not_a_job_id(
    client: Client, staff, own_topology: Plan, job_id: str
) -> None:
    client.force_login(staff)
    code, page = look_up(client, job_id)
    assert code == 200
    assert 'id="deferred-result"' not in page
    error = re.search(r'<p class="errornote" id="deferred-result-error">(.*?)</p>', page, re.S)
    assert error and "is not a job id" in error[1]
    assert "<script>alert" not in page  # escaped, in the message and in the form


def test_an_empty_look_up_is_the_plain_page(client: Client, staff, own_topology: Plan) -> None:
    client.force_login(staff)
    code, page = look_up(client, "  ")
    assert code == 200
    assert 'id="deferred-result"' not in page and 'id="deferred-result-error"' not in page


def test_non_staff_cannot_look_a_job_up(client: Client, member, own_topology: Plan) -> None:
    client.force_login(member)
    response = client.get("/deferred/", {"job": new_job_id()})
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


# --------------------------------------------------------------------------- the command


def test_the_command_prints_a_finished_jobs_result_as_text_and_json(
    own_topology: Plan, run_worker
) -> None:
    worker = run_worker(concurrency=1)
    job_id = defer(add, 0, 2, 3)
    done = finished(job_id)
    assert done.started_at is not None and done.finished_at is not None
    # As text: one line per figure
    lines = status("--job", job_id).splitlines()
    assert lines[0] == f"job {job_id}: succeeded"
    assert "  task: tests.add" in lines
    assert "  attempts: 1" in lines
    assert f"  started: {done.started_at.isoformat()}" in lines
    assert f"  finished: {done.finished_at.isoformat()}" in lines
    assert f"  worker: {worker.worker_id}" in lines
    assert "  returned: 5" in lines
    # As JSON: the same
    data = status_json("--job", job_id)
    assert data["id"] == job_id and data["state"] == "succeeded"
    assert data["outcome"] == "succeeded" and data["task"] == "tests.add"
    assert data["attempts"] == 1 and data["value"] == 5 and data["value_kept"] is True
    assert data["started_at"] == done.started_at.isoformat()
    assert data["finished_at"] == done.finished_at.isoformat()
    assert data["worker"] == worker.worker_id and data["workers"] == [worker.worker_id]
    assert data["errors"] == [] and data["reason"] is None


def test_the_command_prints_a_failed_jobs_errors(
    own_topology: Plan, run_worker, records: str
) -> None:
    run_worker(concurrency=1)
    job_id = defer(always_fails, 0, records, "doomed")
    finished(job_id)
    text = status("--job", job_id)
    assert text.splitlines()[0] == f"job {job_id}: failed"
    assert "  attempts: 3" in text.splitlines()
    assert len(re.findall(r"^  error \d: \S*RuntimeError: .*doomed", text, re.M)) == 3
    data = status_json("--job", job_id)
    assert data["state"] == "failed" and data["attempts"] == 3
    assert [e["message"] for e in data["errors"]] == ["doomed always fails"] * 3
    assert all("Traceback" in e["traceback"] for e in data["errors"])


def test_the_command_says_an_unknown_id_has_no_record(own_topology: Plan) -> None:
    job_id = new_job_id(utcnow() - timedelta(seconds=5))
    text = status("--job", job_id)
    assert text.startswith(f"job {job_id}: pending: not started yet, or no record")
    data = status_json("--job", job_id)
    assert (data["state"], data["outcome"], data["attempts"]) == ("pending", None, 0)
    assert data["started_at"] is None and data["errors"] == []


@pytest.mark.parametrize("job_id", MALFORMED[:3])
def test_the_command_refuses_a_malformed_id(own_topology: Plan, job_id: str) -> None:
    with pytest.raises(CommandError, match="is not a job id"):
        status("--job", job_id)


def test_the_command_refuses_an_id_past_what_a_date_holds(own_topology: Plan) -> None:
    # A clear error, not a traceback (the message is the datetime module's)
    with pytest.raises(CommandError):
        status("--job", MALFORMED[3])


# --------------------------------------------------------------------------- the figures


def test_the_status_counts_results_and_keys(
    client: Client, staff, own_topology: Plan, run_worker, tmp_path
) -> None:
    # Given a job a worker ran (its result is in the stream)
    run_worker(concurrency=1)
    finished(defer(add, 0, 1, 1))
    # And two jobs of one debounce key, ten minutes away: the later supersedes the earlier
    path = str(tmp_path / "never.jsonl")
    for label in ("earlier", "later"):
        defer(record.using(key="lookup:figures"), timedelta(minutes=10), path, label)
    # Then the JSON counts one key and one superseded job, and says results are kept a day
    data = status_json()
    assert data["keys_in_force"] == 1 and data["superseded_pending"] == 1
    kept = data["results"]
    assert kept["enabled"] is True and kept["ttl_s"] == 24 * 3600
    # (Counted from the stream's offsets: a passive declare says 0 for any stream.)
    assert kept["stream_messages"] >= 1
    # And the text says the same
    text = status()
    assert re.search(r"^debounce keys in force: 1\b", text, re.M)
    assert re.search(
        r"^results: kept for 1 d; about [1-9]\d* messages? of result records", text, re.M
    )
    # And so does the page
    client.force_login(staff)
    code, page = look_up(client, "")
    assert code == 200
    assert re.search(r'id="deferred-keys-count">\s*1<', page)
    assert re.search(r'id="deferred-results-count">\s*[1-9]\d*<', page)
    assert "Results are kept for 1 d" in page


def test_the_status_says_results_are_off(client: Client, staff, own_topology: Plan) -> None:
    with override_settings(DEFERRED={**settings.DEFERRED, "RESULTS": False}):
        assert status_json()["results"]["enabled"] is False
        assert re.search(r"^results: off \(DEFERRED\['RESULTS'\] is False\)$", status(), re.M)
        client.force_login(staff)
        code, page = look_up(client, "")
    assert code == 200
    assert "Results are off" in page


def test_the_page_says_when_a_look_up_ran_out_of_time(
    client: Client, staff, own_topology: Plan, monkeypatch
) -> None:
    # A look-up that ran out of its timeout returns what it read, marked incomplete
    job_id = new_job_id()
    partial = SimpleNamespace(**{**vars(deferred.Result(id=job_id)), "complete": False})
    partial.worker = None
    monkeypatch.setattr(views.results, "result", lambda _id: partial)
    client.force_login(staff)
    code, page = look_up(client, job_id)
    assert code == 200
    assert row(page, "Read") == (
        "The look-up ran out of time: this is as far as the results stream was read."
    )
    # And a complete one says nothing of the kind
    monkeypatch.setattr(views.results, "result", lambda _id: deferred.Result(id=job_id))
    assert row(look_up(client, job_id)[1], "Read") is None
