"""End to end: real nginx in front of real gunicorns, one host per loopback address."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import requests

from scripts.deploy.render_nginx import TEMPLATE, Options, gunicorn_keepalive, render
from service.config.settings import Settings
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
# The service's access lines as JSON, so that a test reads their fields.
BACKEND = {**SMALL, "SERVE_LOG_FORMAT": "json"}
# gunicorn's own access log, off in production, is on here for one field the
# service's line lacks: the port of nginx's side of the connection, which shows
# whether nginx reused a connection to the backend.
PORT_LOG_ARGS = (
    "--access-logfile",
    "-",
    "--access-logformat",
    "connection rid=%({x-request-id}i)s port=%({remote_port}e)s",
)
HOSTS = ("127.0.0.2", "127.0.0.3")
JSON = {"Content-Type": "application/json"}
T = TypeVar("T")


def backend(host: str) -> AbstractContextManager[Server]:
    return gunicorn(BACKEND, host=host, args=PORT_LOG_ARGS)


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


def log_lines(servers: Sequence[Server]) -> Iterator[str]:
    """Every whole line the backends have logged; a line being written now is left out."""
    for server in servers:
        text = server.log()
        yield from text[: text.rfind("\n") + 1].splitlines()


def service_lines(servers: Sequence[Server], rid_prefix: str) -> list[dict[str, Any]]:
    """The service's access lines whose request id starts with ``rid_prefix``."""
    documents = (json.loads(line) for line in log_lines(servers) if line.startswith("{"))
    return [
        doc
        for doc in documents
        if doc["logger"] == "service.access" and doc["request_id"].startswith(rid_prefix)
    ]


def connection_ports(servers: Sequence[Server], rid_prefix: str) -> list[tuple[str, str]]:
    """(request id, port of nginx's side of the connection) from gunicorn's own access lines."""
    pattern = re.compile(r"connection rid=(\S+) port=(\S+)")
    matches = (pattern.fullmatch(line) for line in log_lines(servers))
    return [(m[1], m[2]) for m in matches if m is not None and m[1].startswith(rid_prefix)]


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


# "/", "+" and "=" too, as in base64 or a trace's span path: the service accepts them, so nginx must.
@pytest.mark.parametrize("template", ["client-{}", "span/{}+tenant=a.b:c_d"])
def test_the_clients_request_id_reaches_the_service_and_comes_back_once(
    proxy: Proxy, pair: tuple[Server, Server], template: str
) -> None:
    rid = template.format(uuid.uuid4().hex)
    response = requests.post(
        proxy.url + "/predict", json={"inputs": [item()]}, headers={"X-Request-ID": rid}, timeout=30
    )
    assert response.status_code == 200
    # The service echoes the id it got; nginx drops that copy and adds the same id
    # itself (to its own errors too), so the client reads it once.
    assert request_ids(response) == [rid]
    # One request, one line, on whichever backend served it.
    lines = wait_for(service_lines, pair, rid)
    assert [(line["request_id"], line["route"], line["status"]) for line in lines] == [(rid, "/predict", 200)]
    assert len(wait_for(nginx_lines, proxy, rid)) == 1


def test_nginx_makes_up_a_request_id_when_the_client_sends_none_or_a_bad_one(
    proxy: Proxy, pair: tuple[Server, Server]
) -> None:
    for headers in ({}, {"X-Request-ID": "two words\tand a tab"}):
        response = requests.get(proxy.url + "/info", headers=headers, timeout=10)
        assert response.status_code == 200
        [rid] = request_ids(response)
        assert re.fullmatch(r"[0-9a-f]{32}", rid), rid
        # The service logged the id nginx made up, not one of its own.
        assert [line["request_id"] for line in wait_for(service_lines, pair, rid)] == [rid]


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
    lines = wait_for(connection_ports, pair, tag, count=clients * rounds)
    assert len(lines) == clients * rounds
    # Connections outlived the gaps: each round reused one the round before had used
    # (nginx's side of a connection is its port). With gunicorn's default keepalive
    # every round would need new ones.
    ports = [{port for rid, port in lines if rid.endswith(f"-{r}")} for r in range(rounds)]
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

        # With every backend gone, nginx's own error is JSON too: 502 when it tried them
        # all, 503 (with Retry-After) when the victim was still out for its failures and
        # none was left to try.
        os.killpg(survivor.process.pid, signal.SIGKILL)
        gone = requests.post(proxy.url + "/predict", json={"inputs": [item()]}, timeout=30)
        assert gone.status_code in (502, 503)
        assert gone.status_code == 502 or gone.headers["Retry-After"] == "1"
        assert gone.headers["Content-Type"] == "application/json"
        assert "backend" in gone.json()["error"]


def test_the_standard_protocols_pass_through_nginx(proxy: Proxy) -> None:
    # Open Inference Protocol v2, with binary tensor data in and out.
    header = json.dumps(
        {
            "id": "through-nginx",
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, WIDTH],
                    "parameters": {"binary_data_size": WIDTH * 4},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    raw = np.array([item()], dtype="<f4").tobytes()
    response = requests.post(
        proxy.url + "/v2/models/mlp/infer",
        data=header + raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
        timeout=30,
    )
    assert response.status_code == 200, response.content
    length = int(response.headers["Inference-Header-Content-Length"])
    document = json.loads(response.content[:length])
    assert document["id"] == "through-nginx"
    outputs = np.frombuffer(response.content[length:], "<f4")
    expected = requests.post(proxy.url + "/predict", json={"inputs": [item()]}, timeout=30).json()["outputs"]
    np.testing.assert_allclose(outputs, expected[0], atol=1e-5)
    assert requests.get(proxy.url + "/v2/health/ready", timeout=10).json() == {"ready": True}
    # The embeddings API: /v1/models lists the mlp with its task; it takes no text, and the
    # service says so in OpenAI's shape.
    listed = requests.get(proxy.url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["task"]) for m in listed] == [("mlp", "generic")]
    body = {"model": "mlp", "input": "x"}
    refused = requests.post(proxy.url + "/v1/embeddings", json=body, timeout=10)
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "model_not_found"


def test_nginx_words_its_own_errors_on_v1_as_openai_does(proxy: Proxy) -> None:
    body = json.dumps({"model": "mlp", "input": "x" * MAX_BODY}).encode()
    response = requests.post(
        proxy.url + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert "SERVE_MAX_BODY_BYTES" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert request_ids(response)
    # The same limit on /v2 gets the service's plain shape.
    v2 = requests.post(proxy.url + "/v2/models/mlp/infer", data=body, timeout=30)
    assert v2.status_code == 413
    assert "SERVE_MAX_BODY_BYTES" in v2.json()["error"]


def stalled_post(url: str, path: str, body: bytes) -> socket.socket:
    """A POST whose headers and half its body are sent: in flight at nginx until the rest comes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
    return sock


def finish(sock: socket.socket, body: bytes) -> int:
    """Send the rest of ``stalled_post``'s body; the status it is answered with."""
    with sock:
        sock.sendall(body[len(body) // 2 :])
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.read()
        return response.status


SLEEPY = {"SERVE_MODEL": "tests.support.models:sleepy", "SERVE_WORKERS": "1", "SERVE_TORCH_THREADS": "1"}


def sleep_at_backend(url: str, seconds: float) -> int:
    """A request that keeps the backend busy for ``seconds``; its status."""
    return requests.post(url + "/predict/naive", json={"inputs": [seconds]}, timeout=30).status_code


def in_flight(server: Server) -> float:
    """The requests the backend is handling now, read from its own metrics."""
    text = server.get("/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("serve_http_requests_in_flight")
    )


def test_when_every_backend_is_full_nginx_refuses_itself_with_a_held_json_503() -> None:
    instant = json.dumps({"inputs": [0]}).encode()
    # A backend that is down beside the full one: a request tries it first, is retried, finds no room.
    down = f"127.0.0.1:{free_port()}"
    with gunicorn(SLEEPY) as backend, nginx([down, address(backend)], SLEEPY, max_in_flight=2) as limited:
        # Clients still sending their bodies hold no room: only requests at the backend count.
        stalled = [stalled_post(limited.url, "/predict/naive", instant) for _ in range(2)]
        assert sleep_at_backend(limited.url, 0) == 200
        with ThreadPoolExecutor(2) as pool:
            sleeping = [pool.submit(sleep_at_backend, limited.url, 8) for _ in range(2)]
            # Asked of the backend itself: a probe through nginx would take the room it probes.
            deadline = time.monotonic() + 10
            while in_flight(backend) < 3:  # the two, and this scrape
                assert time.monotonic() < deadline, "the two requests never reached the backend"
                time.sleep(0.05)
            asked = time.monotonic()
            refused = requests.post(limited.url + "/predict/naive", data=instant, headers=JSON, timeout=10)
            assert refused.status_code == 503, refused.text
            # Held about a second before its body is out, so that a client that resends at once cannot spin.
            assert time.monotonic() - asked >= 0.5
            assert refused.headers["Retry-After"] == "1"
            assert "every backend has 2 requests in flight" in refused.json()["error"]
            [rid] = request_ids(refused)
            # Answered by nginx alone, which names the upstream group last, not a backend.
            [entry] = wait_for(nginx_lines, limited, rid)
            assert str(entry["upstream_addr"]).split(", ")[-1] == "serve"
            # On /v1 in the OpenAI API's shape, as nginx's other errors there.
            embeddings = {"model": "sleepy", "input": "x"}
            openai = requests.post(limited.url + "/v1/embeddings", json=embeddings, timeout=10)
            assert openai.status_code == 503
            assert "requests in flight" in openai.json()["error"]["message"]
            assert openai.json()["error"]["type"] == "server_error"
            assert [future.result() for future in sleeping] == [200, 200]
        # Their room is free again, and the slow clients are served once their bodies are in.
        assert sleep_at_backend(limited.url, 0) == 200
        assert [finish(sock, instant) for sock in stalled] == [200, 200]
