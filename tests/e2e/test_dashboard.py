"""The Locust dashboard in a real browser: started as docs/load-tests.md says, driven through its UI.

The service runs the default model; ``bash scripts/load/dashboard`` opens Locust's web
UI on it; headless Chromium picks the StepLoad shape with the two /predict routes' user
classes (unticking IndexingUser and RetrievalUser, whose batched clients and searches on
two models test_locust_reports.py runs) and starts it, so that each route takes its turn
at each user count.
Screenshots go to test-artifacts/dashboard/ (ignored by git), also when the test fails.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from scripts.common.launcher import stop
from tests.support.browser import CHROMEDRIVER, CHROMIUM, SKIP_REASON, chromium
from tests.support.server import ROOT, free_port, gunicorn

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason=SKIP_REASON),
]

ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
# Short steps keep the test short; each must still span two readings of /metrics. At 64
# naive users a reading waits behind their requests (up to about 3 s on a busy 2-core
# machine), and a 5 s step once held only one: the step had no row.
STEP_SECONDS = 8
METRICS_INTERVAL_S = 1
STEPS = (1, 8, 32, 64)  # StepLoad's users per route
ROUTES = ("/predict/batched", "/predict/naive")
USER_CLASSES = ("BatchedUser", "IndexingUser", "NaiveUser", "RetrievalUser")
_URL_LINE = re.compile(r"Locust dashboard: (http://\S+)")


@contextlib.contextmanager
def dashboard(service_url: str, log_path: Path) -> Iterator[str]:
    """``bash scripts/load/dashboard`` against ``service_url``; yields the URL it prints, once it answers."""
    env = os.environ | {
        "LOCUST_STEP_SECONDS": str(STEP_SECONDS),
        "LOCUST_METRICS_INTERVAL": str(METRICS_INTERVAL_S),
    }
    command = ["bash", "scripts/load/dashboard", "--host", service_url, "--web-port", str(free_port())]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield _wait_for_dashboard(process, log_path, timeout=120)
    finally:
        stop(process, grace=20)


def _wait_for_dashboard(process: subprocess.Popen[bytes], log_path: Path, *, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"scripts/load/dashboard exited with {process.returncode}:\n{log_path.read_text()}")
        match = _URL_LINE.search(log_path.read_text(errors="replace"))
        if match:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(match.group(1), timeout=5).status_code == 200:
                    return match.group(1)
        time.sleep(0.5)  # a subprocess's output and a port: nothing to block on
    pytest.fail(f"the dashboard did not answer within {timeout} s:\n{log_path.read_text()}")


def table(browser: WebDriver) -> list[dict[str, str]]:
    """The table on the current tab, one dict per row, keyed by column title."""
    titles = [th.text.strip() for th in browser.find_elements(By.CSS_SELECTOR, "table thead th")]
    return [
        dict(zip(titles, (td.text.strip() for td in tr.find_elements(By.CSS_SELECTOR, "td")), strict=False))
        for tr in browser.find_elements(By.CSS_SELECTOR, "table tbody tr")
    ]


def open_tab(browser: WebDriver, title: str) -> None:
    browser.find_element(By.XPATH, f"//button[@role='tab'][normalize-space()='{title}']").click()


def picker_box(browser: WebDriver, user_class: str) -> WebElement:
    """The class picker's checkbox for ``user_class``."""
    return browser.find_element(
        By.XPATH, f"//tr[td[normalize-space()='{user_class}']]//input[@type='checkbox']"
    )


def picked(browser: WebDriver) -> dict[str, bool]:
    """The class picker's user classes, and whether each is ticked."""
    rows = browser.find_elements(By.XPATH, "//tr[td and .//input[@type='checkbox']]")
    return {row.text.strip(): row.find_element(By.TAG_NAME, "input").is_selected() for row in rows}


def header_status(browser: WebDriver) -> str:
    return browser.find_element(By.TAG_NAME, "header").text


@pytest.fixture
def artifacts() -> Path:
    """test-artifacts/dashboard/, emptied of an earlier run's files."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.iterdir():
        old.unlink()
    return ARTIFACTS


def test_step_shape_through_the_ui_shows_both_routes_and_the_batching(artifacts: Path) -> None:
    with (
        gunicorn({}) as service,  # the default model, as `bash scripts/serve` serves it
        dashboard(service.url, artifacts / "dashboard.log") as url,
        chromium() as browser,
    ):
        try:
            browser.get(url)
            wait = WebDriverWait(browser, 30)
            shape = wait.until(lambda b: b.find_element(By.ID, "shapeClass"))
            options = {option.get_attribute("value") for option in Select(shape).options}
            assert {"StepLoad", "ArticleLoad", "IndexingLoad", "RetrievalLoad"} <= options, options
            Select(shape).select_by_value("StepLoad")
            assert picked(browser) == dict.fromkeys(USER_CLASSES, True), "every user class starts picked"
            # StepLoad here compares the two routes; RetrievalUser would stop at once on the
            # default model, which serves no reranker.
            for other in ("IndexingUser", "RetrievalUser"):
                picker_box(browser, other).click()
            assert picked(browser) == {
                "BatchedUser": True,
                "IndexingUser": False,
                "NaiveUser": True,
                "RetrievalUser": False,
            }
            browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()

            run_time = len(STEPS) * len(ROUTES) * STEP_SECONDS
            WebDriverWait(browser, run_time + 40, poll_frequency=1).until(
                lambda b: "STOPPED" in header_status(b)
            )

            open_tab(browser, "Statistics")
            stats = {row["Name"]: row for row in WebDriverWait(browser, 10).until(_rows_named(ROUTES))}
            browser.save_screenshot(str(artifacts / "statistics.png"))
            assert "/info" not in stats, "GET /info is a probe, not load"
            for route in ROUTES:
                assert int(stats[route]["# Requests"]) > 0, stats[route]
            # Either route may shed at 64 users, and only with 503: the naive route's requests
            # wait for a thread past a tenth of the latency budget (a standing queue); the
            # batched route's predicted wait passes the budget only on a machine busy with
            # something else. Any other failure is a bug.
            shed_share: dict[str, float] = {}
            for route in ROUTES:
                fails = int(stats[route]["# Fails"])
                errors = failures(url, route)
                assert sum(errors.values()) == fails, (route, errors)
                assert all("503 Server Error" in error for error in errors), (route, errors)
                # The service counts the same 503s, give or take those in flight when the run
                # stopped: its last reading is taken as the users stop, not after their last answer.
                shed = int(batching_figures(url, "whole run", route)["Shed (503)"])
                assert abs(fails - shed) <= STEPS[-1], (route, fails, shed)
                shed_share[route] = fails / int(stats[route]["# Requests"])
            # Batching is what lets the same workers take 64 users: it sheds the smaller share.
            assert shed_share["/predict/batched"] <= shed_share["/predict/naive"], shed_share

            open_tab(browser, "Batching")
            browser.set_window_size(1400, 1400)  # every step's rows in one screenshot
            batching = WebDriverWait(browser, 10).until(
                _rows_named(("batcher (all batched routes)",), "Route")
            )
            browser.save_screenshot(str(artifacts / "batching.png"))
            by_step = {(row["Users"], row["Route"]): row for row in batching}
            for route in ROUTES:
                whole = by_step[("whole run", route)]
                assert int(whole["Requests"]) > 0, whole
            assert int(by_step[(f"{STEPS[-1]} NaiveUser", "/predict/naive")]["Requests"]) > 0
            busiest = by_step[(f"{STEPS[-1]} BatchedUser", "batcher (all batched routes)")]
            assert float(busiest["Mean batch size"]) > 1, busiest

            # The UI's "Download Data" links: the figures as CSV, and in Locust's report.
            figures = requests.get(url + "/batching/csv", timeout=30).text.splitlines()
            assert figures[0].startswith("Users,Route,Requests") and len(figures) == len(batching) + 1
            assert 'id="service-batching"' in requests.get(url + "/stats/report", timeout=30).text

            open_tab(browser, "Charts")
            time.sleep(1)  # the charts animate in
            browser.save_screenshot(str(artifacts / "charts.png"))
        except BaseException:
            browser.save_screenshot(str(artifacts / "failure.png"))
            (artifacts / "failure.html").write_text(browser.page_source)
            with contextlib.suppress(requests.RequestException):
                (artifacts / "failure-stats.json").write_text(
                    requests.get(url + "/stats/requests", timeout=10).text
                )
            raise


def failures(url: str, route: str) -> dict[str, int]:
    """Locust's failures for ``route``: occurrences by error message."""
    errors = requests.get(url + "/stats/requests", timeout=30).json()["errors"]
    return {error["error"]: int(error["occurrences"]) for error in errors if error["name"] == route}


def batching_figures(url: str, users: str, route: str) -> dict[str, str]:
    """One row of the Batching tab's figures, from its CSV download."""
    lines = requests.get(url + "/batching/csv", timeout=30).text.splitlines()
    rows = list(csv.DictReader(lines))
    return next(row for row in rows if row["Users"] == users and row["Route"] == route)


def _rows_named(
    names: tuple[str, ...], column: str = "Name"
) -> Callable[[WebDriver], list[dict[str, str]] | bool]:
    """A wait condition: the current tab's rows, once rows for all ``names`` show."""

    def condition(browser: WebDriver) -> list[dict[str, str]] | bool:
        rows = table(browser)
        present = {row.get(column) for row in rows}
        return rows if all(name in present for name in names) else False

    return condition
