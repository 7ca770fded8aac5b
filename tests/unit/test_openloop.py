"""The open-loop generator: its schedules, and latencies timed from the scheduled send."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scripts.common.launcher import free_port
from scripts.load import openloop

# The stub holds every request this long: a closed-loop client would send a tenth as many.
HOLD_S = 0.2


class _Handler(BaseHTTPRequestHandler):
    """Every second request is refused with 503 and Retry-After; each answer takes HOLD_S."""

    protocol_version = "HTTP/1.1"
    count = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with _Handler.lock:
            _Handler.count += 1
            refuse = _Handler.count % 2 == 0
        threading.Event().wait(HOLD_S)  # stands in for the service's work; not a poll
        body = b"{}"
        self.send_response(503 if refuse else 200)
        if refuse:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def slow_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/predict"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_fixed_schedule_is_evenly_spaced_and_a_poisson_one_averages_the_rate() -> None:
    assert openloop.schedule(4, 1.0, "fixed", random.Random(0)) == [0.0, 0.25, 0.5, 0.75]
    times = openloop.schedule(1000, 10.0, "poisson", random.Random(0))
    assert 9500 < len(times) < 10500
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 10.0
    assert openloop.schedule(0, 10.0, "fixed", random.Random(0)) == []


def test_requests_leave_on_schedule_whatever_the_answers_take(slow_server: str) -> None:
    request = openloop.Request(b'{"inputs": ["a"]}', "/predict")
    result = openloop.run(slow_server, [request], rate=50, seconds=1.0, kind="fixed", timeout_s=10)
    summary = result.summary()
    # All 50 left within the second, though each answer took 0.2 s.
    assert summary["sent"] == 50
    assert summary["by_status"] == {"200": 25, "503": 25}
    assert summary["refused_with_retry_after"] == 25
    assert max(o.scheduled for o in result.outcomes) < 1.0
    # Timed from the scheduled send: never less than what the stub held each one.
    assert min(o.latency_s for o in result.outcomes) >= HOLD_S
    assert summary["accepted_ms"]["p50"] >= 1000 * HOLD_S
    assert summary["peak_connections"] >= 50 * HOLD_S  # in flight together, one connection each


def test_a_service_that_is_not_there_gives_connection_errors_not_a_hang() -> None:
    url = f"http://127.0.0.1:{free_port()}/predict"  # bound, then closed: nothing listens
    result = openloop.run(url, [openloop.Request(b"{}", "/predict")], rate=20, seconds=0.5, kind="fixed")
    assert result.by_status() == {openloop.CONNECTION_ERROR: 10}


def test_loopback_only() -> None:
    with pytest.raises(SystemExit, match="only loopback targets"):
        openloop.run("http://192.0.2.1/predict", [openloop.Request(b"{}", "/predict")], rate=1, seconds=1)
