"""A worker applies its slot's device and GPU memory share before the model loads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from flask.testing import FlaskClient

from service.config.settings import Settings
from service.runtime import EXTENSION, LOAD_FAILED

ECHO = Settings(model="tests.support.models:echo", torch_threads=1)


def test_a_cpu_worker_reports_its_slot_and_device(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(ECHO.replace(worker_slot=3, worker_device="cpu"))
    info = client.get("/info").get_json()
    assert (info["slot"], info["device"], info["gpu_memory_fraction"]) == (3, "cpu", None)
    assert info["ready"]


def test_without_a_plan_slot_is_null(make_client: Callable[[Settings], FlaskClient]) -> None:
    info = make_client(ECHO).get("/info").get_json()
    assert info["slot"] is None
    assert info["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_gpu_worker_caps_its_allocator_at_the_planned_fraction(
    make_client: Callable[[Settings], FlaskClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # This machine has no GPU: only torch's two CUDA calls are stood in for. The
    # echo model never touches the device, so nothing else needs one.
    calls: list[tuple[float, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    client = make_client(
        ECHO.replace(worker_slot=1, worker_device="cuda:2", worker_gpu_memory_fraction=0.481)
    )
    assert calls == [(0.481, 0)]  # device 0: the worker sees its one GPU alone
    info = client.get("/info").get_json()
    assert (info["slot"], info["device"], info["gpu_memory_fraction"]) == (1, "cuda:2", 0.481)
    assert info["model"]["device"] == "cuda"


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks a worker planned on a GPU that torch cannot use"
)
def test_a_worker_planned_on_a_gpu_torch_cannot_use_is_not_ready(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(ECHO.replace(worker_device="cuda:0", worker_gpu_memory_fraction=0.5))
    response = client.get("/readyz")
    assert response.status_code == 503
    # A load failure like any other: the client gets the fixed text, the log the
    # reason, and under gunicorn the worker exits with its boot error.
    assert response.get_json()["error"] == LOAD_FAILED
    runtime = client.application.extensions[EXTENSION]
    assert "the plan gives this worker cuda:0, but torch sees no CUDA device" in runtime.load_error
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(("threads", "in_callers"), [(1, True), (2, False)])
def test_request_threads_run_a_lone_cheap_call_only_with_one_intra_op_thread(
    make_client: Callable[[Settings], FlaskClient], threads: int, in_callers: bool
) -> None:
    # With more, each request thread that called torch would start an OpenMP pool of its own.
    before = torch.get_num_threads()
    try:
        client = make_client(ECHO.replace(torch_threads=threads))
        batcher = client.application.extensions[EXTENSION].default.batcher
        assert batcher._run_in_callers is in_callers
    finally:
        torch.set_num_threads(before)
