"""End to end: the planned topology under real gunicorn, for each worker class."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from service.models.mlp import MLPModel
from tests.support.server import Server, gunicorn

pytestmark = pytest.mark.e2e

SMALL_MLP = {"SERVE_MODEL": "mlp", "SERVE_MLP_WIDTH": "16", "SERVE_MLP_DEPTH": "2"}
SLEEPY = {"SERVE_MODEL": "tests.support.models:sleepy"}
SLOT_LINE = re.compile(r"worker (\d+) takes slot (\d+): device (\S+),")


@pytest.fixture(scope="module", params=["gthread", "gevent", "sync"])
def mlp_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Server]]:
    with gunicorn({**SMALL_MLP, "SERVE_WORKERS": "1", "SERVE_WORKER_CLASS": request.param}) as server:
        yield request.param, server


@pytest.fixture(scope="module", params=["gthread", "gevent", "sync"])
def sleepy_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Server]]:
    with gunicorn({**SLEEPY, "SERVE_WORKERS": "1", "SERVE_WORKER_CLASS": request.param}) as server:
        yield request.param, server


def test_both_routes_answer_correctly(mlp_server: tuple[str, Server]) -> None:
    worker_class, server = mlp_server
    items = np.random.default_rng(7).normal(size=(5, 16)).round(3).tolist()
    expected = MLPModel(16, 2, 0, "cpu").predict([np.array(i, dtype=np.float32) for i in items])
    for route in ("/predict/naive", "/predict/batched"):
        response = server.post(route, json={"inputs": items})
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(response.json()["outputs"], expected, atol=1e-5)
    info = server.get("/info").json()
    assert (info["slot"], info["device"], info["torch_threads"]) == (0, "cpu", len(os.sched_getaffinity(0)))
    # gthread runs as its subclass that balances connections, gevent as one that keeps subprocess native.
    gunicorn_class = {
        "gthread": "service.host.worker.BalancedThreadWorker",
        "gevent": "service.host.gevent_worker.GeventWorker",
    }.get(worker_class, worker_class)
    assert f"Using worker: {gunicorn_class}" in server.log()
    assert "Worker topology: 1 " in server.log()


def concurrent_batch_sizes(server: Server, clients: int, seconds: float) -> list[int]:
    def one(i: int) -> int:
        response = requests.post(server.url + "/predict/batched", json={"inputs": [seconds]}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == [[seconds, 2 * seconds]]
        return int(response.headers["X-Batch-Size"])

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(clients)))


def test_concurrent_requests_form_batches_except_under_sync(sleepy_server: tuple[str, Server]) -> None:
    worker_class, server = sleepy_server
    if worker_class == "sync":
        # One request at a time per worker: the plan warns that nothing can batch.
        assert concurrent_batch_sizes(server, clients=4, seconds=0.05) == [1, 1, 1, 1]
        assert "never sees more than one request per batch" in server.log()
    else:
        # While one 0.3 s batch runs, the other requests queue and run together.
        assert max(concurrent_batch_sizes(server, clients=12, seconds=0.3)) > 1


@pytest.mark.parametrize("sleepy_server", ["gevent"], indirect=True)
def test_gevent_answers_healthz_within_100_ms_while_a_long_batch_runs(
    sleepy_server: tuple[str, Server],
) -> None:
    _, server = sleepy_server
    long_request: dict[str, object] = {}

    def run_long_batch() -> None:
        started = time.monotonic()
        response = requests.post(server.url + "/predict/batched", json={"inputs": [1.5]}, timeout=60)
        long_request.update(status=response.status_code, seconds=time.monotonic() - started)

    thread = threading.Thread(target=run_long_batch)
    latencies = []
    with requests.Session() as probe:
        probe.get(server.url + "/healthz", timeout=5)  # open the connection before timing
        thread.start()
        paced = threading.Event()
        while thread.is_alive():
            started = time.monotonic()
            response = probe.get(server.url + "/healthz", timeout=5)
            latencies.append(time.monotonic() - started)
            assert response.status_code == 200
            paced.wait(0.1)  # pacing between probes, not synchronisation
    thread.join()
    assert long_request["status"] == 200
    assert float(long_request["seconds"]) >= 1.5  # type: ignore[arg-type]
    assert len(latencies) >= 5
    assert max(latencies) < 0.1, latencies


def slots_in_log(server: Server) -> dict[int, tuple[int, str]]:
    """pid -> (slot, device), as each worker logged it when it started."""
    return {int(pid): (int(slot), device) for pid, slot, device in SLOT_LINE.findall(server.log())}


def wait_for(condition: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)  # the server offers nothing to block on from outside


def test_a_killed_worker_is_replaced_in_its_slot_and_the_service_keeps_answering() -> None:
    with gunicorn({**SMALL_MLP, "SERVE_WORKERS": "2"}) as server:
        wait_for(lambda: len(slots_in_log(server)) == 2)
        before = slots_in_log(server)
        victim = next(pid for pid, (slot, _) in before.items() if slot == 1)
        body = {"inputs": [[0.25] * 16]}
        assert server.post("/predict/batched", json=body).status_code == 200

        os.kill(victim, signal.SIGKILL)
        answered = 0

        def replaced() -> bool:
            nonlocal answered
            # Requests one at a time, so none is in flight on the victim when it dies.
            response = requests.post(server.url + "/predict/batched", json=body, timeout=30)
            assert response.status_code == 200, response.text
            answered += 1
            return len(slots_in_log(server)) == 3

        wait_for(replaced)
        assert answered >= 1
        successor = next(pid for pid in slots_in_log(server) if pid not in before)
        assert slots_in_log(server)[successor] == before[victim] == (1, "cpu")

        # The successor says the same about itself once it serves.
        seen: dict[int, dict[str, object]] = {}

        def successor_answered() -> bool:
            info = requests.get(server.url + "/info", timeout=30).json()
            seen[info["pid"]] = info
            return successor in seen and seen[successor]["ready"] is True

        wait_for(successor_answered)
        assert (seen[successor]["slot"], seen[successor]["device"]) == (1, "cpu")
        for pid, info in seen.items():
            assert (info["slot"], info["device"]) == slots_in_log(server)[pid]
