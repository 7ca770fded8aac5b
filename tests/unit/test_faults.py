"""In process: a batch-thread fault turns /readyz 503, and the gunicorn hooks' glue."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from flask.testing import FlaskClient

from service.config.settings import Settings
from service.host import lifecycle
from service.runtime import EXTENSION, ModelRuntime
from tests.support.models import SECRET_PATH

SCRIPTED = Settings(model="tests.support.models:scripted", request_timeout_ms=200, stall_timeout_ms=1000)


def test_a_dead_batch_thread_turns_readyz_503_and_refuses_work(
    make_client: Callable[[Settings], FlaskClient],
) -> None:
    client = make_client(SCRIPTED)
    runtime: ModelRuntime = client.application.extensions[EXTENSION]
    faults: list[str] = []
    reported = threading.Event()
    runtime.on_fault = lambda reason: (faults.append(reason), reported.set())  # type: ignore[func-returns-value]
    assert client.get("/readyz").status_code == 200

    dying = client.post("/predict/batched", json={"inputs": ["die"]})
    assert dying.status_code == 500
    assert reported.wait(10)
    assert faults == ["died (SystemExit)"]
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert "batch thread died" in ready.json["error"]  # type: ignore[index]
    refused = client.post("/predict/batched", json={"inputs": ["after"]})
    assert refused.status_code == 503
    assert refused.headers["Retry-After"]
    # Left alone (no host hook would exit it), the process keeps answering probes.
    assert client.get("/healthz").status_code == 200


def test_a_stalled_batch_thread_turns_readyz_503(make_client: Callable[[Settings], FlaskClient]) -> None:
    client = make_client(SCRIPTED)
    runtime: ModelRuntime = client.application.extensions[EXTENSION]
    reported = threading.Event()
    runtime.on_fault = lambda reason: reported.set()
    wedged = client.post("/predict/batched", json={"inputs": ["wedge"]})
    assert wedged.status_code == 504  # its own deadline passes first
    assert reported.wait(10)
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert "is stuck" in ready.json["error"]  # type: ignore[index]
    assert runtime.stop(timeout=30) is False  # returns at once: the thread may never end
    runtime.model._inner.unwedge()  # type: ignore[union-attr]


def fake_worker(app: object, pid: int | None = None) -> SimpleNamespace:
    beats: list[int] = []
    return SimpleNamespace(
        pid=os.getpid() if pid is None else pid,
        wsgi=app,
        alive=True,
        notify=lambda: beats.append(1),
        beats=beats,
        cfg=SimpleNamespace(graceful_timeout=10),
        log=logging.getLogger("gunicorn.error"),
    )


def test_the_hooks_find_the_runtime_only_in_the_worker_itself(client: FlaskClient) -> None:
    runtime = client.application.extensions[EXTENSION]
    assert lifecycle.runtime_of(fake_worker(client.application)) is runtime
    # gunicorn's master calls worker_exit too, with the worker object of a lost child.
    assert lifecycle.runtime_of(fake_worker(client.application, pid=os.getpid() + 1)) is None
    assert lifecycle.runtime_of(fake_worker(object())) is None


def test_a_worker_starts_serving_once_its_model_is_loaded_and_drains_on_exit() -> None:
    from service import create_app

    app = create_app(Settings(model="tests.support.models:scripted_slow_start"))
    runtime: ModelRuntime = app.extensions[EXTENSION]
    worker = fake_worker(app)
    assert runtime.readiness() == "the model is loading"
    lifecycle.serve_when_loaded(worker)
    assert runtime.readiness() is None
    assert worker.beats  # it kept gunicorn's heartbeat while it waited
    assert runtime.on_fault is not None
    lifecycle.drain(worker)
    assert runtime.batcher is not None and not runtime.batcher.running


def test_a_worker_whose_model_fails_to_load_exits_with_gunicorns_boot_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gunicorn.arbiter import Arbiter

    from service import create_app

    app = create_app(Settings(model="tests.support.models:unloadable"))
    worker = fake_worker(app)
    with caplog.at_level(logging.ERROR, logger="gunicorn.error"), pytest.raises(SystemExit) as exited:
        lifecycle.serve_when_loaded(worker)
    # The master halts on this code ("Worker failed to boot.") instead of replacing the worker.
    assert exited.value.code == Arbiter.WORKER_BOOT_ERROR == 3
    assert "Worker failed to boot" in caplog.text
    assert SECRET_PATH in caplog.text  # the reason is in the log, for the operator
    lifecycle.drain(worker)  # gunicorn's worker_exit follows: nothing to drain, and no error
