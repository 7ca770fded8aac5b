# design:
# - One Panel per Locust process that runs the test (the local runner or the
#   master; workers have none), made by locustfile.py's init listener.
# - At test_start a greenlet of its own reads the service's /metrics (outside
#   Locust's client, so scrapes never enter the request statistics) and then
#   again every --metrics-interval seconds; test_stopping, fired while the
#   users still run, kills it and reads once more, so the figures cover the
#   whole run and its last step.
# - Each reading's growth over the previous one is added to the whole run and,
#   when the users running (how many of which class) did not change in
#   between, to that step's figures: an interval that straddles a step (or a
#   ramp) would mix two loads.
# - Locust runs on gevent, one OS thread: the scraper greenlet, the web UI's
#   handlers and the event listeners switch only at I/O, and no method below
#   does I/O while the state is half updated, so no lock is needed.
# - Shown three ways: a "Batching" tab in the web UI (Locust's extended tabs,
#   filled through the /stats/requests answer the UI polls), a CSV beside
#   Locust's (--csv PREFIX writes PREFIX_batching.csv at exit; the web UI has a
#   download link), and a table appended to Locust's HTML report (--html, and
#   the web UI's "Download Report").

"""The service's batching figures, read from its /metrics while Locust runs."""

from __future__ import annotations

import csv
import html
import io
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent
import requests
from flask import Response, request

from scripts.load.loadtest.service_metrics import COLUMNS, NOT_APPLICABLE, Reading, rows

logger = logging.getLogger(__name__)

TAB_KEY = "batching"
WHOLE_RUN = "whole run"
DEFAULT_INTERVAL_S = 2.0
_SCRAPE_TIMEOUT_S = 5
_REPORT_MARK = "<!-- service batching figures -->"


@dataclass
class _Step:
    growth: Reading
    seconds: float


class Panel:
    """Reads ``/metrics`` during a run and keeps the figures per user count and for the run."""

    def __init__(self, environment: Any, *, interval: float = DEFAULT_INTERVAL_S) -> None:
        if interval <= 0:
            raise ValueError(f"--metrics-interval must be above 0 seconds, got {interval}")
        self.environment = environment
        self.interval = interval
        self.error: str | None = None
        self._greenlet: gevent.Greenlet | None = None
        self._reset()

    def _reset(self) -> None:
        self._first: tuple[float, Reading] | None = None
        self._last: tuple[float, Reading, str] | None = None
        self._steps: dict[str, _Step] = {}
        self._step_order: dict[str, tuple[int, int]] = {}  # label -> (users, first seen)

    # -- Locust events ------------------------------------------------------------

    def on_test_start(self, **_: Any) -> None:
        self.stop_scraping()
        self._reset()
        self._greenlet = gevent.spawn(self._scrape_forever)

    def on_test_stopping(self, **_: Any) -> None:
        self.stop_scraping()
        self.scrape()

    def on_test_stop(self, **_: Any) -> None:
        self.stop_scraping()  # a run stopped before its users started skips test_stopping

    def stop_scraping(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=True)
            self._greenlet = None

    def _scrape_forever(self) -> None:
        while True:
            self.scrape()
            gevent.sleep(self.interval)  # /metrics is read over HTTP: there is nothing to wait on

    # -- readings -----------------------------------------------------------------

    def scrape(self) -> None:
        host = (self.environment.host or "").rstrip("/")
        try:
            response = requests.get(host + "/metrics", timeout=_SCRAPE_TIMEOUT_S)
            response.raise_for_status()
            reading = Reading.parse(response.text)
        except (requests.RequestException, ValueError) as exc:
            if self.error is None:
                logger.warning("cannot read the service's figures from %s/metrics: %s", host, exc)
            self.error = f"GET {host}/metrics failed: {exc}"
            return
        self.error = None
        runner = self.environment.runner
        self.add(time.monotonic(), reading, runner.user_classes_count if runner is not None else {})

    def add(self, now: float, reading: Reading, running: Mapping[str, int]) -> None:
        """Record a reading taken at ``now`` while ``running`` users (by class name) ran."""
        running = {name: count for name, count in running.items() if count > 0}
        label = " + ".join(f"{count} {name}" for name, count in sorted(running.items()))
        if self._first is None:
            self._first = (now, reading)
        if self._last is not None:
            then, previous, label_then = self._last
            if label_then == label and label:
                step = self._steps.setdefault(label, _Step(Reading(), 0.0))
                self._step_order.setdefault(label, (sum(running.values()), len(self._step_order)))
                step.growth = step.growth + (reading - previous)
                step.seconds += now - then
        self._last = (now, reading, label)

    def rows(self) -> list[dict[str, Any]]:
        """The whole run's rows, then each step's, fewest users first (in order of appearance).

        While ``/metrics`` cannot be read, a first row says why.
        """
        out = (
            [{key: NOT_APPLICABLE for key, _ in COLUMNS} | {"users": "error", "route": self.error}]
            if self.error
            else []
        )
        if self._first is None or self._last is None:
            return out
        (start, first), (end, last, _) = self._first, self._last
        out += rows(WHOLE_RUN, last - first, end - start)
        for label in sorted(self._steps, key=self._step_order.__getitem__):
            step = self._steps[label]
            out.extend(rows(label, step.growth, step.seconds))
        return out

    # -- output -------------------------------------------------------------------

    def csv_text(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow([title for _, title in COLUMNS])
        for row in self.rows():
            writer.writerow([row[key] for key, _ in COLUMNS])
        return buffer.getvalue()

    def html_table(self) -> str:
        head = "".join(f"<th>{html.escape(title)}</th>" for _, title in COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(row[key]))}</td>" for key, _ in COLUMNS) + "</tr>"
            for row in self.rows()
        )
        return (
            f'{_REPORT_MARK}<section id="service-batching" style="font-family:sans-serif;margin:2em">'
            "<h2>The service's own figures (from its /metrics)</h2>"
            "<p>Per route, and for the batcher all batched routes share; "
            "for the whole run, and for each step's users.</p>"
            '<table border="1" cellpadding="4" style="border-collapse:collapse">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></section>"
        )

    def add_to_report(self, report: str) -> str:
        """Locust's HTML report with the figures appended, once."""
        if _REPORT_MARK in report:
            return report
        at = report.rfind("</body>")
        at = len(report) if at < 0 else at
        return report[:at] + self.html_table() + report[at:]

    def write_files(self, options: Any) -> None:
        """At exit: PREFIX_batching.csv beside Locust's CSV files, and the table in its HTML report."""
        if getattr(options, "csv_prefix", None):
            Path(f"{options.csv_prefix}_batching.csv").write_text(self.csv_text(), encoding="utf-8")
        html_file = getattr(options, "html_file", None)
        if html_file and Path(html_file).is_file():
            path = Path(html_file)
            path.write_text(self.add_to_report(path.read_text(encoding="utf-8")), encoding="utf-8")

    # -- web UI ---------------------------------------------------------------------

    def attach(self, web_ui: Any) -> None:
        """A "Batching" tab, a CSV download, and the table in the downloadable report."""
        web_ui.template_args["extended_tabs"] = [{"title": "Batching", "key": TAB_KEY}]
        web_ui.template_args["extended_tables"] = [
            {"key": TAB_KEY, "structure": [{"key": key, "title": title} for key, title in COLUMNS]}
        ]
        web_ui.template_args["extended_csv_files"] = [
            {"href": "./batching/csv", "title": "Download the service's batching figures CSV"}
        ]
        app = web_ui.app
        app.add_url_rule("/batching/csv", "service_batching_csv", self._csv_view)
        app.after_request(self._extend)

    def _csv_view(self) -> Response:
        response = Response(self.csv_text(), mimetype="text/csv")
        response.headers["Content-Disposition"] = "attachment;filename=service_batching.csv"
        return response

    def _extend(self, response: Response) -> Response:
        # Locust's UI polls /stats/requests every 2 s and shows each extended tab's
        # rows from its "extended_stats"; the answer may be a cached object, so the
        # key is set, never appended to.
        if request.endpoint == "locust.request_stats" and response.is_json:
            payload = response.get_json()
            payload["extended_stats"] = [{"key": TAB_KEY, "data": self.rows()}]
            response.set_data(json.dumps(payload))
        elif request.endpoint == "locust.stats_report" and response.status_code == 200:
            response.set_data(self.add_to_report(response.get_data(as_text=True)))
        return response
