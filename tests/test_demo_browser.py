"""The demo's page in headless Chromium: it keeps what is typed while its live part refreshes.

A real worker runs the reminders, so the page's script swaps the live part in
while the user types the next reminder; the test proves the text, and the
confirmation above the form, survive that, and that the "make it fail" choice
ends in the failed list. Screenshots at desktop and phone widths are saved in
the test's temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from deferred.conf import get_settings
from deferred.core.topology import Plan
from deferred.records import failures
from demo_project.reminders.models import Reminder

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def first_row(browser: WebDriver) -> str:
    """The newest reminder's row as text; the page's script may replace it meanwhile."""
    for _ in range(10):
        try:
            return browser.find_element(By.CSS_SELECTOR, "#reminders tbody tr").text
        except StaleElementReferenceException:
            continue
    raise AssertionError("the reminders table kept changing under the test")


def schedule(browser: WebDriver, message: str, delay: str, then: str | None = None) -> None:
    browser.find_element(By.NAME, "message").send_keys(message)
    browser.find_element(By.NAME, "delay_seconds").send_keys(delay)
    if then:
        Select(browser.find_element(By.NAME, "outcome")).select_by_value(then)
    button = browser.find_element(By.CSS_SELECTOR, "#schedule button[type=submit]")
    button.click()
    WebDriverWait(browser, 15).until(expected_conditions.staleness_of(button))


def test_the_demo_keeps_what_is_typed_while_its_reminders_refresh(
    own_topology: Plan, live_server, browser: WebDriver, run_worker, settings, tmp_path: Path
) -> None:
    settings.ROOT_URLCONF = "demo_project.urls"
    run_worker(queues=["default"])
    browser.get(f"{live_server.url}/")
    # The form's labels sit on one line at desktop width
    labels = browser.find_elements(By.CSS_SELECTOR, "#schedule label")
    assert len(labels) == 3 and len({label.location["y"] for label in labels}) == 1
    # Given a reminder due in 3 s, scheduled from the form
    schedule(browser, "water the plants", "3")
    confirmation = browser.find_element(By.CSS_SELECTOR, ".messages .success")
    assert "Reminder scheduled to run in 3 s" in confirmation.text
    assert "pending" in first_row(browser)
    # When the user types the next reminder while the job runs and the list refreshes
    browser.find_element(By.NAME, "message").send_keys("half typed")
    WebDriverWait(browser, 20).until(lambda b: "pending" not in first_row(b))
    # Then the reminder shows as run, and what was typed and the confirmation stay
    assert "ms" in first_row(browser), first_row(browser)
    assert browser.find_element(By.NAME, "message").get_attribute("value") == "half typed"
    assert confirmation.is_displayed()  # the same element: the page was not reloaded
    (tmp_path / "demo-desktop.png").write_bytes(browser.get_screenshot_as_png())
    # And the confirmation goes when dismissed
    confirmation.find_element(By.CSS_SELECTOR, ".dismiss").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".messages li")

    # When a reminder is told to always fail
    browser.find_element(By.NAME, "message").clear()
    schedule(browser, "doomed", "0", then="always_fail")
    assert "then always fail" in browser.find_element(By.CSS_SELECTOR, ".messages").text
    # Then the page shows its retries, then the failed list (retries after 0.5, 2 and 5 s)
    # (the 5 s before the last retry span at least two refreshes of the list)
    WebDriverWait(browser, 30).until(lambda b: "retrying" in first_row(b))
    WebDriverWait(browser, 30).until(lambda b: "in the failed list" in first_row(b))
    assert "failed 4 times" in first_row(browser)
    doomed = Reminder.objects.get(message="doomed")
    WebDriverWait(browser, 10).until(
        lambda _: doomed.job_id in [entry.id for entry in failures.list_failed(get_settings())]
    )

    # And at a phone's width the page does not overflow
    browser.set_window_size(390, 900)
    page_width = browser.execute_script("return document.documentElement.scrollWidth")
    window_width = browser.execute_script("return window.innerWidth")
    assert page_width <= window_width, (page_width, window_width)
    (tmp_path / "demo-phone.png").write_bytes(browser.get_screenshot_as_png())
    # And the icon the page names answers
    icon = browser.find_element(By.CSS_SELECTOR, "link[rel=icon]").get_attribute("href")
    browser.get(icon)
    assert "<svg" in browser.page_source or browser.find_elements(By.TAG_NAME, "svg")
