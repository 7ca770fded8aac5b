"""End to end: metrics summed over two gunicorn workers, a worker killed, request ids in the log."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.support.metrics import Scrape
from tests.support.models import HOLD
from tests.support.server import Server, gunicorn

pytestmark = pytest.mark.e2e

TWO_MLP_WORKERS = {
    "SERVE_MODEL": "mlp",
    "SERVE_MLP_WIDTH": "16",
    "SERVE_MLP_DEPTH": "2",
    "SERVE_WORKERS": "2",
    "SERVE_TORCH_THREADS": "1",
}
VECTOR = [0.5] * 16
REQUESTS = "serve_http_requests_total"


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def two_workers(request: pytest.FixtureRequest) -> Iterator[Server]:
    # Under gevent the batch thread and the request greenlets share the metrics' locks.
    with gunicorn({**TWO_MLP_WORKERS, "SERVE_WORKER_CLASS": request.param}) as server:
        yield server


def scrape(server: Server) -> Scrape:
    response = server.get("/metrics")
    assert response.status_code == 200, response.text
    return Scrape.parse(response.text)


def info_until_both_workers_answer(server: Server, rounds: int = 50, burst: int = 8) -> Counter[int]:
    """GET /info over new connections until two pids answered; how many each answered.

    The kernel hands a new connection to whichever worker accepts first, and an
    idle one may win every time when requests come one by one; a burst of
    concurrent connections keeps one worker busy while the other accepts.
    """
    answered: Counter[int] = Counter()
    with ThreadPoolExecutor(burst) as pool:
        for _ in range(rounds):
            answered.update(pool.map(lambda _: server.get("/info").json()["pid"], range(burst)))
            if len(answered) == 2:
                return answered
    raise AssertionError(f"only workers {sorted(answered)} answered {rounds * burst} requests")


def test_counters_equal_what_was_sent_over_both_workers(two_workers: Server) -> None:
    before = scrape(two_workers)
    answered = info_until_both_workers_answer(two_workers)
    for _ in range(5):
        assert two_workers.post("/predict/naive", json={"inputs": [VECTOR]}).status_code == 200
    for _ in range(7):
        assert two_workers.post("/predict/batched", json={"inputs": [VECTOR, VECTOR]}).status_code == 200
    for _ in range(3):
        assert two_workers.post("/predict", json={"inputs": [VECTOR] * 3}).status_code == 200
    for _ in range(2):
        bad = two_workers.post("/predict/batched", data=b"{", headers={"Content-Type": "application/json"})
        assert bad.status_code == 400
        assert two_workers.get("/no/such/path").status_code == 404

    def one(_: int) -> int:
        return requests.post(
            two_workers.url + "/predict/batched", json={"inputs": [VECTOR]}, timeout=60
        ).status_code

    with ThreadPoolExecutor(8) as pool:  # concurrent, so that some batches hold several requests
        assert list(pool.map(one, range(24))) == [200] * 24

    after = scrape(two_workers)

    def sent(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    assert sent(REQUESTS, route="/info", code="200") == sum(answered.values())
    assert sent(REQUESTS, route="/predict/naive", code="200") == 5
    assert sent(REQUESTS, route="/predict/batched", code="200") == 7 + 24
    assert sent(REQUESTS, route="/predict", code="200") == 3
    assert sent(REQUESTS, route="/predict/batched", code="400") == 2
    assert sent(REQUESTS, route="unmatched", code="404") == 2
    assert sent("serve_http_request_duration_seconds_count", route="/predict/batched") == 7 + 24 + 2
    assert sent("serve_inferred_items_total") == 7 * 2 + 3 * 3 + 24
    assert sent("serve_batch_queue_wait_seconds_count") == 7 + 3 + 24
    # However the 24 concurrent requests were batched, the histogram and the counters agree.
    assert after.total("serve_batch_size_items_count") == after.total("serve_batches_total")
    assert after.total("serve_batch_size_items_sum") == after.total("serve_inferred_items_total")
    assert after.total("serve_batch_model_duration_seconds_count") == after.total("serve_batches_total")
    assert 7 + 3 < sent("serve_batches_total") <= 7 + 3 + 24
    # Both workers label their batches with the one model's served name, as its info
    # does; a 404 reached no model, and says so with an empty label.
    (model,) = {labels["model"] for labels in after.series("serve_model_info")}
    for name in ("serve_batches_total", "serve_batch_size_items_count", "serve_batch_queue_depth"):
        assert {labels["model"] for labels in after.series(name)} == {model}, name
    assert {labels["model"] for labels in after.series(REQUESTS) if labels["route"] == "unmatched"} == {""}
    # Both workers are in the one scrape, with their pids, and nothing is left in flight.
    assert sorted(int(s["pid"]) for s in after.series("serve_worker_info")) == sorted(answered)
    assert after.total("serve_http_requests_in_flight") == 1  # this scrape
    assert after.total("serve_batch_queue_depth") == 0


def test_request_id_is_echoed_and_written_to_the_access_line(two_workers: Server) -> None:
    response = two_workers.post(
        "/predict/batched", json={"inputs": [VECTOR] * 2}, headers={"X-Request-ID": "e2e-trace-42"}
    )
    assert response.headers["X-Request-ID"] == "e2e-trace-42"
    replaced = two_workers.get("/healthz", headers={"X-Request-ID": "bad id"})
    fresh = replaced.headers["X-Request-ID"]
    assert fresh != "bad id" and len(fresh) == 32

    lines = _wait_for_lines(two_workers, "request_id=e2e-trace-42", f"request_id={fresh}")
    (line,) = [line for line in lines if "e2e-trace-42" in line]
    assert '"POST /predict/batched" 200' in line
    assert "route=/predict/batched" in line and "batch_size=2" in line and " ms " in line
    assert "[service.access]" in line
    # One line per request: gunicorn's own access log stays off.
    assert sum("e2e-trace-42" in line for line in two_workers.log().splitlines()) == 1


def _wait_for_lines(server: Server, *needles: str, timeout: float = 10) -> list[str]:
    """The log's lines, once every needle is in it (workers write their lines as they finish)."""
    deadline = time.monotonic() + timeout
    while True:
        log = server.log()
        if all(needle in log for needle in needles) or time.monotonic() > deadline:
            return log.splitlines()
        time.sleep(0.05)  # the log file offers nothing to wait on


def test_a_killed_workers_counters_stay_and_its_gauges_go(tmp_path: Path) -> None:
    env = {
        **TWO_MLP_WORKERS,
        "SERVE_MODEL": "tests.support.models:holding",
        "SERVE_LOG_FORMAT": "json",
        "TEST_HOLD_DIR": str(tmp_path),
    }
    with gunicorn(env) as server:
        answered = info_until_both_workers_answer(server)
        for _ in range(4):
            assert server.post("/predict/batched", json={"inputs": ["abc"]}).status_code == 200

        held_outcome: list[object] = []

        def send_held() -> None:
            try:
                held_outcome.append(server.post("/predict/batched", json={"inputs": [HOLD]}).status_code)
            except requests.RequestException as exc:  # its worker is killed under it
                held_outcome.append(exc)

        holder = threading.Thread(target=send_held)
        holder.start()
        held_pid = _wait_for_held_pid(tmp_path)
        assert held_pid in answered, f"worker {held_pid} holds the batch but never answered /info"

        busy = scrape(server)
        slots = {int(s["pid"]): s["slot"] for s in busy.series("serve_worker_info")}
        assert sorted(slots.values()) == ["0", "1"]
        assert busy.total("serve_http_requests_in_flight") == 2  # the held request and this scrape
        assert busy.total("serve_batch_queue_depth") == 0  # it was taken into its batch
        counted = {
            route: busy.total(REQUESTS, route=route, code="200") for route in ("/info", "/predict/batched")
        }
        assert counted == {"/info": sum(answered.values()), "/predict/batched": 4}
        # A worker's access lines go out up to 50 ms after their requests, and a
        # SIGKILL loses what is still queued (docs/monitoring.md): let them out first.
        _wait_for_count(server, '"route": "/predict/batched"', 4)

        os.kill(held_pid, signal.SIGKILL)
        holder.join(60)
        assert held_outcome and not isinstance(held_outcome[0], int), held_outcome

        after = _wait_for_replacement(server, gone=held_pid)
        # The replacement took the dead worker's slot.
        assert sorted(s["slot"] for s in after.series("serve_worker_info")) == ["0", "1"]
        # The dead worker's requests are still counted, the one it died holding is not...
        assert {
            route: after.total(REQUESTS, route=route, code="200") for route in ("/info", "/predict/batched")
        } == counted
        # ...and it no longer counts toward the gauges: only this scrape is in flight.
        assert after.total("serve_http_requests_in_flight") == 1
        assert after.total("serve_batch_queue_depth") == 0
        assert after.total("serve_batch_size_items_count") == after.total("serve_batches_total") == 4

        access = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        routes = [doc["route"] for doc in access if doc["logger"] == "service.access"]
        assert routes.count("/predict/batched") == 4
        assert all(doc["request_id"] for doc in access if doc["logger"] == "service.access")


def _wait_for_count(server: Server, needle: str, count: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while server.log().count(needle) < count and time.monotonic() < deadline:
        time.sleep(0.05)  # the log file offers nothing to wait on


def _wait_for_held_pid(directory: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        marks = list(directory.glob("held-*"))
        if marks:
            return int(marks[0].name.removeprefix("held-"))
        time.sleep(0.05)  # the marker is written by another process
    raise AssertionError("no worker started the held batch")


def _wait_for_replacement(server: Server, gone: int, timeout: float = 60) -> Scrape:
    """The first scrape that shows two live workers, neither of them ``gone``."""
    deadline = time.monotonic() + timeout
    while True:
        scraped = scrape(server)
        pids = {int(s["pid"]) for s in scraped.series("serve_worker_info")}
        if len(pids) == 2 and gone not in pids:
            return scraped
        if time.monotonic() > deadline:
            raise AssertionError(f"workers {sorted(pids)} after killing {gone}")
        time.sleep(0.1)  # the master replaces the worker in its own time
