"""The asyncio load generator counts every error and keeps its clients going until the time is up."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scripts.common.launcher import free_port
from scripts.load.loadgen import run_load

# Answers per connection before the stub closes it without warning.
ANSWERS_PER_CONNECTION = 2


class _Handler(BaseHTTPRequestHandler):
    """Answers ANSWERS_PER_CONNECTION requests on a keep-alive connection, then drops it."""

    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.answered = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"outputs": [[1.0]]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.answered += 1
        # No "Connection: close": the client learns only when its next request fails.
        self.close_connection = self.answered >= ANSWERS_PER_CONNECTION

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def flaky_server() -> Iterator[str]:
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


def test_a_client_whose_connection_drops_counts_the_error_reconnects_and_goes_on(flaky_server: str) -> None:
    clients = 4
    result = run_load(flaky_server, b'{"inputs": [1]}', clients, seconds=1.0, prefer_wrk=False)
    assert result.generator == "asyncio"
    assert result.errors >= clients  # every client saw its connection drop at least once...
    # ...and went on: a client that stopped at its first error would answer at most twice.
    assert result.requests > ANSWERS_PER_CONNECTION * clients * 2
    assert result.p50_ms > 0


def test_refused_connections_are_counted_until_the_deadline() -> None:
    url = f"http://127.0.0.1:{free_port()}/predict"  # bound, then closed: nothing listens
    result = run_load(url, b"{}", clients=3, seconds=0.5, prefer_wrk=False)
    assert result.requests == 0
    # Each client retried after its first refusal rather than ending the whole run.
    assert result.errors > 3
    assert result.seconds >= 0.5
