"""End to end: real nginx in front of real gunicorns, one host per loopback address."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import requests

from scripts.render_nginx import TEMPLATE, Options, gunicorn_keepalive, render
from service.settings import Settings
from tests.support.nginx import NGINX, SKIP_REASON, Proxy, nginx
from tests.support.server import Server, free_port, gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(NGINX is None, reason=SKIP_REASON)]

MAX_BODY = 4096
WIDTH = 16
SMALL = {
    "SERVE_MODEL": "mlp",
    "SERVE_MLP_WIDTH": str(WIDTH),
    "SERVE_MLP_DEPTH": "2",
    "SERVE_WORKERS": "1",
    "SERVE_TORCH_THREADS": "1",
    "SERVE_MAX_BODY_BYTES": str(MAX_BODY),
}
# gunicorn writes an access line per request with the X-Request-ID it received and
# the port of the connection (nginx's side), which shows when nginx reuses one.
ACCESS_LOG_ARGS = (
    "--access-logfile",
    "-",
    "--access-logformat",
    "access rid=%({x-request-id}i)s port=%({remote_port}e)s status=%(s)s",
)
HOSTS = ("127.0.0.2", "127.0.0.3")
T = TypeVar("T")


def backend(host: str) -> AbstractContextManager[Server]:
    return gunicorn(SMALL, host=host, args=ACCESS_LOG_ARGS)


def address(server: Server) -> str:
    return server.url.removeprefix("http://")


def item(seed: int = 0) -> list[float]:
    return [float((seed + i) % 7) / 7 for i in range(WIDTH)]


def wait_for(read: Callable[..., list[T]], *args: Any, count: int = 1, timeout: float = 10) -> list[T]:
    """``read(*args)`` once it returns ``count`` items, or what it returns when ``timeout`` s have passed.

    A log line can trail the response it records: gunicorn writes its own after
    the response has gone out, nginx its own once it is done with the request.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = read(*args)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)  # log files give no event to block on


def access_lines(server: Server, rid_prefix: str, count: int, timeout: float = 10) -> list[dict[str, str]]:
    """The backend's access lines whose request id starts with ``rid_prefix``, once ``count`` are there."""
    pattern = re.compile(r"access rid=(\S+) port=(\S+) status=(\S+)")
    deadline = time.monotonic() + timeout
    while True:
        found = [
            {"rid": m[1], "port": m[2], "status": m[3]}
            for m in pattern.finditer(server.log())
            if m[1].startswith(rid_prefix)
        ]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)  # gunicorn writes the line just after the response goes out


def nginx_lines(proxy: Proxy, request_id: str) -> list[dict[str, object]]:
    return [entry for entry in proxy.access_log() if entry["request_id"] == request_id]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Server, Server]]:
    with backend(HOSTS[0]) as a, backend(HOSTS[1]) as b:
        yield a, b


@pytest.fixture(scope="module")
def proxy(pair: tuple[Server, Server]) -> Iterator[Proxy]:
    # Only 127.0.0.2 is the "monitoring network" here; the tests' client is 127.0.0.1.
    with nginx([address(s) for s in pair], SMALL, metrics_allow=["127.0.0.2"]) as proxy:
        yield proxy


def test_rendered_configs_pass_nginx_syntax_check(tmp_path: Path) -> None:
    settings = Settings(max_body_bytes=MAX_BODY, request_timeout_ms=1500)
    for backends in (("127.0.0.1:8000",), ("10.0.0.1:8000", "10.0.0.2:8000", f"unix:{tmp_path}/g.sock")):
        options = Options(prefix=str(tmp_path), backends=backends, listen=str(free_port()))
        conf = tmp_path / "nginx.conf"
        conf.write_text(render(TEMPLATE.read_text(), options, settings, gunicorn_keepalive()))
        assert NGINX is not None
        check = subprocess.run(
            [NGINX, "-t", "-p", str(tmp_path), "-c", str(conf), "-e", str(tmp_path / "error.log")],
            capture_output=True,
            text=True,
            check=False,
        )
        assert check.returncode == 0, check.stderr


def test_both_routes_answer_through_nginx(proxy: Proxy) -> None:
    body = {"inputs": [item(0), item(3)]}
    naive = requests.post(proxy.url + "/predict/naive", json=body, timeout=30)
    batched = requests.post(proxy.url + "/predict/batched", json=body, timeout=30)
    assert naive.status_code == batched.status_code == 200
    assert naive.json()["model"] == batched.json()["model"] == "mlp"
    np.testing.assert_allclose(naive.json()["outputs"], batched.json()["outputs"], atol=1e-5)
    assert np.array(naive.json()["outputs"]).shape == (2, WIDTH)
    assert requests.get(proxy.url + "/healthz", timeout=10).json() == {"status": "ok"}
    assert requests.get(proxy.url + "/readyz", timeout=10).json() == {"status": "ready"}
    # No version banner.
    assert naive.headers["Server"] == "nginx"


def request_ids(response: requests.Response) -> list[str]:
    """Every X-Request-ID header of the response, as sent (requests would join repeats with commas)."""
    return list(response.raw.headers.getlist("X-Request-ID"))


def test_the_clients_request_id_reaches_the_service(proxy: Proxy, pair: tuple[Server, Server]) -> None:
    rid = f"client-{uuid.uuid4().hex}"
    response = requests.post(proxy.url + "/predict", json={"inputs": [item()]}, headers={"X-Request-ID": rid})
    assert response.status_code == 200
    assert response.headers["X-Request-ID"] == rid
    seen = [line for server in pair for line in access_lines(server, rid, 1, timeout=2)]
    assert [line["rid"] for line in seen] == [rid]
    assert any(entry["request_id"] == rid for entry in proxy.access_log())


def test_nginx_makes_up_a_request_id_when_the_client_sends_none_or_a_bad_one(
    proxy: Proxy, pair: tuple[Server, Server]
) -> None:
    for headers in ({}, {"X-Request-ID": "two words\tand a tab"}):
        response = requests.get(proxy.url + "/info", headers=headers, timeout=10)
        rid = response.headers["X-Request-ID"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid), rid
        assert [line["rid"] for s in pair for line in access_lines(s, rid, 1, timeout=2)] == [rid]


def test_a_body_over_the_limit_gets_a_json_413_from_nginx(proxy: Proxy) -> None:
    exactly = json.dumps({"inputs": [item()]}).encode().ljust(MAX_BODY)
    headers = {"Content-Type": "application/json"}
    # nginx's limit is the service's: a body of exactly SERVE_MAX_BODY_BYTES gets through...
    assert requests.post(proxy.url + "/predict", data=exactly, headers=headers, timeout=30).status_code == 200
    # ...and one byte more is refused by nginx, before any backend sees it. So is
    # a body far larger than the sockets' buffers, which the client is still
    # sending when the 413 comes: nginx reads and drops the rest (lingering_close
    # is on by default), so the client reads the 413, not a connection reset.
    for body in (exactly + b" ", exactly * 256):
        response = requests.post(proxy.url + "/predict", data=body, headers=headers, timeout=30)
        assert response.status_code == 413
        assert response.headers["Content-Type"] == "application/json"
        assert "SERVE_MAX_BODY_BYTES" in response.json()["error"]
        [rid] = request_ids(response)
        # nginx logs the request only once the client has closed the connection.
        refused = wait_for(nginx_lines, proxy, rid)
        assert [entry["upstream_addr"] for entry in refused] == [""]


def test_metrics_are_served_only_to_the_monitoring_network(proxy: Proxy) -> None:
    denied = requests.get(proxy.url + "/metrics", timeout=10)
    assert denied.status_code == 403
    assert "monitoring network" in denied.json()["error"]
    host, port = proxy.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10, source_address=("127.0.0.2", 0))
    try:
        connection.request("GET", "/metrics")
        allowed = connection.getresponse()
        allowed.read()
    finally:
        connection.close()
    # Passed to the service: whatever it answers for /metrics, it is not nginx's 403.
    assert allowed.status != 403
    assert allowed.getheader("X-Request-ID")


def test_traffic_reaches_both_backends(proxy: Proxy, pair: tuple[Server, Server]) -> None:
    pids = {server.get("/info").json()["pid"] for server in pair}
    assert len(pids) == 2
    seen = {requests.get(proxy.url + "/info", timeout=10).json()["pid"] for _ in range(10)}
    assert seen == pids


def test_idle_gaps_longer_than_gunicorns_default_keepalive_cause_no_502(
    proxy: Proxy, pair: tuple[Server, Server]
) -> None:
    # gunicorn's default keepalive is 2 s; with it, nginx would reuse connections
    # gunicorn is closing. gunicorn_conf.py keeps them open longer than nginx does.
    clients, rounds, gap_s = 4, 3, 2.5
    tag = f"keepalive-{uuid.uuid4().hex[:8]}-"

    def client(c: int) -> list[int]:
        statuses = []
        with requests.Session() as session:
            for r in range(rounds):
                if r:
                    time.sleep(gap_s)  # the idle gap is the point of the test
                response = session.post(
                    proxy.url + "/predict",
                    json={"inputs": [item(c)]},
                    headers={"X-Request-ID": f"{tag}{c}-{r}"},
                    timeout=30,
                )
                statuses.append(response.status_code)
        return statuses

    with ThreadPoolExecutor(clients) as pool:
        statuses = [s for result in pool.map(client, range(clients)) for s in result]
    assert statuses == [200] * clients * rounds
    lines = [line for s in pair for line in access_lines(s, tag, clients * rounds // 2)]
    assert len(lines) == clients * rounds
    # Connections outlived the gaps: each round reused one the round before had used
    # (nginx's side of a connection is its port). With gunicorn's default keepalive
    # every round would need new ones.
    ports = [{line["port"] for line in lines if line["rid"].endswith(f"-{r}")} for r in range(rounds)]
    assert all(ports[r] & ports[r - 1] for r in range(1, rounds)), ports


def load(url: str, total: int, clients: int, midway: int, at_midway: Callable[[], None]) -> list[int]:
    """``total`` requests from ``clients`` closed-loop clients; ``at_midway()`` after ``midway`` answers."""
    answered = 0
    lock = threading.Lock()
    reached = threading.Event()

    def client(c: int) -> list[int]:
        nonlocal answered
        statuses = []
        with requests.Session() as session:
            for i in range(total // clients):
                response = session.post(url + "/predict", json={"inputs": [item(c + i)]}, timeout=30)
                statuses.append(response.status_code)
                with lock:
                    answered += 1
                    if answered == midway:
                        reached.set()
        return statuses

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, c) for c in range(clients)]
        assert reached.wait(60)
        at_midway()
        return [s for f in futures for s in f.result()]


def test_a_backend_killed_under_load_costs_no_request() -> None:
    with (
        backend(HOSTS[0]) as survivor,
        backend(HOSTS[1]) as victim,
        nginx([address(survivor), address(victim)], SMALL) as proxy,
    ):
        # The whole gunicorn, master and workers, as when its host dies.
        statuses = load(proxy.url, 160, 4, 40, lambda: os.killpg(victim.process.pid, signal.SIGKILL))
        assert statuses == [200] * 160
        upstreams = {entry["upstream_addr"] for entry in proxy.access_log()}
        assert address(victim) in upstreams  # it served before it died

        # With every backend gone, nginx's own 502 is JSON too.
        os.killpg(survivor.process.pid, signal.SIGKILL)
        gone = requests.post(proxy.url + "/predict", json={"inputs": [item()]}, timeout=30)
        assert gone.status_code == 502
        assert gone.headers["Content-Type"] == "application/json"
        assert "backend" in gone.json()["error"]
