"""End to end: real gunicorn, real default model, every route and the error cases."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests

from scripts.bench.overhead import FREE_MODEL
from scripts.fixtures import free_model
from service.host import allocator, open_files
from service.topology.plan import SHED_HEADROOM
from tests.support.models import SECRET_PATH
from tests.support.server import Server, gunicorn, gunicorn_exit

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def minilm() -> Iterator[Server]:
    with gunicorn({"SERVE_WORKERS": "1"}) as server:
        yield server


def test_default_model_serves_real_embeddings_on_both_routes(minilm: Server) -> None:
    body = {"inputs": ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue."]}
    naive = minilm.post("/predict/naive", json=body)
    batched = minilm.post("/predict/batched", json=body)
    assert naive.status_code == batched.status_code == 200
    assert naive.headers["Content-Type"] == "application/json"
    assert batched.json()["model"] == "all-MiniLM-L6-v2"
    a, b = np.array(naive.json()["outputs"]), np.array(batched.json()["outputs"])
    assert a.shape == (3, 384)
    # The same embeddings, within the routes' stated tolerance: in the default precision
    # (bfloat16 on a CPU with AMX) the batcher may cut the three into calls of other shapes
    # than the naive route's one, which moves the rounding (docs/protocols.md).
    assert (a * b).sum(axis=1).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)
    similar, unrelated = a[0] @ a[1], a[0] @ a[2]
    assert similar > unrelated + 0.3


def test_probes_and_info(minilm: Server) -> None:
    assert minilm.get("/healthz").json() == {"status": "ok"}
    assert minilm.get("/readyz").json() == {"status": "ready"}
    info = minilm.get("/info").json()
    assert info["model"]["name"] == "all-MiniLM-L6-v2"
    assert info["model"]["item_kind"] == "text"
    assert info["model"]["item_shape"] == [384]
    assert info["batching"]["max_batch_size"] == 64
    # The master preloads jemalloc wherever the host has it (service.host.allocator).
    assert info["allocator"] == ("jemalloc" if allocator.find() else "system")


def test_a_worker_may_open_a_descriptor_for_every_connection_it_accepts(minilm: Server) -> None:
    # The plan's connections (a running batch, a full queue, the probes and the
    # refusals held under overload), raised from the soft limit many hosts start
    # with, as far as the hard limit allows (service.host.open_files).
    want = open_files.needed(64 + 256 + 8 + SHED_HEADROOM)
    [worker] = minilm.workers()
    line = next(
        line
        for line in Path(f"/proc/{worker}/limits").read_text().splitlines()
        if line.startswith("Max open files")
    )
    soft, hard = (float(value) if value != "unlimited" else float("inf") for value in line.split()[3:5])
    assert soft >= min(want, hard), line


def test_serve_allocator_system_keeps_glibc_s_malloc() -> None:
    with gunicorn({"SERVE_WORKERS": "1", "SERVE_MODEL": "mlp", "SERVE_ALLOCATOR": "system"}) as server:
        assert server.get("/info").json()["allocator"] == "system"
        log = Path(server.log_path).read_text()
        assert "allocator: system: glibc's malloc (SERVE_ALLOCATOR=system)" in log


@pytest.mark.parametrize(
    ("kwargs", "status"),
    [
        ({"data": b"{nope", "headers": {"Content-Type": "application/json"}}, 400),
        ({"data": b'{"inputs": ["x"]}', "headers": {"Content-Type": "text/plain"}}, 415),
        ({"json": {"inputs": []}}, 422),
        ({"json": {"inputs": ["ok", 7]}}, 422),
        ({"json": {"inputs": ["x"] * 2049}}, 413),  # OpenAI's 2,048 inputs, the default limit
        ({"data": b"x" * (9 << 20), "headers": {"Content-Type": "application/json"}}, 413),
    ],
)
def test_error_cases_get_json_errors(minilm: Server, kwargs: dict[str, object], status: int) -> None:
    for route in ("/predict/naive", "/predict/batched"):
        response = minilm.post(route, **kwargs)
        assert response.status_code == status, response.text
        assert "error" in response.json()
        assert "Traceback" not in response.text


def test_a_body_declared_over_the_limit_gets_413_and_a_closing_connection(minilm: Server) -> None:
    # Refused unread: the answer says the connection closes, so the client does not
    # send its next request on a connection the server is about to drop.
    declared = 9 << 20  # past the 8 MiB default by more than werkzeug reads to check
    with socket.create_connection(("127.0.0.1", minilm.port), timeout=30) as sock:
        sock.sendall(
            b"POST /predict HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % declared + b'{"inputs": ["'
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"connection: close" in head.lower(), head
    assert b"SERVE_MAX_BODY_BYTES" in body


def test_concurrent_requests_are_batched_and_each_gets_its_own_outputs(minilm: Server) -> None:
    sentences = [f"sentence number {i} about topic {i % 5}" for i in range(48)]
    reference = np.array(minilm.post("/predict/naive", json={"inputs": sentences}).json()["outputs"])

    def one(i: int) -> tuple[int, list[float], int]:
        response = requests.post(minilm.url + "/predict/batched", json={"inputs": [sentences[i]]}, timeout=60)
        return response.status_code, response.json()["outputs"][0], int(response.headers["X-Batch-Size"])

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(len(sentences))))
    assert all(status == 200 for status, _, _ in results)
    outputs = np.array([output for _, output, _ in results])
    # Each answer is its own sentence's, nearest its reference of all 48. In the
    # default precision (bfloat16 on a CPU with AMX) the batch's shape moves the
    # rounding: held to the routes' stated tolerance (docs/protocols.md).
    cosines = outputs @ reference.T  # unit vectors
    assert (cosines.argmax(axis=1) == np.arange(len(sentences))).all()
    assert np.diag(cosines).min() >= 0.999
    assert max(size for _, _, size in results) > 1


def test_sigterm_stops_cleanly() -> None:
    with gunicorn({"SERVE_MODEL": "mlp", "SERVE_WORKERS": "1"}) as server:
        assert server.post("/predict", json={"inputs": [[0.0] * 256]}).status_code == 200
        server.signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
        assert "Shutting down: Master" in server.log()


def test_a_model_that_fails_to_load_stops_the_service_with_the_reason_in_the_log() -> None:
    # Built once in the master (service.host.preload): it stops before any worker starts.
    code, log = gunicorn_exit({"SERVE_MODEL": "tests.support.models:unloadable", "SERVE_WORKERS": "4"})
    assert code == 3, log  # gunicorn's WORKER_BOOT_ERROR, as when a worker cannot load it
    assert "stopping the service: model 'tests.support.models:unloadable' failed to load" in log
    assert SECRET_PATH in log
    assert "Booting worker" not in log


def test_a_model_that_fails_to_load_in_its_workers_stops_the_service_with_the_reason_in_the_log() -> None:
    # Four workers fail at once: only one reports the boot error, since a second one,
    # reaped while the master halts, would turn gunicorn's exit code 3 into 1.
    env = {
        "SERVE_MODEL": "tests.support.models:unloadable",
        "SERVE_WORKERS": "4",
        "SERVE_SHARE_WEIGHTS": "off",
    }
    code, log = gunicorn_exit(env)
    assert code == 3, log  # gunicorn's WORKER_BOOT_ERROR, passed on by the master
    assert "Reason: Worker failed to boot." in log
    assert log.count("exited with code 3") == 1, log
    assert "Worker failed to boot: model 'tests.support.models:unloadable' failed to load" in log
    assert SECRET_PATH in log


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("models/none-such.pt", ["gunicorn_conf.py: SERVE_MODEL='models/none-such.pt': no such file under "]),
        ("minlm", ["gunicorn_conf.py: SERVE_MODEL must be one of minilm, mlp", "(did you mean minilm?)"]),
    ],
)
def test_a_model_that_cannot_exist_stops_the_master_before_any_worker(
    model: str, fragments: list[str]
) -> None:
    code, log = gunicorn_exit({"SERVE_MODEL": model}, timeout=30)
    assert code == 1
    assert all(fragment in log for fragment in fragments), log
    assert "Booting worker" not in log


def test_a_gevent_worker_answers_concurrent_requests_to_a_cheap_model_in_batches() -> None:
    # A model this cheap runs its batches on the hub's own thread (Batcher._on_hub), not the batch thread's.
    env = {
        "SERVE_WORKER_CLASS": "gevent",
        "SERVE_WORKERS": "1",
        "SERVE_MODEL": FREE_MODEL,
    }
    with gunicorn(env) as server, requests.Session() as warm:
        for _ in range(3):  # the model's time is measured by its first batches, on the batch thread
            assert warm.post(server.url + "/predict/batched", json={"inputs": ["x"]}, timeout=30).ok

        def client(k: int) -> list[tuple[int, int, bool]]:
            with requests.Session() as session:
                answers = []
                for i in range(25):
                    texts = [f"text {k} {i}"] * (1 + i % 3)
                    response = session.post(
                        server.url + "/predict/batched", json={"inputs": texts}, timeout=30
                    )
                    outputs = np.array(response.json()["outputs"]) if response.ok else np.zeros(0)
                    right = outputs.shape == (len(texts), 384) and np.allclose(outputs, free_model.VECTOR)
                    answers.append(
                        (response.status_code, int(response.headers.get("X-Batch-Size", 0)), right)
                    )
                return answers

        with ThreadPoolExecutor(16) as pool:
            answers = [answer for got in pool.map(client, range(16)) for answer in got]
        assert [(status, right) for status, _, right in answers] == [(200, True)] * 400
        assert max(size for _, size, _ in answers) > 3  # several requests a batch
        assert "Traceback" not in server.log()


def test_a_gevent_worker_loads_a_model_that_starts_a_process_while_loading() -> None:
    # The model loads in a native thread; gevent's own subprocess works only on the main hub.
    # Built in the worker (with sharing on, the master builds it, before gevent patches anything).
    env = {
        "SERVE_WORKER_CLASS": "gevent",
        "SERVE_WORKERS": "1",
        "SERVE_MODEL": "tests.support.models:spawning",
        "SERVE_SHARE_WEIGHTS": "off",
    }
    with gunicorn(env) as server:
        response = server.post("/predict/batched", json={"inputs": ["four"]})
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == [[4.0]]
        assert "Using worker: service.host.gevent_worker.GeventWorker" in server.log()
