"""The status page in headless Chromium: a staff user retries a failed job; others are refused.

The ``browser`` fixture (``tests/conftest.py``) needs Debian's ``chromium`` and
``chromium-driver``; without them the test fails: it never skips.
``DEFERRED_STATUS_SCREENSHOT=docs/status-page.png`` also saves the screenshot
the README shows; every run saves one in the test's temporary directory.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from deferred import defer
from deferred.conf import get_settings
from deferred.core.topology import Plan
from deferred.records import failures
from tests.conftest import ROOT, wait_for
from tests.testapp.tasks import explode, read_records, record, send_invoice

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def log_in(browser: WebDriver, base: str, username: str, password: str) -> None:
    browser.get(f"{base}/admin/login/?next=/deferred/")
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(password)
    submit = browser.find_element(By.CSS_SELECTOR, "input[type=submit]")
    submit.click()
    # The click only starts the POST: wait for the next page (a refused login
    # reloads the form too), or the URL read next may still be the login page.
    WebDriverWait(browser, 15).until(expected_conditions.staleness_of(submit))


def failed_ids() -> list[str]:
    return [entry.id for entry in failures.list_failed(get_settings())]


def test_staff_retries_a_failed_job_and_it_runs(
    own_topology: Plan,
    live_server,
    browser: WebDriver,
    django_user_model,
    run_worker,
    records: str,
    tmp_path: Path,
) -> None:
    django_user_model.objects.create_user("ops", password="s3cret-pw", is_staff=True)
    # Given jobs pending at several levels, and a worker on the default queue
    never = str(tmp_path / "never.jsonl")
    for delay, count in {
        timedelta(seconds=50): 2,
        timedelta(minutes=10): 5,
        timedelta(hours=3): 3,
        timedelta(days=2): 4,
        timedelta(days=90): 1,
    }.items():
        for _ in range(count):
            defer(record, delay, never, "later")
    run_worker(queues=["default"])
    # And a job that failed while a service was down, and one that always raises
    flag = tmp_path / "service-is-up"
    job_id = defer(send_invoice, 0, records, "invoice-42", str(flag))
    defer(explode, 0, "KeyError: 'customer'")
    assert wait_for(lambda: len(failed_ids()) == 2, 15)
    # When a staff user logs in and opens the status page
    log_in(browser, live_server.url, "ops", "s3cret-pw")
    assert browser.current_url == f"{live_server.url}/deferred/"
    # Then the chart and the failed job are there
    chart = browser.find_element(By.ID, "deferred-chart")
    assert chart.is_displayed()
    buckets = {
        g.get_attribute("data-label"): int(g.get_attribute("data-jobs") or 0)
        for g in chart.find_elements(By.CSS_SELECTOR, "g.bucket")
    }
    assert buckets == {
        "≤ 1 s": 0,
        "≤ 1 min": 2,
        "≤ 1 h": 5,
        "≤ 1 day": 3,
        "≤ 30 days": 4,
        "longer": 1,
    }
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-job-id="{job_id}"]')
    assert "tests.send_invoice" in row.text and "503 Service Unavailable" in row.text
    screenshot = browser.get_screenshot_as_png()
    (tmp_path / "status-page.png").write_bytes(screenshot)
    if os.environ.get("DEFERRED_STATUS_SCREENSHOT"):
        (ROOT / os.environ["DEFERRED_STATUS_SCREENSHOT"]).write_bytes(screenshot)
    # The id, shortened, and the failure time each hold on one line, at a
    # desktop's width and at a phone's (where wide tables scroll in their box)
    for width in (1280, 390):
        browser.set_window_size(width, 1900)
        for selector in ("code.deferred-id", "td.deferred-when time"):
            cell = row.find_element(By.CSS_SELECTOR, selector)
            lines = browser.execute_script(
                "const r = arguments[0].getClientRects(); return r.length;", cell
            )
            assert lines == 1, (width, selector, lines)
        page_width = browser.execute_script("return document.documentElement.scrollWidth")
        wide = browser.execute_script(
            "const w = window.innerWidth;"
            "const boxed = e => { for (let a = e.parentElement; a; a = a.parentElement)"
            " if (getComputedStyle(a).overflowX !== 'visible') return true; return false; };"
            "return [...document.querySelectorAll('body *')]"
            ".filter(e => e.getBoundingClientRect().right > w && !boxed(e))"
            ".map(e => e.tagName + '#' + e.id + '.' + e.className + ':' "
            "+ Math.round(e.getBoundingClientRect().right)).slice(0, 8);"
        )
        assert page_width <= browser.execute_script("return window.innerWidth"), (
            width,
            page_width,
            wide,
        )
        # Every button and field is on screen, no table scrolls sideways (hiding its
        # Retry and Purge), and each form's label holds on one line
        off = browser.execute_script(
            "const w = window.innerWidth;"
            "return [...document.querySelectorAll('#content-main input, #content-main button')]"
            ".filter(e => e.type !== 'hidden' && e.offsetParent !== null)"
            ".filter(e => { const r = e.getBoundingClientRect();"
            " return r.left < 0 || r.right > w; })"
            ".map(e => (e.value || e.textContent) + ':'"
            " + Math.round(e.getBoundingClientRect().right));"
        )
        assert off == [], (width, off)
        sideways = browser.execute_script(
            "return [...document.querySelectorAll('.deferred-section')]"
            ".filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.id);"
        )
        assert sideways == [], (width, sideways)
        for label in ("deferred-cancel-ids", "deferred-result-id"):
            tall = browser.execute_script(
                "const l = document.querySelector(`label[for=${arguments[0]}]`);"
                "return l.getBoundingClientRect().height /"
                " parseFloat(getComputedStyle(l).fontSize);",
                label,
            )
            assert tall < 2.0, (width, label, tall)
        (tmp_path / f"status-page-{width}.png").write_bytes(browser.get_screenshot_as_png())
    browser.set_window_size(1280, 1900)
    # When the service is back and the user clicks Retry on that job
    flag.touch()
    row.find_element(By.CSS_SELECTOR, "input[value=Retry]").click()
    # Then the page says so, the job runs in the worker, and leaves the failed list
    assert "1 failed job re-queued." in browser.find_element(By.CSS_SELECTOR, ".messagelist").text
    assert wait_for(lambda: len(read_records(records)) == 2, 15), read_records(records)
    assert not wait_for(lambda: job_id in failed_ids(), 1), "the retried job failed again"
    assert len(failed_ids()) == 1  # the other one
    browser.refresh()
    assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-job-id="{job_id}"]')


def test_a_user_who_is_not_staff_is_refused(
    own_topology: Plan, live_server, browser: WebDriver, django_user_model
) -> None:
    # Given a logged-in user without staff status (the admin's form would not let them in)
    member = django_user_model.objects.create_user("member", password="pw")
    client = Client()
    client.force_login(member)
    browser.get(f"{live_server.url}/admin/login/")
    browser.add_cookie({"name": "sessionid", "value": client.cookies["sessionid"].value})
    # When they open the status page
    browser.get(f"{live_server.url}/deferred/")
    # Then they get the login page, told they are not allowed, and no figures
    assert "/admin/login/" in browser.current_url
    assert "not authorized to access this page" in browser.page_source
    assert not browser.find_elements(By.ID, "deferred-chart")
