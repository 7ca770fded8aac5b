"""One copy of the model per host: built in the gunicorn master, shared by every CPU worker.

Real gunicorn, the built-in all-MiniLM-L6-v2 (87 MiB of float32 weights). The
memory figures are each worker's private memory, read from /proc as the
service's own metrics read it; the benchmarks (scripts/bench/sharing.py) measure
the service's PSS and throughput, shared against not.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.telemetry.metrics import memory_rollup
from tests.e2e.test_reliability import eventually
from tests.support.metrics import Scrape
from tests.support.server import Server, gunicorn

pytestmark = pytest.mark.e2e

MIB = 1 << 20
# Half of all-MiniLM-L6-v2's float32 weights: what sharing must at least take off each worker.
HALF_THE_WEIGHTS = 43 * MIB
# Answers are compared across services and requests at 1e-5, and the weights' size is
# float32's: bfloat16 (auto's choice on a CPU with AMX) would round by the batch's shape
# and halve the weights (docs/protocols.md).
FLOAT32 = {"SERVE_PRECISION": "float32"}
SENTENCES = [
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Sharing the weights between workers keeps memory flat as workers are added. " * 6,
]
ROUTES = ("/predict/naive", "/predict/batched")


def answers(server: Server) -> dict[str, np.ndarray]:
    out = {}
    for route in ROUTES:
        response = server.post(route, json={"inputs": SENTENCES})
        assert response.status_code == 200, response.text
        out[route] = np.asarray(response.json()["outputs"])
    return out


def private_bytes(pid: int) -> int:
    rollup = memory_rollup(pid)
    assert rollup is not None
    return rollup.private


def infos(server: Server, workers: int) -> dict[int, dict[str, object]]:
    """/info of each worker (keyed by pid), asked until every one has answered."""
    seen: dict[int, dict[str, object]] = {}
    deadline = time.monotonic() + 30
    while len(seen) < workers and time.monotonic() < deadline:
        # A fresh connection each time, so that the requests reach every worker.
        info = server.get("/info", headers={"Connection": "close"}).json()
        seen[info["pid"]] = info
    assert len(seen) == workers, seen.keys()
    return seen


@pytest.fixture(scope="module")
def unshared() -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """What a worker that builds its own model answers, and its private memory after answering."""
    with gunicorn({"SERVE_WORKERS": "1", "SERVE_SHARE_WEIGHTS": "off", **FLOAT32}) as server:
        outputs = answers(server)
        info = server.get("/info").json()
        assert info["shared_weights"] is False
        yield outputs, private_bytes(server.workers()[0])


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_shared_workers_answer_both_routes_as_unshared_ones_and_hold_far_less_of_their_own(
    unshared: tuple[dict[str, np.ndarray], int], worker_class: str
) -> None:
    reference, unshared_private = unshared
    env = {"SERVE_WORKERS": "2", "SERVE_WORKER_CLASS": worker_class, "SERVE_TORCH_THREADS": "2", **FLOAT32}
    with gunicorn(env) as server:
        assert "built once for every worker" in server.log()
        assert all(info["shared_weights"] is True for info in infos(server, 2).values())
        for _ in range(4):  # enough requests that both workers answer on both routes
            for route, outputs in answers(server).items():
                np.testing.assert_allclose(outputs, reference[route], atol=1e-5)
        for pid in server.workers():
            assert private_bytes(pid) < unshared_private - HALF_THE_WEIGHTS, (pid, unshared_private)
        scrape = Scrape.parse(server.get("/metrics").text)
        assert len(scrape.series("serve_worker_private_memory_bytes")) == 2
        assert len(scrape.series("serve_worker_proportional_memory_bytes")) == 2
        assert scrape.total("serve_master_proportional_memory_bytes") > 0


def test_a_worker_that_replaces_a_killed_one_shares_like_the_first(
    unshared: tuple[dict[str, np.ndarray], int],
) -> None:
    reference, unshared_private = unshared
    with gunicorn({"SERVE_WORKERS": "2", **FLOAT32}) as server:
        first = set(server.workers())
        killed = min(first)
        os.kill(killed, signal.SIGKILL)
        eventually(lambda: len(set(server.workers()) - first) == 1, "the master replaced the killed worker")
        (replacement,) = set(server.workers()) - first
        # Asked until both workers have answered: the replacement serves once it is ready.
        assert infos(server, 2)[replacement]["shared_weights"] is True
        for route, outputs in answers(server).items():
            np.testing.assert_allclose(outputs, reference[route], atol=1e-5)
        assert private_bytes(replacement) < unshared_private - HALF_THE_WEIGHTS


def test_a_reload_builds_the_model_again_for_the_new_workers(model_dirs: dict[str, Path]) -> None:
    with gunicorn({"SERVE_MODEL": str(model_dirs["rerank"]), "SERVE_WORKERS": "2"}) as server:
        old = set(server.workers())
        server.signal(signal.SIGHUP)
        eventually(lambda: not old & set(server.workers()) and len(server.workers()) == 2, "new workers")
        eventually(lambda: server.get("/readyz").status_code == 200, "the new workers are ready")
        assert server.log().count("built once for every worker") == 2
        assert all(info["shared_weights"] is True for info in infos(server, 2).values())
        response = server.post("/rerank/batched", json={"query": "cats", "documents": ["a cat", "stocks"]})
        assert response.status_code == 200, response.text
